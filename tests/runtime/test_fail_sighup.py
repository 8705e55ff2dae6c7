"""A foreground `coli up` whose terminal closes (SIGHUP to its whole process group) stops cleanly, like
SIGTERM: the client in flight gets a typed error, nothing is left in /dev/shm. A process group killed
with SIGKILL cleans nothing itself; the next `coli up` or `coli down` of ANY name removes its segments."""

import os
import signal
import time

import pytest

from coli.serve.client import Client, RequestError
from harness import assert_run_gone, shm_left
from oracles import load_oracle


@pytest.mark.timeout(180)
def test_sighup_of_the_group_stops_the_run_cleanly(default_oracle, start_run):
    o = load_oracle(default_oracle)
    run = start_run(default_oracle)
    c = Client(run.name, base=str(run.run_base))
    it = c.stream(o["prompt_ids"], 3000, greedy=True, ignore_eos=True, token_timeout=30)
    assert isinstance(next(it), int)
    os.killpg(run.proc.pid, signal.SIGHUP)  # the terminal closed: the supervisor and every stage get it
    t0 = time.monotonic()
    with pytest.raises(RequestError, match="shutting down: signal SIGHUP"):
        for _ in it:
            assert time.monotonic() - t0 < 10, "the stream kept going after SIGHUP"
    c.close()
    assert run.proc.wait(30) == 0, run.output()
    assert "stopped: signal SIGHUP" in run.output()
    assert_run_gone(run)


@pytest.mark.timeout(240)
def test_sigkilled_groups_are_swept_by_up_and_down_of_other_names(default_oracle, start_run):
    a = start_run(default_oracle)
    os.killpg(a.proc.pid, signal.SIGKILL)  # nobody of run a is left to unlink its arenas
    a.proc.wait(10)
    time.sleep(0.5)
    assert shm_left(a.arenas) == a.arenas, "the SIGKILLed group should have left its segments"
    b = start_run(default_oracle)  # another name
    assert not shm_left(a.arenas)
    assert f"run(s) {a.name!r}" in b.output()
    assert shm_left(b.arenas) == b.arenas  # b's own, live segments are kept
    os.killpg(b.proc.pid, signal.SIGKILL)
    b.proc.wait(10)
    time.sleep(0.5)
    assert shm_left(b.arenas) == b.arenas
    r = b.coli("down", "--name", "no-such-run")
    assert r.returncode != 0 and "no run named 'no-such-run'" in r.stderr
    assert f"run(s) {b.name!r}" in r.stdout, r.stdout + r.stderr
    assert not shm_left(b.arenas)


@pytest.mark.timeout(180)
def test_sighup_during_startup_leaves_nothing(default_oracle, start_run):
    import json

    from harness import wait_gone

    run = start_run(default_oracle, wait=False)
    state_file = run.run_base / run.name / "state.json"
    deadline = time.monotonic() + 90
    st = {}
    while time.monotonic() < deadline:  # the arenas exist and the stages are being started
        try:
            st = json.loads(state_file.read_text())
        except (OSError, ValueError):
            st = {}
        if st.get("state") == "starting" and st.get("arenas") and st.get("stages"):
            break
        assert run.proc.poll() is None, run.output()
        time.sleep(0.01)
    assert st.get("state") == "starting", f"never saw the run starting: {st}"
    os.killpg(run.proc.pid, signal.SIGHUP)
    assert run.proc.wait(30) != 0
    assert not wait_gone([s["pid"] for s in st["stages"].values()])
    time.sleep(0.2)
    assert not shm_left(st["arenas"]), shm_left(st["arenas"])
