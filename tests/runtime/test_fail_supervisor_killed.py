"""kill -9 of the supervisor: its stages notice, exit and unlink the run's shared memory; the next
`coli up` of the same name (or `coli down`) cleans the stale run directory and says so."""

import os
import signal

import pytest

from failures import long_stream
from harness import Run, assert_run_gone
from oracles import load_oracle


@pytest.mark.timeout(180)
def test_supervisor_sigkill_leaves_nothing(default_oracle, start_run):
    o = load_oracle(default_oracle)
    run = start_run(default_oracle, ram_gb=0.0004)
    c, it = long_stream(run, o)
    os.kill(run.proc.pid, signal.SIGKILL)
    run.proc.wait(10)
    assert_run_gone(run)  # every stage gone, /dev/shm clean, without any help
    c.close()
    # the run dir is stale now: a new `coli up` with the same name cleans it and says so
    again = Run(default_oracle, run.name, run.run_base, run.run_base.parent / "cache")
    try:
        again.wait_ready()
        assert "cleaned up stale run" in again.output()
    finally:
        again.stop()
    again.proc.wait(30)
    assert_run_gone(again)


@pytest.mark.timeout(120)
def test_coli_down_cleans_a_dead_run(default_oracle, start_run):
    run = start_run(default_oracle)
    os.kill(run.proc.pid, signal.SIGKILL)
    run.proc.wait(10)
    assert_run_gone(run)
    r = run.coli("down", "--name", run.name)
    assert r.returncode == 0 and "cleaned up stale run" in r.stdout, r.stdout + r.stderr
    assert not (run.run_base / run.name / "pid").exists()


@pytest.mark.timeout(120)
def test_client_waiting_on_a_killed_supervisor_is_told_within_2s(default_oracle, start_run):
    from coli.serve.client import RunGone
    from failures import drain_until_error

    o = load_oracle(default_oracle)
    run = start_run(default_oracle, ram_gb=0.0004)
    c, it = long_stream(run, o)  # waits up to token_timeout=30 s for each token
    os.kill(run.proc.pid, signal.SIGKILL)
    err, took = drain_until_error(it, RunGone, timeout=2)
    assert took < 2.0, f"told after {took:.1f} s"
    assert f"supervisor (pid {run.proc.pid}) died" in str(err) and run.name in str(err)
    c.close()
    run.proc.wait(10)
    assert_run_gone(run)
