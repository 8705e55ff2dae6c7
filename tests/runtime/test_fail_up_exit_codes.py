"""`coli up` tells the truth about how its run ended: non-zero when a stage crashed, a failure (naming the
port) when --http cannot listen, and a start-up crash's cause where it points the user: the stage's log."""

import json
import socket
import subprocess
import sys

import pytest

from harness import assert_run_gone, env_for


@pytest.mark.timeout(120)
def test_up_exits_non_zero_when_a_stage_crashed(default_oracle, start_run):
    import os
    import signal

    run = start_run(default_oracle)
    os.kill(run.stage_pids["executor"], signal.SIGKILL)
    assert run.proc.wait(30) == 1, run.output()
    assert "stage 'executor'" in run.output() and "killed by signal 9" in run.output()
    assert_run_gone(run)


@pytest.mark.timeout(120)
def test_up_is_stopped_cleanly_exits_zero(default_oracle, start_run):
    run = start_run(default_oracle)
    r = run.coli("down", "--name", run.name)
    assert r.returncode == 0, r.stderr
    assert run.proc.wait(30) == 0, run.output()


@pytest.mark.timeout(120)
def test_startup_crash_cause_is_in_the_stage_log_it_points_to(default_oracle, start_run):
    run = start_run(default_oracle, extra_env={"COLI_INJECT": "start_crash_executor:1"}, wait=False)
    assert run.proc.wait(90) != 0
    out = run.output()
    assert f"see `coli logs --name {run.name} --stage executor`" in out, out
    assert "injected start-up crash of stage 'executor'" in out  # the cause, on the terminal too
    r = run.coli("logs", "--name", run.name, "--stage", "executor", "--json")
    recs = [json.loads(line) for line in r.stdout.splitlines()]
    assert any(rec.get("event") == "stage_failed" and "injected start-up crash" in rec.get("error", "")
               for rec in recs), r.stdout + r.stderr


@pytest.mark.timeout(120)
def test_up_detached_with_a_busy_http_port_fails_naming_it(default_oracle, rt_root):
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    port = busy.getsockname()[1]
    env = env_for(rt_root / "runs", rt_root / "cache")
    try:
        r = subprocess.run([sys.executable, "-m", "coli.cli.main", "up", "--model", str(default_oracle), "--name",
                            "busyport", "--http", f"127.0.0.1:{port}", "-d"], env=env, capture_output=True, text=True,
                           timeout=90)
    finally:
        busy.close()
    assert r.returncode != 0, r.stdout + r.stderr
    assert f"127.0.0.1:{port}" in r.stderr and "pick another port" in r.stderr, r.stderr
    st = subprocess.run([sys.executable, "-m", "coli.cli.main", "status", "--name", "busyport"], env=env,
                        capture_output=True, text=True, timeout=30)
    assert st.returncode != 0  # no run was left behind without its gateway


@pytest.mark.timeout(120)
def test_supervisor_startup_failure_is_in_its_log(default_oracle, rt_root):
    from harness import Run

    run = Run(default_oracle, "baddevice", rt_root / "runs", rt_root / "cache", args=("--device", "tpu"))
    assert run.proc.wait(60) != 0
    shown = run.output().strip().splitlines()[-1]
    r = run.coli("logs", "--name", run.name, "--stage", "supervisor", "--json")
    recs = [json.loads(line) for line in r.stdout.splitlines()]
    failed = [rec for rec in recs if rec.get("event") == "startup_failed"]
    assert failed and failed[-1]["error"] in shown, (shown, recs)
    run.stop()
