import numpy as np
import pytest

from stages_helpers import make_core


def test_miss_then_hit_and_generation_protocol():
    core, table = make_core(n_slots=2, n_keys=10)
    act = core.request(1, [3])
    assert not act.grants and [r.key for r in act.reads] == [3]
    slot = act.reads[0].slot
    assert table.probe(3) == (-1, 0)  # not readable while loading
    act = core.read_done(3, slot, True)
    (g,) = act.grants
    assert (g.request_id, g.key, g.slot) == (1, 3, slot)
    assert table.probe(3) == (slot, g.gen)
    core.release(slot, g.gen)
    act = core.request(2, [3])
    assert act.grants[0].slot == slot and not act.reads
    assert core.counters.hits == 1 and core.counters.misses == 1


def test_leased_slots_are_never_recycled_and_backlog_drains():
    core, table = make_core(n_slots=2, n_keys=10)
    a = core.request(1, [0, 1])
    for r in a.reads:
        core.read_done(r.key, r.slot, True)
    # both slots leased: a third key must wait, not evict
    act = core.request(2, [2])
    assert not act.reads and not act.grants and core.counters.waits_for_slot == 1
    s0 = table.probe(0)
    act = core.release(s0[0], s0[1])
    assert [r.key for r in act.reads] == [2] and act.reads[0].slot == s0[0]
    assert table.probe(0) == (-1, 0)
    assert not table.still_valid(0, s0[0], s0[1])  # a prober that raced sees the recycling


def test_lru_order_and_pins():
    core, table = make_core(n_slots=3, n_keys=10, pinned=[0])
    for k in (0, 1, 2):
        for r in core.request(k, [k]).reads:
            g = core.read_done(r.key, r.slot, True).grants[0]
            core.release(g.slot, g.gen)
    g = core.request(9, [1]).grants[0]  # touch 1: LRU order is now 0(pinned), 2, 1
    core.release(g.slot, g.gen)
    act = core.request(10, [5])
    victim_slot = act.reads[0].slot
    assert table.probe(2) == (-1, 0) and table.probe(0)[0] >= 0 and table.probe(1)[0] >= 0
    assert core.counters.evictions == 1 and victim_slot >= 0


def test_failed_read_fails_waiters_and_frees_the_slot():
    core, table = make_core(n_slots=1, n_keys=4)
    r = core.request(1, [2]).reads[0]
    act = core.read_done(2, r.slot, False, "checksum mismatch")
    assert act.failures and act.failures[0].reason == "checksum mismatch"
    assert table.probe(2) == (-1, 0) and core.free


def test_demand_reads_go_before_prefetch():
    core, _ = make_core(n_slots=8, n_keys=20, max_inflight_reads=1)
    first = core.request(1, [5, 6, 7], demand=False).reads
    assert [r.key for r in first] == [5]
    act = core.request(2, [9], demand=True)
    assert not act.reads  # the one in-flight slot is taken by the prefetch of 5
    nxt = core.read_done(5, first[0].slot, True).reads
    assert [r.key for r in nxt] == [9]


def test_prefetched_key_becomes_a_hit():
    core, _ = make_core(n_slots=4, n_keys=10)
    r = core.request(1, [4], demand=False).reads[0]
    core.read_done(4, r.slot, True)
    act = core.request(2, [4])
    assert act.grants and core.counters.prefetch_hits == 1


def test_random_workload_keeps_invariants():
    rng = np.random.default_rng(0)
    core, table = make_core(n_slots=5, n_keys=40)
    inflight = {}
    for step in range(2000):
        keys = rng.choice(40, size=rng.integers(1, 5), replace=False).tolist()
        act = core.request(step, keys)
        for r in act.reads:
            inflight[r.key] = r.slot
        grants = list(act.grants)
        while inflight:
            k, s = inflight.popitem()
            more = core.read_done(k, s, True)
            grants += more.grants
            for r in more.reads:
                inflight[r.key] = r.slot
        for g in grants:
            assert table.still_valid(g.key, g.slot, g.gen)
        for g in grants:
            more = core.release(g.slot, g.gen)
            for r in more.reads:
                inflight[r.key] = r.slot
        assert sorted(s for s in table.slot_of if s >= 0) == sorted(set(s for s in table.slot_of if s >= 0))


def test_zero_slots_is_a_clear_error():
    with pytest.raises(ValueError, match="--ram-gb"):
        make_core(n_slots=0, n_keys=3)
