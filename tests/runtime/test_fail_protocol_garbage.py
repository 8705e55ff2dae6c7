"""Garbage bytes, an oversized message, a wrong protocol version and an unknown kind sent to each
stage's socket: the stage logs a ProtocolError and keeps serving."""

import json
import time

import msgpack
import pytest
import zmq

from coli.protocol.codec import MAX_MESSAGE_BYTES
from coli.protocol.messages import Hello
from oracles import load_oracle

BAD = {
    "garbage": [b"\x00\xff\xfe garbage"],
    "oversized": [bytes([Hello.KIND]), b"\x81" + b"x" * (MAX_MESSAGE_BYTES + 16)],
    "wrong_version": [bytes([Hello.KIND]), msgpack.packb({"stage": "intruder", "pid": 1, "protocol_version": 999})],
    "unknown_kind": [bytes([0xEE]), msgpack.packb({"a": 1})],
}


@pytest.mark.timeout(240)
def test_each_stage_survives_bad_messages(default_oracle, start_run):
    o = load_oracle(default_oracle)
    run = start_run(default_oracle, ram_gb=0.0004)
    ctx = zmq.Context()
    endpoints = {"reader": "reader", "ramtier": "ramtier", "executor": "executor", "supervisor": "client"}
    socks = []
    for stage, ep in endpoints.items():
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(f"ipc://{run.run_base / run.name / (ep + '.sock')}")
        socks.append(s)
        for frames in BAD.values():
            s.send_multipart(frames)
    time.sleep(1.5)
    for s in socks:
        s.close()
    ctx.term()
    ids = ",".join(map(str, o["prompt_ids"]))
    r = run.coli("chat", "--name", run.name, "--prompt-ids", ids, "--max-tokens", "32", "--greedy", "--ignore-eos",
                 "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["tokens"] == o["greedy_tokens"]
    logs = [json.loads(line) for line in run.coli("logs", "--name", run.name, "--json").stdout.splitlines()]
    for stage in endpoints:
        errs = [rec for rec in logs if rec.get("stage") == stage and rec.get("event") == "protocol_error"]
        text = " ".join(rec.get("error", "") for rec in errs)
        assert len(errs) >= 4, f"{stage}: {len(errs)} protocol errors logged: {text}"
        assert "MAX_MESSAGE_BYTES" in text and "999" in text, f"{stage}: {text}"
