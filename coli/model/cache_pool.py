"""Idle KV cache buffers kept for the next sequence of the same capacity, so that it gets the same addresses.

A replayed decode step bakes its cache's buffer addresses (coli/gpu/graphs.py `step_key`): a request on a cache of
new buffers runs its first decode step eagerly, captures a graph on its second and replays only from its third,
and the MTP round graphs pay the same. Agent harnesses send many short requests, so that capture would be paid by
every one of them. A cache that ends (`KVCache.release`, by whoever owns its lifetime: coli/generate.py, the
executor's sequences, the MTP decoder) gives its buffers here; the next `KVCache.empty` of the same capacity takes
them back, the most recently released first (the one whose graphs are newest), and replays from its first step.

Rules (tests/model/test_cache_pool.py):
- a set of buffers is in at most one place: a live cache or this pool (taking removes it; a released cache forgets
  its buffers, so it cannot write into them once another sequence has them);
- a cache that grows gives its old, smaller buffers back;
- bounded: at most PER_CAPACITY idle sets of one capacity and MAX_IDLE in all (a GLM-5 cache is ~220 KB a
  position); past that the least recently released set is freed (dropped to the backend's allocator);
- backend-independent: it holds whatever `backend.empty` made (numpy arrays, DeviceArrays).

Contents: a set comes back with the rows of the sequence that used it. Nothing reads a cache past its `length`
(`view` cuts at T; every attention and indexer kernel, the graph ones included, bounds its keys by T or by the
indexer's selection, and the captured indexer's grid over the capacity returns at once past T), which is already
what a fresh `backend.empty` (undefined contents) and a `truncate`d session cache rely on -- so a set is not zeroed
on reuse. tests/model/test_cache_pool.py poisons a released set with NaN and checks the next sequence's tokens.

Capacities are rounded up to `bucket` (four steps an octave: at most 25 % more rows) so that requests whose prompt
plus max_tokens differ a little share a capacity, and doubling (KVCache.reserve) stays on the steps.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

PER_CAPACITY = 2     # idle sets kept of one capacity (a batch's sequences end at different times)
MAX_IDLE = 4         # idle sets kept in all, per pool (one pool per model, one per MTP head)


def bucket(capacity: int, limit: int = 0) -> int:
    """The capacity a cache of at least `capacity` rows gets: 1..8 as asked, then the next of 4, 5, 6, 7 x 2^k
    (10, 12, 14, 16, 20, 24, ...). Doubling a bucket gives a bucket. `limit` (> 0: the model's context) caps the
    rounding: no cache gets rows past the context for it (a GLM-5 cache at its full context would be 13 % over)."""
    n = max(1, int(capacity))
    if n <= 8:
        return n
    step = 1 << (n.bit_length() - 3)
    b = -(-n // step) * step
    return max(n, int(limit)) if 0 < limit < b else b


class CachePool:
    """Idle buffer sets of one cache layout (one model's config on one backend), by capacity."""

    def __init__(self, per_capacity: int = PER_CAPACITY, max_idle: int = MAX_IDLE):
        self.per_capacity, self.max_idle = int(per_capacity), int(max_idle)
        self._idle: OrderedDict[int, list[tuple[int, list]]] = OrderedDict()   # capacity -> [(ticket, layers)]
        self._lock = threading.Lock()       # the executor's loop is one thread, but nothing here needs it to be
        self._ticket = 0
        self.hits = self.misses = self.returned = self.freed = 0

    def take(self, capacity: int) -> list | None:
        """An idle set of exactly `capacity` rows (the most recently given), removed from the pool; None: none."""
        with self._lock:
            sets = self._idle.get(capacity)
            if not sets:
                self.misses += 1
                return None
            _, layers = sets.pop()
            if not sets:
                del self._idle[capacity]
            self.hits += 1
            return layers

    def give(self, capacity: int, layers: list) -> None:
        """Keep `layers` (a cache's LayerCache list of `capacity` rows, no longer used by it) for a next cache."""
        if not layers:
            return
        with self._lock:
            self._ticket += 1
            self._idle.setdefault(capacity, []).append((self._ticket, layers))
            self._idle.move_to_end(capacity)
            self.returned += 1
            sets = self._idle[capacity]
            while len(sets) > self.per_capacity:
                sets.pop(0)                         # the oldest of this capacity
                self.freed += 1
            while self.idle_sets > self.max_idle:
                oldest = min(self._idle, key=lambda c: self._idle[c][0][0])
                self._idle[oldest].pop(0)
                if not self._idle[oldest]:
                    del self._idle[oldest]
                self.freed += 1

    @property
    def idle_sets(self) -> int:
        return sum(len(s) for s in self._idle.values())

    def idle(self) -> dict[int, int]:
        """capacity -> idle sets kept."""
        with self._lock:
            return {c: len(s) for c, s in self._idle.items()}

    def clear(self) -> None:
        """Free every idle set (a model being dropped)."""
        with self._lock:
            self.freed += self.idle_sets
            self._idle.clear()

    def snapshot(self) -> dict[str, Any]:
        return {"hits": self.hits, "misses": self.misses, "returned": self.returned, "freed": self.freed,
                "idle": self.idle()}
