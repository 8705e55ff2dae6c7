"""`coli up --pilot`: the router-lookahead prefetches never change output tokens (also with a RAM tier
smaller than one layer, where prefetches evict), the RAM tier answers nothing to a prefetch, the executor
sends a layer's demand request before the pilot's prefetch, and on the trained demo model prefetches
are used (the RAM tier's prefetch_hits moves)."""

import json
import time
from pathlib import Path

import numpy as np
import pytest

from harness import assert_run_gone
from oracles import load_oracle, oracle_dir

DEMO = Path(__file__).resolve().parents[2] / "coli" / "demo" / "model"


def chat(run, ids, n=32):
    r = run.coli("chat", "--name", run.name, "--prompt-ids", ",".join(map(str, ids)), "--max-tokens", str(n),
                 "--greedy", "--ignore-eos", "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def stats_when(run, ok, timeout=5.0):
    deadline = time.monotonic() + timeout
    while True:  # stats are republished every 0.5 s
        st = json.loads(run.coli("stats", "--name", run.name, "--once", "--json").stdout)
        if ok(st) or time.monotonic() > deadline:
            return st
        time.sleep(0.3)


# ---- the RAM tier core: a prefetch is never answered -----------------------------------------------------------
def test_ramtier_core_never_answers_a_prefetch():
    from coli.stages.ramtier.core import RamTierCore, ResidencyTable

    n_keys, n_slots = 32, 4
    table = ResidencyTable(bytearray(ResidencyTable.nbytes(n_keys, n_slots)), n_keys, n_slots)
    core = RamTierCore(n_slots, n_keys, table)
    act = core.request(1, [3, 5], demand=False)
    assert not act.grants and not act.failures and {r.key for r in act.reads} == {3, 5}
    assert all(not r.demand for r in act.reads)
    for r in act.reads:
        done = core.read_done(r.key, r.slot, True)
        assert not done.grants and not done.failures
    assert not core.read_done(99, 0, False).failures  # a stale completion: nothing either
    # a failed prefetch read answers nobody
    act = core.request(2, [7], demand=False)
    assert not core.read_done(7, act.reads[0].slot, False, "boom").failures
    # the demand that uses a prefetched expert is a hit and counts as a prefetch hit
    act = core.request(3, [3, 9], demand=True)
    assert [g.key for g in act.grants] == [3] and core.counters.prefetch_hits == 1
    # with every slot leased, a prefetch is dropped: no read, no answer, no backlog
    core.request(4, [10], demand=True)
    busy = core.request(5, [11, 12, 13, 14, 15], demand=True)
    assert busy.grants == [] and core.backlog
    n_backlog = len(core.backlog)
    act = core.request(6, [20, 21], demand=False)
    assert not act.grants and not act.failures and not act.reads and len(core.backlog) == n_backlog


# ---- the executor's expert source: demand first, then the prefetch, and no wait on it --------------------------
def test_executor_sends_demand_before_the_prefetch(monkeypatch):
    from coli.stages.executor import experts as ex

    sent = []
    monkeypatch.setattr(ex, "send", lambda sock, msg, **kw: sent.append(msg))

    class Stop(Exception):
        pass

    class Sock:
        def poll(self, ms):
            return False

    def idle():
        raise Stop()

    src = ex.RamTierExperts(Sock(), None, None, None, 16, 8, idle=idle)
    src.prefetch(2, [1, 4, 7])
    assert sent == []  # queued until a demand request goes out
    with pytest.raises(Stop):
        next(src.stream(1, [0, 3]))
    assert [(m.layer, m.demand) for m in sent] == [(1, True), (2, False)]
    assert sent[1].experts == [1, 4, 7] and sent[0].request_id != sent[1].request_id
    assert src.stats["pilot_predicted"] == 3 and src.stats["prefetch_requests"] == 1
    with pytest.raises(Stop):
        next(src.stream(2, [4, 7, 9]))
    assert src.stats["pilot_hits"] == 2


# ---- through the stages --------------------------------------------------------------------------------------
@pytest.mark.timeout(300)
@pytest.mark.parametrize("pilot,ram_gb", [("1", 0.0004), ("2", 0.0004), ("on", 1.0)])
def test_pilot_never_changes_tokens(oracle_root, start_run, pilot, ram_gb):
    d = oracle_dir(oracle_root, "default")
    o = load_oracle(d)
    run = start_run(d, ram_gb=ram_gb, args=("--pilot", pilot))
    assert chat(run, o["prompt_ids"])["tokens"] == o["greedy_tokens"]
    st = json.loads(run.coli("status", "--name", run.name, "--json").stdout)
    if ram_gb < 0.001:
        assert st["ram_slots"] < 16  # fewer slots than one layer's experts: prefetches evict
    stats = stats_when(run, lambda s: s.get("executor", {}).get("pilot_predicted", 0) > 0)
    assert stats["executor"]["pilot_predicted"] > 0
    assert run.coli("down", "--name", run.name).returncode == 0
    run.proc.wait(30)
    assert_run_gone(run)


@pytest.mark.timeout(300)
def test_pilot_prefetches_are_used_on_the_demo_model(start_run):
    from coli.generate import Generation
    from coli.loader import load_model
    from coli.model.sampling import SamplingParams

    ids = [4089, 17, 250, 933, 12, 77, 1024, 5, 300, 41]
    model, _ = load_model(DEMO)
    want = list(Generation(model, ids, 32, SamplingParams(greedy=True), ignore_eos=True))
    run = start_run(DEMO, ram_gb=0.0012, args=("--pilot", "1"))  # ~8 slots: half a layer
    assert chat(run, ids)["tokens"] == want
    st = stats_when(run, lambda s: s.get("ramtier", {}).get("prefetch_hits", 0) > 0
                    and s.get("executor", {}).get("pilot_hits", 0) > 0)
    assert st["ramtier"]["slots"] < 16
    assert st["ramtier"]["prefetch_hits"] > 0
    ex = st["executor"]
    assert 0 < ex["pilot_hits"] <= ex["pilot_predicted"]
    assert ex["pilot_hits"] / ex["pilot_predicted"] > 0.5  # the trained router is predictable (docs/pilot.md)
