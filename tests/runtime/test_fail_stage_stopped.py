"""A stage that hangs as a whole (SIGSTOP): it stops sending heartbeats, and after --stage-timeout the
supervisor fails every waiting request with a typed error naming the stage, `coli status` says the stage
is unresponsive and why, and new requests are refused the same way. The run stays up: after SIGCONT the
stage beats again and the run serves the right tokens."""

import json
import os
import signal
import time

import pytest

from coli.serve.client import Client, StageUnresponsiveError
from failures import drain_until_error
from harness import assert_run_gone
from oracles import load_oracle

STAGE_TIMEOUT = 2.0  # margin for a loaded CI machine: the other stages must keep beating meanwhile


@pytest.mark.timeout(180)
@pytest.mark.parametrize("stage", ["executor", "ramtier"])
def test_stopped_stage_is_named_within_the_stage_timeout(default_oracle, start_run, stage):
    o = load_oracle(default_oracle)
    run = start_run(default_oracle, ram_gb=0.0004, args=("--stage-timeout", str(STAGE_TIMEOUT)))
    pid = run.stage_pids[stage]
    c = Client(run.name, base=str(run.run_base))
    it = c.stream(o["prompt_ids"], 3000, greedy=True, ignore_eos=True, token_timeout=60)
    assert isinstance(next(it), int)
    os.kill(pid, signal.SIGSTOP)
    try:
        err, took = drain_until_error(it, StageUnresponsiveError, timeout=STAGE_TIMEOUT + 2)
        assert err.stage == stage and err.code == "stage_unresponsive"
        assert f"pid {pid}" in str(err) and "stopped" in str(err) and "--stage-timeout" in str(err)
        assert took < STAGE_TIMEOUT + 2, f"told after {took:.1f} s"

        st = json.loads(run.coli("status", "--name", run.name, "--json").stdout)
        assert st["stages"][stage]["state"] == "unresponsive"
        assert st["stages"][stage]["heartbeat_age_s"] > STAGE_TIMEOUT
        text = run.coli("status", "--name", run.name)
        assert "unresponsive" in text.stdout and "SIGSTOP" in text.stdout, text.stdout + text.stderr

        with pytest.raises(StageUnresponsiveError, match=f"stage '{stage}'"):  # refused while it is silent
            c.generate(o["prompt_ids"], 4, greedy=True, ignore_eos=True, token_timeout=10)
    finally:
        os.kill(pid, signal.SIGCONT)
    deadline = time.monotonic() + 10
    while json.loads(run.coli("status", "--name", run.name, "--json").stdout)["stages"][stage]["state"] != "ready":
        assert time.monotonic() < deadline, "the stage did not come back after SIGCONT"
        time.sleep(0.2)
    got = c.generate(o["prompt_ids"], 16, greedy=True, ignore_eos=True, token_timeout=60)
    assert got.tokens == o["greedy_tokens"][:16]
    c.close()
    run.stop()
    assert_run_gone(run)
