"""The logs of a name across runs: each run starts with a dated `run_started` record (`coli logs` draws it
as a separator), `--tail N` shows the last N records, a mistyped `--stage` names the valid ones, and a
clean stop logs no `arena_close` warning (every view over the arenas is gone before they unmap)."""

import json

import pytest

from harness import Run, assert_run_gone
from oracles import load_oracle


@pytest.mark.timeout(240)
def test_two_runs_of_a_name_in_its_logs(default_oracle, start_run):
    o = load_oracle(default_oracle)
    first = start_run(default_oracle, ram_gb=0.0004)
    ids = ",".join(map(str, o["prompt_ids"]))
    for run in (first, None):
        if run is None:  # the second run of the same name
            run = Run(default_oracle, first.name, first.run_base, first.run_base.parent / "cache", 0.0004,
                      log_tag="-2")
            run.wait_ready()
        chat = run.coli("chat", "--name", run.name, "--prompt-ids", ids, "--max-tokens", "8", "--json")
        assert chat.returncode == 0, chat.stderr
        down = run.coli("down", "--name", run.name)
        assert down.returncode == 0, down.stderr
        assert run.proc.wait(30) == 0
        assert_run_gone(run)

    recs = [json.loads(line) for line in first.coli("logs", "--name", first.name, "--json").stdout.splitlines()]
    starts = [r for r in recs if r.get("event") == "run_started"]
    assert len(starts) == 2 and all(r["date"].endswith("UTC") and r["run"] == first.name for r in starts)
    assert not [r for r in recs if r.get("event") == "arena_close"], "a clean stop could not unmap an arena"

    pretty = first.coli("logs", "--name", first.name).stdout
    assert pretty.count(f"──── run {first.name} started ") == 2

    tail = first.coli("logs", "--name", first.name, "--json", "--tail", "3").stdout.splitlines()
    assert [json.loads(line) for line in tail] == recs[-3:]
    ex = first.coli("logs", "--name", first.name, "--stage", "executor", "--json", "--tail", "2").stdout.splitlines()
    assert len(ex) == 2 and all(json.loads(line)["stage"] == "executor" for line in ex)

    bad = first.coli("logs", "--name", first.name, "--stage", "exector")
    assert bad.returncode == 2
    assert "--stage 'exector'" in bad.stderr and "executor, gateway, ramtier, reader, supervisor" in bad.stderr
