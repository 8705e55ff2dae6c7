"""Through the running stages (separate processes, ZeroMQ, shared memory) the tokens are exactly those
of `coli run` and transformers — also with a RAM tier too small for one layer's experts."""

import json
import time

import pytest

from harness import assert_run_gone
from oracles import load_oracle, oracle_dir


def chat_json(run, o, n=32):
    ids = ",".join(map(str, o["prompt_ids"]))
    r = run.coli("chat", "--name", run.name, "--prompt-ids", ids, "--max-tokens", str(n), "--greedy",
                 "--ignore-eos", "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name,ram_gb", [("default", 1.0), ("groups", 0.0004)])
def test_tokens_match_transformers_and_coli_run(oracle_root, start_run, name, ram_gb):
    d = oracle_dir(oracle_root, name)
    o = load_oracle(d)
    run = start_run(d, ram_gb=ram_gb)
    out = chat_json(run, o)
    assert out["tokens"] == o["greedy_tokens"]
    local = run.coli("run", "--model", str(d), "--prompt-ids", ",".join(map(str, o["prompt_ids"])), "--max-tokens",
                     "32", "--greedy", "--ignore-eos", "--json")
    assert json.loads(local.stdout)["tokens"] == out["tokens"]
    st = json.loads(run.coli("status", "--name", run.name, "--json").stdout)
    if ram_gb < 0.001:
        # fewer RAM slots than one layer's 16 experts: constant eviction
        assert st["ram_slots"] < 16
        deadline = time.monotonic() + 5
        while True:  # stats are republished every 0.5 s
            stats = json.loads(run.coli("stats", "--name", run.name, "--once", "--json").stdout)
            if stats.get("ramtier", {}).get("evictions", 0) > 0 or time.monotonic() > deadline:
                break
            time.sleep(0.3)
        assert stats["ramtier"]["evictions"] > 0 and stats["ramtier"]["hit_rate"] < 1.0
    r = run.coli("down", "--name", run.name)
    assert r.returncode == 0, r.stderr
    run.proc.wait(30)
    assert_run_gone(run)


@pytest.mark.timeout(300)
def test_several_clients_at_once_all_complete(default_oracle, start_run):
    import subprocess
    import sys

    o = load_oracle(default_oracle)
    run = start_run(default_oracle)
    ids = ",".join(map(str, o["prompt_ids"]))
    procs = [subprocess.Popen([sys.executable, "-m", "coli.cli.main", "chat", "--name", run.name, "--prompt-ids", ids,
                               "--max-tokens", "32", "--greedy", "--ignore-eos", "--json"], env=run.env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(4)]
    for p in procs:
        out, err = p.communicate(timeout=200)
        assert p.returncode == 0, err
        assert json.loads(out)["tokens"] == o["greedy_tokens"]


@pytest.mark.timeout(180)
def test_coli_up_records_routing(default_oracle, start_run, tmp_path):
    from coli.trace import read_trace

    o = load_oracle(default_oracle)
    trace = tmp_path / "routing.trace"
    run = start_run(default_oracle, args=("--record-routing", str(trace)))
    chat_json(run, o, n=8)
    assert run.coli("down", "--name", run.name).returncode == 0
    run.proc.wait(30)
    t = read_trace(trace)
    # prompt (20 positions) + 7 fed-back tokens, each with every MoE layer's top-4
    assert t.idx.shape == (27, 3, 4)
    assert (t.idx >= 0).all() and (t.idx < 16).all()
