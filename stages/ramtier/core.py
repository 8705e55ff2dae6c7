"""The RAM tier's pure core: which expert lives in which arena slot, what to evict, what to read.

No sockets, threads or signals: the process wrapper feeds it events (`request`, `read_done`,
`release`) and carries out the actions it returns (answers to the executor, read orders to the
reader). Invariants:

- A slot is FREE, LOADING (a read into it is in flight) or READY (holds a verified record).
- A READY slot with leases (the executor is computing from it) is never recycled.
- Before a slot is reused its generation is bumped and its residency entry cleared, both in the
  shared residency table, so a reader of the table that raced the recycling sees the change.
- Eviction picks the least recently used unleased READY slot, preferring experts outside the
  learned pin set; demand reads are issued before prefetch reads.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Iterable

import numpy as np

FREE, LOADING, READY = 0, 1, 2
NO_SLOT = -1


class ResidencyTable:
    """Shared-memory view of residency, readable by other processes without a message.

    slot_of [n_keys] int64: slot holding key (layer * E + expert) or -1.
    key_of  [n_slots] int64: key held by each slot or -1.
    gen     [n_slots] int64: bumped every time a slot is (re)assigned; a reader that saw (slot, gen)
            before using the slot's bytes and sees the same gen after knows the bytes were that key's.
    """

    def __init__(self, buf, n_keys: int, n_slots: int):
        arr = np.frombuffer(buf, dtype=np.int64, count=n_keys + 2 * n_slots)
        self.slot_of = arr[:n_keys]
        self.key_of = arr[n_keys:n_keys + n_slots]
        self.gen = arr[n_keys + n_slots:]

    @staticmethod
    def nbytes(n_keys: int, n_slots: int) -> int:
        return 8 * (n_keys + 2 * n_slots)

    def reset(self) -> None:
        self.slot_of[:] = NO_SLOT
        self.key_of[:] = NO_SLOT
        self.gen[:] = 0

    def probe(self, key: int) -> tuple[int, int]:
        """(slot, generation) if key is resident, else (-1, 0). Check `still_valid` after use."""
        s = int(self.slot_of[key])
        if s < 0:
            return NO_SLOT, 0
        g = int(self.gen[s])
        if int(self.key_of[s]) != key:
            return NO_SLOT, 0
        return s, g

    def still_valid(self, key: int, slot: int, gen: int) -> bool:
        return int(self.gen[slot]) == gen and int(self.key_of[slot]) == key


@dataclass
class Slot:
    state: int = FREE
    key: int = NO_SLOT
    leases: int = 0


@dataclass(frozen=True)
class Grant:
    """An answer to the executor: `key` is readable in `slot` at generation `gen` (one lease taken)."""

    request_id: int
    key: int
    slot: int
    gen: int


@dataclass(frozen=True)
class Failure:
    request_id: int
    key: int
    reason: str


@dataclass(frozen=True)
class ReadOrder:
    """Read the record of `key` into `slot` (the wrapper looks up file/offset/length/checksum)."""

    key: int
    slot: int
    demand: bool


@dataclass
class Actions:
    grants: list[Grant] = field(default_factory=list)
    failures: list[Failure] = field(default_factory=list)
    reads: list[ReadOrder] = field(default_factory=list)

    def extend(self, other: "Actions") -> None:
        self.grants += other.grants
        self.failures += other.failures
        self.reads += other.reads


@dataclass
class Counters:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    reads_issued: int = 0
    read_failures: int = 0
    prefetch_hits: int = 0
    waits_for_slot: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


class RamTierCore:
    def __init__(self, n_slots: int, n_keys: int, table: ResidencyTable, pinned: Iterable[int] = (),
                 max_inflight_reads: int = 8):
        if n_slots < 1:
            raise ValueError("the RAM tier needs at least one expert slot (raise --ram-gb)")
        self.n_slots = n_slots
        self.n_keys = n_keys
        self.table = table
        self.table.reset()
        self.slots = [Slot() for _ in range(n_slots)]
        self.free = deque(range(n_slots))
        self.lru: OrderedDict[int, None] = OrderedDict()  # READY, unleased slots; oldest first
        self.pinned = set(int(k) for k in pinned)
        self.waiters: dict[int, list[int]] = {}           # key -> request ids waiting for its read
        self.backlog: deque[tuple[int, int, bool]] = deque()  # (request_id, key, demand) waiting for a slot
        self.max_inflight = max(1, max_inflight_reads)
        self.inflight = 0
        self.pending_reads: list[tuple[int, int, ReadOrder]] = []  # heap: (priority, seq, order)
        self._seq = itertools.count()
        self.prefetched: set[int] = set()                  # keys loaded by prefetch, not yet used
        self.usage = np.zeros(n_keys, dtype=np.int64)      # demand uses per key, for the pin set
        self.counters = Counters()

    # ---- events ----------------------------------------------------------------------------------
    def request(self, request_id: int, keys: Iterable[int], demand: bool = True) -> Actions:
        act = Actions()
        for key in keys:
            key = int(key)
            if not 0 <= key < self.n_keys:
                act.failures.append(Failure(request_id, key, f"expert key {key} out of range"))
                continue
            if demand:
                self.usage[key] += 1
            s = self.table.slot_of[key]
            if s >= 0 and self.slots[s].state == READY:
                if demand:
                    self.counters.hits += 1
                    if key in self.prefetched:
                        self.counters.prefetch_hits += 1
                        self.prefetched.discard(key)
                    act.grants.append(self._lease(request_id, key, int(s)))
                elif s in self.lru:
                    self.lru.move_to_end(s)
                continue
            if s >= 0 and self.slots[s].state == LOADING:
                if demand:
                    self.counters.hits += 1  # already on its way (a prefetch): no new read
                    self.waiters.setdefault(key, []).append(request_id)
                    self._promote(key)
                continue
            if demand:
                self.counters.misses += 1
            self._start_load(request_id, key, demand, act)
        self._issue_reads(act)
        return act

    def read_done(self, key: int, slot: int, ok: bool, reason: str = "") -> Actions:
        act = Actions()
        sl = self.slots[slot]
        if sl.state != LOADING or sl.key != key:
            return act  # a stale completion (cannot happen with one reader per slot, but be safe)
        self.inflight -= 1
        waiting = self.waiters.pop(key, [])
        if ok:
            sl.state = READY
            self.table.key_of[slot] = key
            self.table.slot_of[key] = slot
            if waiting:
                for rid in waiting:
                    act.grants.append(self._lease(rid, key, slot))
            else:
                self.prefetched.add(key)
                self.lru[slot] = None
        else:
            self.counters.read_failures += 1
            self._release_slot(slot)
            for rid in waiting:
                act.failures.append(Failure(rid, key, reason or "read failed"))
        self._drain_backlog(act)
        self._issue_reads(act)
        return act

    def release(self, slot: int, gen: int | None = None) -> Actions:
        """The executor finished computing from `slot`."""
        act = Actions()
        sl = self.slots[slot]
        if sl.leases <= 0 or (gen is not None and int(self.table.gen[slot]) != gen):
            return act
        sl.leases -= 1
        if sl.leases == 0 and sl.state == READY:
            self.lru[slot] = None
            self.lru.move_to_end(slot)
        self._drain_backlog(act)
        self._issue_reads(act)
        return act

    # ---- internals -----------------------------------------------------------------------------
    def _lease(self, request_id: int, key: int, slot: int) -> Grant:
        sl = self.slots[slot]
        sl.leases += 1
        self.lru.pop(slot, None)
        return Grant(request_id, key, slot, int(self.table.gen[slot]))

    def _start_load(self, request_id: int, key: int, demand: bool, act: Actions) -> None:
        if key in self.waiters:  # another request already loads it
            if demand:
                self.waiters[key].append(request_id)
            return
        slot = self._take_slot()
        if slot is None:
            if demand:
                self.counters.waits_for_slot += 1
                self.backlog.append((request_id, key, demand))
            return  # a prefetch that finds no slot is dropped
        sl = self.slots[slot]
        sl.state, sl.key, sl.leases = LOADING, key, 0
        self.table.slot_of[key] = slot
        self.waiters[key] = [request_id] if demand else []
        order = ReadOrder(key, slot, demand)
        heapq.heappush(self.pending_reads, (0 if demand else 1, next(self._seq), order))

    def _promote(self, key: int) -> None:
        for i, (prio, seq, order) in enumerate(self.pending_reads):
            if order.key == key and prio > 0:
                self.pending_reads[i] = (0, seq, ReadOrder(order.key, order.slot, True))
                heapq.heapify(self.pending_reads)
                return

    def _take_slot(self) -> int | None:
        if self.free:
            slot = self.free.popleft()
        else:
            slot = self._victim()
            if slot is None:
                return None
            self.counters.evictions += 1
            old = self.slots[slot].key
            self.prefetched.discard(old)
            self.table.slot_of[old] = NO_SLOT
        # Invalidate before the slot's bytes change: a concurrent prober sees a new generation.
        self.table.key_of[slot] = NO_SLOT
        self.table.gen[slot] += 1
        return slot

    def _victim(self) -> int | None:
        fallback = None
        for slot in self.lru:  # oldest first
            if self.slots[slot].key not in self.pinned:
                del self.lru[slot]
                return slot
            if fallback is None:
                fallback = slot
        if fallback is not None:
            del self.lru[fallback]
        return fallback

    def _release_slot(self, slot: int) -> None:
        sl = self.slots[slot]
        if sl.key >= 0 and self.table.slot_of[sl.key] == slot:
            self.table.slot_of[sl.key] = NO_SLOT
        self.table.key_of[slot] = NO_SLOT
        self.table.gen[slot] += 1
        sl.state, sl.key, sl.leases = FREE, NO_SLOT, 0
        self.lru.pop(slot, None)
        self.free.append(slot)

    def _drain_backlog(self, act: Actions) -> None:
        while self.backlog:
            rid, key, demand = self.backlog[0]
            s = self.table.slot_of[key]
            if s >= 0 and self.slots[s].state == READY:
                self.backlog.popleft()
                act.grants.append(self._lease(rid, key, int(s)))
                continue
            if s >= 0 and self.slots[s].state == LOADING:
                self.backlog.popleft()
                self.waiters.setdefault(key, []).append(rid)
                continue
            if not self.free and not self.lru:
                return
            self.backlog.popleft()
            self._start_load(rid, key, demand, act)

    def _issue_reads(self, act: Actions) -> None:
        while self.pending_reads and self.inflight < self.max_inflight:
            _, _, order = heapq.heappop(self.pending_reads)
            self.inflight += 1
            self.counters.reads_issued += 1
            act.reads.append(order)

    # ---- introspection ---------------------------------------------------------------------------
    def resident_count(self) -> int:
        return sum(1 for s in self.slots if s.state == READY)

    def top_used(self, n: int) -> list[int]:
        """The n most used keys (for the persisted pin set)."""
        if n <= 0:
            return []
        order = np.argsort(-self.usage, kind="stable")[:n]
        return [int(k) for k in order if self.usage[k] > 0]
