"""After a clean `coli down` the run is plainly stopped (status and later downs say so, nothing calls it
stale), and `coli ps` lists every run: name, state, pid, model, uptime, http."""

import json
import os
import signal

import pytest

from harness import assert_run_gone


def ps(run):
    r = run.coli("ps", "--json")
    assert r.returncode == 0, r.stderr
    return {row["name"]: row for row in json.loads(r.stdout)}


@pytest.mark.timeout(180)
def test_clean_down_leaves_a_stopped_run_and_ps_lists_every_run(default_oracle, start_run):
    a = start_run(default_oracle)
    b = start_run(default_oracle)
    rows = ps(a)
    assert rows[a.name]["state"] == "ready" and rows[a.name]["pid"] == a.proc.pid
    assert rows[a.name]["model"] == a.state["model"] and rows[a.name]["uptime_s"] >= 0  # what the run serves
    assert rows[b.name]["state"] == "ready" and rows[b.name]["pid"] == b.proc.pid
    table = a.coli("ps")
    assert a.name in table.stdout and "ready" in table.stdout and str(a.proc.pid) in table.stdout

    r = a.coli("down", "--name", a.name)
    assert r.returncode == 0 and f"run {a.name!r} stopped" in r.stdout, r.stdout + r.stderr
    a.proc.wait(30)
    st = a.coli("status", "--name", a.name)
    assert st.returncode != 0
    assert "stopped" in st.stderr and "coli down" in st.stderr and "supervisor" not in st.stderr, st.stderr
    again = a.coli("down", "--name", a.name)
    assert again.returncode == 0, again.stderr
    assert "nothing to stop" in again.stdout and "stale" not in again.stdout, again.stdout
    assert ps(a)[a.name]["state"] == "stopped"

    os.kill(b.proc.pid, signal.SIGKILL)  # a dead run is listed as dead until `coli down` cleans it
    b.proc.wait(10)
    assert ps(b)[b.name]["state"] == "dead"
    assert "cleaned up stale run" in b.coli("down", "--name", b.name).stdout
    row = ps(b)[b.name]
    assert row["state"] == "stopped" and row["failed"] and "died" in row["reason"]
    assert_run_gone(a)
    assert_run_gone(b)
