"""Several `coli up --name X` started at the same instant, over the stale run dir a SIGKILLed run left:
the claim on the run is atomic (an flock), so exactly one of them cleans up, comes up and serves; the
others exit non-zero saying the run is already up or starting, and touch nothing of the winner's run.

The `coli up`s import everything first and then wait on a barrier file, so they reach the claim within
microseconds of each other (process start-up alone varies by far more than the old check-then-write
window)."""

import os
import signal
import subprocess
import sys
import time

import pytest

from coli.serve.client import Client
from harness import Run, assert_run_gone, env_for
from oracles import load_oracle

BARRIER = """
import os, select, sys
from coli.cli.main import app
ready, go = sys.argv[1], sys.argv[2]
fifo = os.open(go, os.O_RDONLY | os.O_NONBLOCK)
open(ready, "w").close()
select.select([fifo], [], [])  # one write to the FIFO wakes every waiter at the same instant
sys.argv = ["coli", *sys.argv[3:]]
app()
"""


class BarrierUp(Run):
    """`coli up` that waits for `go` after its imports (Run's log, state and stop logic)."""

    def __init__(self, model, name, rt_root, i, go):
        self.name, self.run_base = name, rt_root / "runs"
        self.env = env_for(self.run_base, rt_root / "cache")
        self.log = rt_root / f"{name}-{i}.up.out"
        self.ready = rt_root / f"{name}-{i}.ready"
        self.ready.unlink(missing_ok=True)
        self._out = open(self.log, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", BARRIER, str(self.ready), str(go), "up", "--model", str(model), "--name", name,
             "--ram-gb", "1", "--startup-timeout", "60", "--experts", "f32", "--dense", "f32"],  # as Run converts
            env=self.env, stdout=self._out, stderr=subprocess.STDOUT, start_new_session=True)
        self.state = {}


@pytest.mark.timeout(240)
def test_ups_of_one_name_at_one_instant_exactly_one_wins(default_oracle, rt_root):
    o = load_oracle(default_oracle)
    name = "race"
    # a run of this name killed with SIGKILL: its run dir (pid file, state) is stale
    dead = Run(default_oracle, name, rt_root / "runs", rt_root / "cache", log_tag="-dead")
    dead.wait_ready()
    os.killpg(dead.proc.pid, signal.SIGKILL)
    dead.proc.wait(10)
    dead.stop()

    go = rt_root / f"{name}.go"
    go.unlink(missing_ok=True)
    os.mkfifo(go, 0o600)
    runs = [BarrierUp(default_oracle, name, rt_root, i, go) for i in range(3)]
    try:
        deadline = time.monotonic() + 60
        while not all(r.ready.exists() for r in runs):
            assert time.monotonic() < deadline, "the `coli up`s did not reach the barrier"
            time.sleep(0.02)
        w = os.open(go, os.O_WRONLY | os.O_NONBLOCK)
        os.write(w, b"go")
        os.close(w)
        winner, losers = None, []
        for r in runs:
            try:
                r.wait_ready(timeout=150)
                assert winner is None, "two runs of one name came up"
                winner = r
            except RuntimeError:  # exited before becoming ready
                losers.append(r)
        assert winner is not None, "no run came up:\n" + "\n---\n".join(r.output() for r in runs)
        assert len(losers) == 2
        for r in losers:
            assert r.proc.returncode not in (0, None)
            assert f"run {name!r} is already up or starting" in r.output(), r.output()
        # the winner serves exactly what transformers computes
        with Client(name, base=str(winner.run_base)) as c:
            got = c.generate(o["prompt_ids"], 8, greedy=True, ignore_eos=True)
        assert got.tokens == o["greedy_tokens"][:8]
    finally:
        for r in runs:
            r.stop()
    assert_run_gone(winner)
