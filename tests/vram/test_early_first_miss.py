"""VramExperts._stream issues a step's first miss before the FLUSH that launches its VRAM hits (e156d5a), i.e. while
the hits' lookups still pin their slots; before, the hits' pins went back at that FLUSH and then the miss acquired.
Which keys the pool keeps must not depend on that order. It does not while a slot is free (the acquire ranks every
mapped key, pinned or not); with the free list empty only unpinned slots can be reused, so the hits drop out of the
ranking and another key is evicted -- which is why the early miss waits for the FLUSH then (review7). Pure: the real
SlotPool, driven as VramExperts drives it."""

from __future__ import annotations

import numpy as np
import pytest

from coli.gpu.pool import SlotPool


def _use(p: SlotPool, key: int, n: int) -> None:
    for _ in range(n):
        p.begin_step()
        s = p.lookup(key)
        if s is None:
            s = p.acquire(key)
            p.loaded(s)
        p.release(s)


def _step(p: SlotPool, hits: list[int], miss: int, early: bool) -> None:
    """One step: its hits looked up (pinned), then its first miss acquired before (early) or after the FLUSH that
    gives the hits' pins back."""
    p.begin_step()
    held = [p.lookup(k) for k in hits]
    assert all(s is not None for s in held)
    if not early:
        for s in held:
            p.release(s)
    s = p.acquire(miss)
    if early:
        for s2 in held:
            p.release(s2)
    if s is not None:
        p.loaded(s)
        p.release(s)


def _mapped(p: SlotPool, n_keys: int) -> list[int]:
    return [k for k in range(n_keys) if p.slot_of(k) is not None]


def _slack_used_pool(policy: str = "freq") -> SlotPool:
    """4 slots, capacity 3; 1 used 5x, 3 used 3x, 2 once, 9 twice (then dropped); a copy still in flight holds the
    slack slot, so no slot is free."""
    p = SlotPool(4, 1, policy, n_keys=100, staging=1)
    _use(p, 9, 2)
    p.invalidate(p.slot_of(9))
    p.begin_step()
    p.acquire(50)                     # pinned and loading: evicted below, it keeps its slot
    _use(p, 1, 5)
    _use(p, 3, 3)
    _use(p, 2, 1)
    assert p.n_free == 0
    return p


def test_with_no_free_slot_the_early_miss_would_evict_another_key():
    """The sequence behind VramExperts' `pool.n_free > 0` guard on the early first miss."""
    before, early = _slack_used_pool(), _slack_used_pool()
    _step(before, [2], 9, early=False)
    _step(early, [2], 9, early=True)
    assert _mapped(before, 100) == [1, 3, 9]          # after the FLUSH: the hit 2 is the lowest-ranked, it goes
    assert _mapped(early, 100) == [1, 2, 9]           # with 2 still pinned, 3 goes instead


@pytest.mark.parametrize("policy", ["freq", "lru", "lfu", "rdf"])
def test_with_a_free_slot_the_early_miss_keeps_the_same_keys(policy):
    """Random steps (hits then one miss) on two pools in the two orders, each step taken early only while a slot is
    free (the guard): the same keys mapped, the same counters, after every step."""
    rng = np.random.default_rng(7)
    n_keys = 40
    a = SlotPool(12, 1, policy, n_keys=n_keys, staging=3)
    b = SlotPool(12, 1, policy, n_keys=n_keys, staging=3)
    early_steps = 0
    for _ in range(400):
        mapped = _mapped(a, n_keys)
        hits = list(rng.choice(mapped, size=min(len(mapped), int(rng.integers(0, 4))), replace=False)) if mapped else []
        cold = [k for k in range(n_keys) if k not in mapped]
        miss = int(rng.choice(cold))
        guard = a.n_free > 0 and bool(hits)
        early_steps += guard
        _step(a, [int(k) for k in hits], miss, early=False)
        _step(b, [int(k) for k in hits], miss, early=guard)
        assert _mapped(a, n_keys) == _mapped(b, n_keys)
        assert a.stats.as_dict() == b.stats.as_dict()
        b.check()
    assert early_steps > 100
