"""A stage that dies during start-up: `coli up` fails with a message naming the stage and the exit,
and leaves no process and no shared memory behind."""

import pytest

from harness import shm_left, wait_gone


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", ["reader", "executor"])
def test_stage_crash_at_startup(default_oracle, start_run, stage):
    run = start_run(default_oracle, extra_env={"COLI_INJECT": f"start_crash_{stage}:1"}, wait=False)
    rc = run.proc.wait(90)
    out = run.output()
    assert rc != 0
    assert f"stage {stage!r} exited with code" in out and "during start-up" in out, out
    import re
    arenas = re.findall(r"coli-[\w.-]+-(?:experts|residency)", out)
    assert not shm_left(arenas)
    assert not wait_gone([run.proc.pid])
    import subprocess
    ps = subprocess.run(["pgrep", "-f", f"coli-{run.name}-"], capture_output=True, text=True)
    assert ps.stdout.strip() == "", f"leftover processes: {ps.stdout}"
