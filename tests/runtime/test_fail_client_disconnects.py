"""A client that disconnects mid-stream: its request is cancelled and the run keeps serving others."""

import json

import pytest

from failures import long_stream
from oracles import load_oracle


@pytest.mark.timeout(180)
def test_client_disconnect_cancels_and_run_keeps_serving(default_oracle, start_run):
    o = load_oracle(default_oracle)
    run = start_run(default_oracle)
    c, it = long_stream(run, o, max_tokens=3000)
    next(it)
    it.close()  # the client walks away mid-stream (closing the stream sends Cancel) ...
    c.close()   # ... and its socket goes away
    ids = ",".join(map(str, o["prompt_ids"]))
    r = run.coli("chat", "--name", run.name, "--prompt-ids", ids, "--max-tokens", "32", "--greedy", "--ignore-eos",
                 "--json", timeout=60)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["tokens"] == o["greedy_tokens"]
    st = json.loads(run.coli("status", "--name", run.name, "--json").stdout)
    assert all(s["state"] == "ready" for s in st["stages"].values())


@pytest.mark.timeout(180)
def test_client_killed_without_cancel(default_oracle, start_run):
    """A client process killed outright: the supervisor notices the dead peer on its next send."""
    import signal
    import subprocess
    import sys
    import time

    o = load_oracle(default_oracle)
    run = start_run(default_oracle)
    ids = ",".join(map(str, o["prompt_ids"]))
    p = subprocess.Popen([sys.executable, "-m", "coli.cli.main", "chat", "--name", run.name, "--prompt-ids", ids,
                          "--max-tokens", "3000", "--greedy", "--ignore-eos"], env=run.env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    p.stdout.read(8)  # it is streaming
    p.send_signal(signal.SIGKILL)
    p.wait(10)
    t0 = time.monotonic()
    r = run.coli("chat", "--name", run.name, "--prompt-ids", ids, "--max-tokens", "8", "--greedy", "--ignore-eos",
                 "--json", timeout=60)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["tokens"] == o["greedy_tokens"][:8]
    assert time.monotonic() - t0 < 30  # it did not wait for the dead client's 3000 tokens
