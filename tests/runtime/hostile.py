"""A hostile peer of the same user: a real ZeroMQ DEALER on a live run's stage socket that sends
well-formed messages the stage must refuse, and the checks every hostile-message test ends with (the
run still serves the oracle's exact tokens, every stage still ready)."""

from __future__ import annotations

import json
import time

import zmq

from coli.container.reader import ContainerReader
from coli.protocol.messages import ReadRequest
from coli.protocol.sockets import recv, send


class Intruder:
    def __init__(self, run, stage: str, identity: bytes = b"intruder"):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.IDENTITY, identity)
        self.sock.connect(f"ipc://{run.run_base / run.name / (stage + '.sock')}")

    def send(self, msg) -> None:
        send(self.sock, msg)

    def replies(self, n: int, timeout: float = 10.0) -> list:
        """The next `n` messages for us; fewer if they do not come within `timeout`."""
        out, deadline = [], time.monotonic() + timeout
        while len(out) < n and time.monotonic() < deadline:
            if self.sock.poll(50):
                out.append(recv(self.sock))
        return out

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


def container_of(run) -> ContainerReader:
    return ContainerReader(run.state["container"], cache_dense=False)


def read_request(container: ContainerReader, layer: int, expert: int, slot: int, **override) -> ReadRequest:
    """A ReadRequest exactly as the RAM tier would send it for (layer, expert) into `slot`, fields overridable."""
    loc = container.record_location(layer, expert)
    f = dict(request_id=layer * container.config.n_routed_experts + expert, layer=layer, expert=expert, slot=slot,
             file=loc.path, offset=loc.offset, length=loc.length, checksum=loc.xxh64)
    f.update(override)
    return ReadRequest(**f)


def assert_still_serves(run, o, n: int = 32) -> None:
    """The run answers the oracle prompt with transformers' exact greedy tokens and every stage is ready."""
    ids = ",".join(map(str, o["prompt_ids"]))
    r = run.coli("chat", "--name", run.name, "--prompt-ids", ids, "--max-tokens", str(n), "--greedy",
                 "--ignore-eos", "--json", timeout=60)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["tokens"] == o["greedy_tokens"][:n]
    st = json.loads(run.coli("status", "--name", run.name, "--json").stdout)
    assert {n: s["state"] for n, s in st["stages"].items()} == {"reader": "ready", "ramtier": "ready",
                                                                "executor": "ready"}


def log_events(run, stage: str, event: str) -> list[dict]:
    out = run.coli("logs", "--name", run.name, "--json").stdout.splitlines()
    recs = [json.loads(line) for line in out if line.strip()]
    return [r for r in recs if r.get("stage") == stage and r.get("event") == event]
