"""A disk read error while loading an expert: the request fails with a clear error naming the record,
the failure is logged by the reader, and the run keeps serving."""

import json

import pytest

from oracles import load_oracle


@pytest.mark.timeout(180)
def test_read_errors_fail_the_request_not_the_run(default_oracle, start_run):
    o = load_oracle(default_oracle)
    run = start_run(default_oracle, ram_gb=0.0004, extra_env={"COLI_INJECT": "read_error:1"})
    ids = ",".join(map(str, o["prompt_ids"]))
    r = run.coli("chat", "--name", run.name, "--prompt-ids", ids, "--max-tokens", "4", "--greedy", "--json")
    assert r.returncode != 0
    assert "expert unavailable" in r.stderr and "injected read error" in r.stderr and ".coli @ " in r.stderr, r.stderr
    st = json.loads(run.coli("status", "--name", run.name, "--json").stdout)
    assert all(s["state"] == "ready" for s in st["stages"].values())
    logs = run.coli("logs", "--name", run.name, "--stage", "reader", "--json").stdout
    assert "read_failed" in logs
