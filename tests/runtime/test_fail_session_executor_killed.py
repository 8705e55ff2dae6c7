"""kill -9 of the executor after two turns of a session created in that run: the next run resumes the
session with both turns (each turn is saved before its Done), the file is private (0600), and the temp file
a killed save leaves behind is swept when the executor starts."""

import os
import signal
import subprocess
import sys

import pytest

from coli.serve.client import Client
from harness import assert_run_gone
from oracles import load_oracle
from session_files import session_file


@pytest.mark.timeout(300)
def test_a_session_survives_kill_9_of_the_executor_with_all_its_turns(default_oracle, start_run):
    o = load_oracle(default_oracle)
    p1, extra = o["prompt_ids"], o["continuation"]["extra_ids"]
    run = start_run(default_oracle)
    with Client(run.name, base=str(run.run_base)) as c:
        t1 = c.generate(p1, 32, greedy=True, ignore_eos=True, session="killed-a", new_session=True)
        p2 = p1 + t1.tokens + extra
        t2 = c.generate(p2, 16, greedy=True, ignore_eos=True, session="killed-a")
    assert t2.tokens == o["continuation"]["greedy_tokens"][:16]
    os.kill(run.stage_pids["executor"], signal.SIGKILL)
    run.proc.wait(30)
    assert_run_gone(run)
    f = session_file(run, "killed-a")
    assert (f.stat().st_mode & 0o777) == 0o600
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    leftover = f.parent / f".killed-a.session.tmp{gone.pid}"      # what a save killed half-way leaves
    leftover.write_bytes(b"\0" * 4096)

    again = start_run(default_oracle)
    assert not leftover.exists()
    p3 = p2 + t2.tokens + [extra[0]]
    with Client(again.name, base=str(again.run_base)) as c:
        want = c.generate(p3, 16, greedy=True, ignore_eos=True)               # no session: a full prefill
        t3 = c.generate(p3, 16, greedy=True, ignore_eos=True, session="killed-a")
    assert t3.timing["reused_tokens"] == len(p2) + 15            # both turns, up to the last token fed back
    assert t3.tokens == want.tokens
