"""A stopped supervisor (SIGSTOP, Ctrl-Z) answers nothing: a waiting `coli chat` (the blocking client) is
told after the run's --stage-timeout, naming the supervisor's pid, instead of waiting out its 300 s token
timeout. After SIGCONT the run serves again, the same client included."""

import os
import signal

import pytest

from coli.serve.client import Client, RunUnresponsive
from failures import drain_until_error
from harness import assert_run_gone
from oracles import load_oracle

STAGE_TIMEOUT = 2.0  # margin for a loaded CI machine: the other stages must keep beating meanwhile


@pytest.mark.timeout(180)
def test_stopped_supervisor_is_named_and_the_run_resumes(default_oracle, start_run):
    o = load_oracle(default_oracle)
    run = start_run(default_oracle, ram_gb=0.0004, args=("--stage-timeout", str(STAGE_TIMEOUT)))
    c = Client(run.name, base=str(run.run_base))
    it = c.stream(o["prompt_ids"], 3000, greedy=True, ignore_eos=True, token_timeout=300)
    assert isinstance(next(it), int)
    os.kill(run.proc.pid, signal.SIGSTOP)
    try:
        err, took = drain_until_error(it, RunUnresponsive, timeout=STAGE_TIMEOUT + 2)
        assert took < STAGE_TIMEOUT + 2, f"told after {took:.1f} s"
        assert f"supervisor (pid {run.proc.pid})" in str(err) and "SIGCONT" in str(err)
    finally:
        os.kill(run.proc.pid, signal.SIGCONT)
    got = c.generate(o["prompt_ids"], 16, greedy=True, ignore_eos=True, token_timeout=60)
    assert got.tokens == o["greedy_tokens"][:16]
    c.close()
    run.stop()
    assert_run_gone(run)
