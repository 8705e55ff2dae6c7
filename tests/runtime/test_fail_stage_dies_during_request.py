"""kill -9 of any one stage mid-generation: the client gets a typed error naming that stage within
2 s, the run shuts itself down, and nothing of it remains (processes, /dev/shm)."""

import os
import signal

import pytest

from coli.serve.client import StageDeadError
from failures import drain_until_error, long_stream
from harness import assert_run_gone
from oracles import load_oracle


@pytest.mark.timeout(180)
@pytest.mark.parametrize("stage", ["reader", "ramtier", "executor"])
def test_kill_stage_mid_generation(default_oracle, start_run, stage):
    o = load_oracle(default_oracle)
    # a RAM tier smaller than a layer keeps the reader busy on every step
    run = start_run(default_oracle, ram_gb=0.0004)
    c, it = long_stream(run, o)
    os.kill(run.stage_pids[stage], signal.SIGKILL)
    err, dt = drain_until_error(it, StageDeadError)
    assert err.stage == stage and stage in str(err)
    print(f"{stage}: StageDead after {dt:.3f} s")
    assert dt < 2.0, f"the client learnt of the death after {dt:.2f} s"
    c.close()
    run.proc.wait(30)
    assert_run_gone(run)
    assert f"stage {stage!r}" in run.output()
