"""The VRAM execution cache's bookkeeping: which device slot holds which expert, who is using it, and which
expert leaves when a new one comes in. Pure (no CUDA, no threads): the GPU stage owns the device memory and
the copies and calls this from its one control thread.

Legend

    L, E      MoE layers, routed experts per layer (GLM-5: 75 x 256)
    key       one expert of one layer: layer * E + expert, 0 <= key < n_keys = L * E
    slot      one record-sized piece of the device pool, 0 <= slot < n_slots (at most a few thousand)
    step      one (token, MoE layer) request: `begin_step` advances the clock once before its lookups
    K         experts a step requests (top-k, GLM-5: 8); `rank` is an expert's position in the router's
              top-k, 0 = heaviest (the within-step tie-break of recency, as the simulator's routing weights)

Slot states

    free      holds nothing; the only state a slot is handed out from
    loading   its copy is in flight (`acquire` -> `loaded`)
    ready     its copy is complete
    stale     invalidated (the copy failed, or its source was recycled): contents unusable, waiting for its
              pins to drop

A slot is **mapped** when its key can be found by `lookup`. A loading/ready slot that is not mapped is
*transient*: a demand load that was not admitted, or a slot whose key was evicted while someone still
used it. An unmapped slot becomes free once it is unpinned and its copy is not in flight.

Pins are counts: a demand lookup/acquire pins the slot it returns, a speculative acquire pins it for its copy,
and each user calls `release` when it is done (after the kernels that read it are queued: the stream keeps
the order). A pinned or loading slot is never handed out, so no copy overwrites a slot a kernel still reads.
Pins protect a slot's contents, not its key's place in the cache: a pinned key may be evicted (unmapped)
when the ranking says so, and its slot is reused only after its last release (see below).

Capacity, staging and admission (the simulator's model, `coli/sim.py`)

At most `capacity = n_slots - staging` keys are mapped; the other `staging` slots are slack. The simulator's
misses go to a staging buffer outside the cache and after each step the cache keeps the best `capacity` of
(what it held) U (what the step requested). The pool does the same thing one miss at a time: a demand miss
is copied into a free slot; if the cache is full, the lowest-ranked mapped key -- in use or not, this step's
own keys included -- is evicted when the newcomer outranks it and the newcomer is mapped in its place;
otherwise the newcomer stays transient and its slot is freed on release. Inserting a step's misses one by
one into a bounded set that always drops its minimum leaves the top `capacity` of the union, i.e. exactly
the simulator's cache, provided a step's hits are looked up before its misses are acquired (the runtime
reads the whole top-k first). Evicting a pinned key only unmaps it: its slot stays with its users and
returns to the free list when they release it, which is what the slack is for. While at most `staging`
transient or evicted-but-pinned slots are in use, a demand miss always finds a free slot; when the slack is
exhausted the pool falls back to reusing the lowest-ranked unpinned ready slot (if the newcomer outranks
it) and otherwise returns None: the caller computes that expert on the CPU (`rejected_no_slot`). So size
`staging` to the demand requests in flight at once: K for one step, more when steps overlap.

Speculative loads (the pilot's prefetch) take room, never force it: they use a free slot only while the
cache is below capacity, else replace the lowest-ranked unpinned *ready* mapped key if the newcomer
outranks it; they never evict a pinned or loading slot and never go transient. A speculative load marks
recency (so it is not evicted before its use) but not frequency (it is not a use).

`spec_displaces=True` (what the GPU executor uses) lets a speculative load replace the lowest-ranked unpinned
ready key that was not used in the current step and is not itself an unused speculative load, whatever
the ranks: the pilot predicts a use within the next layer step, and keeping a key whose next use is further
away is what a clairvoyant policy would not do. Without it, under `freq` a predicted key (no count yet)
never outranks a resident one and speculation never gets a slot once the cache is full (measured on the
H200 bench: 0 speculative loads in 8 tokens; docs/performance.md).

Policies (higher is kept; every tuple ends in the recency code, so with distinct ranks in a step the order
is total)

    lru    (last use)                                                     admits every miss
    rdf    (step of last use, decayed frequency f <- f * decay**dt + 1, last use)   admits every miss
    lfu    (used this step, count, last use)                              admits every miss
    freq   (count, last use): a miss enters only if it out-counts (then out-recents) the lowest resident;
           counts are kept for all n_keys, resident or not (the history admission needs)

"Admits every miss" is what the ranking implies: a key used this step outranks every key that was not, so
it is refused only when the cache is smaller than one step's requests. Recency is the step of last use,
ties inside a step by `rank` (heavier = more recent). Counts and rdf frequencies decay per *step*
(`count_decay`, `decay`); in one pool shared by all layers a key is requested at most once per token, so a
per-token decay d is d ** (1 / L) per step.

Differences to the simulator. (1) By design: `simulate(idx [T, L, K], shared=True)` treats a whole
token (all L layers) as one step, so its evictions already know the token's later layers -- an expert that
layer 40 will request is never evicted by a miss of layer 3 of the same token. A runtime learns layer l+1's
routing only after computing layer l, so the pool decides per (token, layer) step; it equals the simulator
run on the same trace flattened to one layer per step (`[T * L, 1, K]`, keys layer * E + expert). With all
of a token's lookups made before its misses (and one begin_step per token) it equals the per-token
simulator as well; tests/vram/test_pool.py checks both. (2) Scores: the simulator ranks lfu/freq with
count_decay < 1 by count * (T + 2) + last use, T the trace's length, so there recency outweighs count
differences below (age gap) / (T + 2), and its rdf adds 1e-3 x the in-token order to a scaled decayed
frequency, which outweighs frequency differences below ~1e-3 x (1 / (1 - decay) + 1) / 8. A server has no
T, so the pool ranks by the lexicographic order the simulator documents; with count_decay = 1 and the
default decay the two agree exactly on the tested traces, otherwise hits differ by a few in a thousand
(the tests patch the simulator's blend into the pool and get equality back).

Cost: one miss ranks the candidate slots with a few numpy operations, O(n_slots): ~20-40 us per miss at
1800 slots (lookups and hits are O(1)).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from coli.errors import ColiError

POOL_POLICIES = ("lru", "rdf", "freq", "lfu")

FREE, LOADING, READY, STALE = 0, 1, 2, 3
STATE_NAMES = ("free", "loading", "ready", "stale")

# Recency code of a use: step * RANK_SPAN + (RANK_SPAN - 1 - rank), one int64 that orders by step and,
# inside a step, puts the heavier expert (lower rank) later, as the simulator's in-token order does.
RANK_SPAN = 1 << 20
_I64_MAX = np.iinfo(np.int64).max


@dataclass
class PoolStats:
    hits: int = 0               # demand lookups that found the key mapped (ready or loading)
    misses: int = 0             # demand acquires
    evictions: int = 0          # keys unmapped to make room (the slot is reused once unpinned)
    spec_loads: int = 0         # speculative acquires that got a slot
    spec_used: int = 0          # speculative loads a demand lookup hit (counted once per load)
    spec_wasted: int = 0        # speculative loads evicted or invalidated before any demand use
    rejected_no_slot: int = 0   # demand misses that got no slot at all (the caller computes on the CPU)
    transient_loads: int = 0    # demand misses loaded into a slot that is not mapped (not admitted)
    spec_declined: int = 0      # speculative acquires that got no slot (nothing worth replacing)
    invalidations: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


class SlotPool:
    """n_slots device slots of slot_bytes each; keys are ints (layer * E + expert). See the module docstring."""

    def __init__(self, n_slots: int, slot_bytes: int, policy: str = "freq", *, n_keys: int,
                 staging: int = 8, decay: float = 0.9, count_decay: float = 1.0, spec_displaces: bool = False):
        _check_args(n_slots, slot_bytes, policy, n_keys, staging, decay, count_decay)
        self.spec_displaces = bool(spec_displaces)
        self.n_slots, self.slot_bytes, self.policy = int(n_slots), int(slot_bytes), policy
        self.n_keys, self.staging = int(n_keys), int(staging)
        self.decay, self.count_decay = float(decay), float(count_decay)
        self.stats = PoolStats()
        # per key (all n_keys: freq's admission needs the history of keys that are not resident)
        self._slot_of = np.full(n_keys, -1, np.int64)
        self._rec = np.full(n_keys, -1, np.int64)      # recency code of the last use or speculative load
        self._used = np.full(n_keys, -1, np.int64)     # step of the last use (decays count from it)
        self._cnt = np.zeros(n_keys)                   # use count as of _used (lfu, freq)
        self._fdec = np.zeros(n_keys)                  # rdf decayed frequency as of _used
        # per slot
        self._state = np.zeros(n_slots, np.int8)
        self._key = np.full(n_slots, -1, np.int64)
        self._pins = np.zeros(n_slots, np.int32)
        self._mapped = np.zeros(n_slots, bool)
        self._spec = np.zeros(n_slots, bool)           # speculatively loaded, no demand use yet
        self._spec_hit = np.zeros(n_slots, bool)       # the last demand lookup of the slot used a speculative load
        self._revoked: set[int] = set()                # keys of this step's revoked hits (see revoke_hit)
        self._free = list(range(n_slots - 1, -1, -1))  # a stack: slot 0 is handed out first
        self._n_mapped = 0
        self._now = 0
        self._nth = 0                                  # touches so far this step (the default rank)

    # ---- introspection -------------------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        """Keys the pool maps at most (n_slots - staging)."""
        return self.n_slots - self.staging

    @property
    def resident(self) -> int:
        """Keys mapped now (ready or loading): what a lookup can hit."""
        return self._n_mapped

    @property
    def n_free(self) -> int:
        return len(self._free)

    @property
    def step(self) -> int:
        return self._now

    def fits(self, nbytes: int) -> bool:
        """Whether a record of nbytes fits one slot (a larger one is computed on the CPU)."""
        return 0 <= nbytes <= self.slot_bytes

    def state(self, slot: int) -> str:
        return STATE_NAMES[self._state[self._slot(slot)]]

    def key_of(self, slot: int) -> int | None:
        """The key a slot holds (mapped or transient), None when free."""
        k = int(self._key[self._slot(slot)])
        return None if k < 0 else k

    def slot_of(self, key: int) -> int | None:
        """The slot a key is mapped to, None when a lookup would miss."""
        s = int(self._slot_of[self._keyed(key)])
        return None if s < 0 else s

    def is_mapped(self, slot: int) -> bool:
        return bool(self._mapped[self._slot(slot)])

    def pins(self, slot: int) -> int:
        return int(self._pins[self._slot(slot)])

    # ---- the runtime's calls -------------------------------------------------------------------------

    def begin_step(self) -> None:
        """Advance the clock: once per (token, MoE layer) request, before its lookups."""
        self._now += 1
        self._nth = 0
        self._revoked.clear()         # a revoked hit's "miss and use counted" holds for its own step only

    def lookup(self, key: int, *, rank: int | None = None) -> int | None:
        """Demand: the slot holding key (ready or loading), pinned, counted as a hit; None (nothing counted)
        when the key is not mapped."""
        s = int(self._slot_of[self._keyed(key)])
        _check_rank(rank)
        if s < 0:
            return None
        self.stats.hits += 1
        self._use(key, rank)
        self._pins[s] += 1
        self._spec_hit[s] = bool(self._spec[s])    # remembered for revoke_hit
        if self._spec[s]:
            self.stats.spec_used += 1
            self._spec[s] = False
        return s

    def revoke_hit(self, slot: int) -> None:
        """The last demand lookup of `slot` found it not holding the key's bytes after all (a speculative copy
        cut short by the demand, or its source recycled; call it after `invalidate(slot)`, before dropping the
        lookup's pin): that hit becomes a miss. The caller then asks for the key with `acquire` in the same
        step, which counts neither the miss nor the use again (the lookup recorded the use). A speculative
        load counts as wasted, not used."""
        s = self._slot(slot)
        if self._pins[s] <= 0 or self._key[s] < 0:
            raise ValueError(f"slot {s} is not held by a lookup: nothing to revoke")
        self.stats.hits -= 1
        self.stats.misses += 1
        self._revoked.add(int(self._key[s]))
        if self._spec_hit[s]:
            self._spec_hit[s] = False
            self.stats.spec_used -= 1
            self.stats.spec_wasted += 1

    def acquire(self, key: int, *, speculative: bool = False, rank: int | None = None,
                retry: bool = False) -> int | None:
        """A slot to copy key into, pinned and loading, or None. Call `lookup` (demand) or `slot_of`
        (speculative) first: acquiring a mapped key is an error. `retry=True`: the same demand miss asked again
        after a None (once the caller released pins): the miss and its use are not counted twice, and a slot
        found now takes back the rejection counted the first time."""
        key = self._keyed(key)
        _check_rank(rank)
        if self._slot_of[key] >= 0:
            raise ValueError(f"key {key} is already mapped to slot {int(self._slot_of[key])}: look it up instead")
        if speculative:
            return self._acquire_speculative(key, rank)
        if retry:
            self.stats.rejected_no_slot -= 1
            s = self._place_demand(key)
            return s
        return self._acquire_demand(key, rank)

    def loaded(self, slot: int) -> None:
        """Its copy is complete: loading -> ready (a slot invalidated meanwhile stays stale)."""
        s = self._slot(slot)
        st = self._state[s]
        if st == LOADING:
            self._state[s] = READY
        elif st != STALE:
            raise ValueError(f"slot {s} is {STATE_NAMES[st]}, not loading")
        self._maybe_free(s)

    def release(self, slot: int) -> None:
        """Drop one pin (after the kernels that read the slot are queued)."""
        s = self._slot(slot)
        if self._pins[s] <= 0:
            raise ValueError(f"slot {s} is not pinned")
        self._pins[s] -= 1
        self._maybe_free(s)

    def unmap(self, slot: int) -> None:
        """Stop the slot's key from being found, nothing else: the slot keeps its state and pins (a copy in flight
        still lands, its readers still read) and frees once it is neither loading nor pinned. For a cache that keeps
        nothing (retain off), whose previous step's slots must not be hits but may still be landing; cheaper for
        the next misses than leaving them mapped (no eviction ranking for a slot that is going anyway)."""
        s = self._slot(slot)
        if self._state[s] == FREE:
            raise ValueError(f"slot {s} is free: nothing to unmap")
        self._drop_spec(s)
        self._unmap(s)
        self._maybe_free(s)

    def invalidate(self, slot: int) -> None:
        """The copy failed or its source was recycled (call it once the copy has stopped): unmap the key;
        the slot is free once unpinned. A `loaded` that arrives later leaves it stale."""
        s = self._slot(slot)
        if self._state[s] == FREE:
            raise ValueError(f"slot {s} is free: nothing to invalidate")
        self.stats.invalidations += 1
        self._drop_spec(s)
        self._unmap(s)
        self._state[s] = STALE
        self._maybe_free(s)

    def check(self) -> None:
        """Assert the invariants (tests call this after every operation of a random run)."""
        mapped = np.flatnonzero(self._mapped)
        assert len(mapped) == self._n_mapped <= self.capacity
        assert (self._slot_of[self._key[mapped]] == mapped).all()
        assert int((self._slot_of >= 0).sum()) == self._n_mapped
        assert np.isin(self._state[mapped], (LOADING, READY)).all()
        free = np.zeros(self.n_slots, bool)
        free[self._free] = True
        assert len(self._free) == int(free.sum()), "a slot is on the free list twice"
        assert ((self._state == FREE) == free).all()
        assert (self._pins[free] == 0).all() and (self._key[free] == -1).all() and not self._mapped[free].any()
        # an unmapped slot lingers only while someone uses it or its copy is in flight
        held = ~free & ~self._mapped
        assert ((self._pins[held] > 0) | (self._state[held] == LOADING)).all()

    # ---- acquisition ---------------------------------------------------------------------------------

    def _acquire_demand(self, key: int, rank: int | None) -> int | None:
        if key in self._revoked:                 # a revoked hit: its miss and use are counted already
            self._revoked.discard(key)
        else:
            self.stats.misses += 1
            self._use(key, rank)
        return self._place_demand(key)

    def _place_demand(self, key: int) -> int | None:
        if self._free:
            return self._demand_into_free(key)
        # The slack is used up (every unmapped slot is pinned): only an unpinned ready slot can be reused.
        victim = self._lowest(self._reusable())
        if victim is not None and self._outranks(key, victim[1]):
            self._evict(victim[0])
            return self._install(key, mapped=True)
        self.stats.rejected_no_slot += 1
        return None

    def _demand_into_free(self, key: int) -> int:
        if self._n_mapped < self.capacity:
            return self._install(key, mapped=True)
        # Every mapped key competes, in use or not (this step's own included): the simulator's top-capacity.
        victim = self._lowest(self._mapped)
        if victim is not None and self._outranks(key, victim[1]):
            self._evict(victim[0])
            return self._install(key, mapped=True)
        self.stats.transient_loads += 1
        return self._install(key, mapped=False)

    def _acquire_speculative(self, key: int, rank: int | None) -> int | None:
        rec = self._code(rank)
        if self._n_mapped < self.capacity and self._free:
            slot = self._install(key, mapped=True)
        else:
            if self.spec_displaces:
                # not used this step, not an unused guess: the lowest-ranked of those goes, ranks aside
                cand = self._reusable() & ~self._spec
                used_now = self._rec[np.maximum(self._key, 0)] >= self._now * RANK_SPAN
                victim = self._lowest(cand & ~used_now)
            else:
                victim = self._lowest(self._reusable())
                if victim is not None and not self._outranks(key, victim[1], rec=rec):
                    victim = None
            if victim is None:
                self.stats.spec_declined += 1
                return None
            self._evict(victim[0])
            slot = self._install(key, mapped=True)
        self._rec[key] = rec           # recency, so the next demand miss does not evict it before its use
        self._spec[slot] = True
        self.stats.spec_loads += 1
        return slot

    def _install(self, key: int, *, mapped: bool) -> int:
        s = self._free.pop()
        self._state[s] = LOADING
        self._key[s] = key
        self._pins[s] = 1
        if mapped:
            self._mapped[s] = True
            self._slot_of[key] = s
            self._n_mapped += 1
        return s

    def _reusable(self) -> np.ndarray:
        """Mapped slots that could be handed out at once if evicted: ready and unpinned (bool mask)."""
        return self._mapped & (self._pins == 0) & (self._state == READY)

    # ---- eviction and freeing ------------------------------------------------------------------------

    def _evict(self, s: int) -> None:
        self.stats.evictions += 1
        self._drop_spec(s)
        self._unmap(s)
        self._maybe_free(s)

    def _drop_spec(self, s: int) -> None:
        if self._spec[s]:
            self.stats.spec_wasted += 1
            self._spec[s] = False

    def _unmap(self, s: int) -> None:
        if self._mapped[s]:
            self._slot_of[self._key[s]] = -1
            self._mapped[s] = False
            self._n_mapped -= 1

    def _maybe_free(self, s: int) -> None:
        # an unmapped slot goes back once nobody reads it and no copy still writes it
        if not self._mapped[s] and self._pins[s] == 0 and self._state[s] != LOADING and self._state[s] != FREE:
            self._state[s] = FREE
            self._key[s] = -1
            self._spec[s] = False
            self._free.append(s)

    # ---- policy --------------------------------------------------------------------------------------

    def _code(self, rank: int | None) -> int:
        """The recency code of a touch now; without a rank, touches of a step rank in call order."""
        if rank is None:
            rank = self._nth
        self._nth += 1
        return self._now * RANK_SPAN + (RANK_SPAN - 1 - rank)

    def _use(self, key: int, rank: int | None) -> None:
        """A demand use (hit or miss): recency, count and decayed frequency, as coli.sim updates them."""
        self._rec[key] = self._code(rank)
        prev = int(self._used[key])
        age = self._now - prev if prev >= 0 else 0
        if self.count_decay < 1.0:
            self._cnt[key] = self._cnt[key] * self.count_decay ** age + 1.0
        else:
            self._cnt[key] += 1.0
        self._fdec[key] = self._fdec[key] * self.decay ** age + 1.0
        self._used[key] = self._now

    def _rank_cols(self, keys: np.ndarray, rec: np.ndarray) -> tuple[np.ndarray, ...]:
        """The policy's ranking of keys as columns, most significant first (higher is kept)."""
        if self.policy == "lru":
            return (rec,)
        if self.policy == "rdf":
            return (rec // RANK_SPAN, self._fdec[keys], rec)
        cnt = self._count_now(keys)
        if self.policy == "freq":
            return (cnt, rec)
        return ((rec // RANK_SPAN) == self._now, cnt, rec)   # lfu: this step's requests first

    def _lowest(self, candidates: np.ndarray) -> tuple[int, tuple] | None:
        """The lowest-ranked slot of a bool mask [n_slots] and its rank tuple, or None if the mask is empty.
        The same order as _lowest_by_cols, in the fewest whole-array operations per policy (this runs once
        per miss over up to a few thousand slots)."""
        slots = np.flatnonzero(candidates)
        if len(slots) == 0:
            return None
        keys = self._key[slots]
        rec = self._rec[keys]
        if self.policy == "lfu":
            older = rec < self._now * RANK_SPAN          # not used this step: these go first
            if older.any():
                slots, keys, rec = slots[older], keys[older], rec[older]
        if self.policy in ("freq", "lfu"):
            cnt = self._count_now(keys)
            rec = np.where(cnt == cnt.min(), rec, _I64_MAX)
        i = int(rec.argmin())
        if self.policy == "rdf":
            # recency is by step: the keys last used in the oldest step compete on frequency, then rank
            tied = np.flatnonzero(rec < (rec[i] // RANK_SPAN + 1) * RANK_SPAN)
            if len(tied) > 1:
                f = self._fdec[keys[tied]]
                tied = tied[f == f.min()]
                i = int(tied[rec[tied].argmin()])
        return self._ranked(int(slots[i]))

    def _lowest_by_cols(self, candidates: np.ndarray) -> tuple[int, tuple] | None:
        """The definition of _lowest: lexicographic minimum over _rank_cols (tests check they agree)."""
        slots = np.flatnonzero(candidates)
        if len(slots) == 0:
            return None
        keys = self._key[slots]
        keep = np.ones(len(slots), bool)
        for c in self._rank_cols(keys, self._rec[keys]):
            keep &= c == c[keep].min()
        return self._ranked(int(slots[keep][0]))

    def _ranked(self, s: int) -> tuple[int, tuple]:
        k = self._key[s:s + 1]
        return s, tuple(c[0].item() for c in self._rank_cols(k, self._rec[k]))

    def _count_now(self, keys: np.ndarray) -> np.ndarray:
        cnt = self._cnt[keys]
        if self.count_decay < 1.0:
            # counts are stored as of their last use; bring them to now to compare
            cnt = cnt * np.power(self.count_decay, self._now - self._used[keys])
        return cnt

    def _outranks(self, key: int, other: tuple, *, rec: int | None = None) -> bool:
        keys = np.array([key])
        cols = self._rank_cols(keys, np.array([self._rec[key] if rec is None else rec]))
        return tuple(c[0].item() for c in cols) > other

    # ---- argument checks -----------------------------------------------------------------------------

    def _slot(self, slot: int) -> int:
        s = int(slot)
        if not 0 <= s < self.n_slots:
            raise ValueError(f"slot {slot} out of range [0, {self.n_slots})")
        return s

    def _keyed(self, key: int) -> int:
        k = int(key)
        if not 0 <= k < self.n_keys:
            raise ValueError(f"key {key} out of range [0, {self.n_keys})")
        return k


def staging_slots(n_slots: int, top_k: int) -> int:
    """The slack the GPU executor's pool keeps beside its capacity (VramExperts): room for one step's top-k misses,
    at most half the pool."""
    return min(int(top_k), max(1, int(n_slots) // 2))


def _check_rank(rank: int | None) -> None:
    if rank is not None and not 0 <= rank < RANK_SPAN:
        raise ValueError(f"rank must be in [0, {RANK_SPAN}), got {rank}")


def _check_args(n_slots, slot_bytes, policy, n_keys, staging, decay, count_decay) -> None:
    if policy not in POOL_POLICIES:
        raise ValueError(f"unknown pool policy {policy!r} (choose from {', '.join(POOL_POLICIES)})")
    if n_slots < 1 or slot_bytes < 1 or n_keys < 1:
        raise ValueError(f"n_slots, slot_bytes and n_keys must be >= 1 (got {n_slots}, {slot_bytes}, {n_keys})")
    if not 0 <= staging <= n_slots:
        raise ValueError(f"staging must be in [0, n_slots={n_slots}] (got {staging})")
    if not 0.0 <= decay <= 1.0:
        raise ValueError(f"decay must be in [0, 1] (got {decay})")
    if not 0.0 < count_decay <= 1.0:
        raise ValueError(f"count_decay must be in (0, 1] (got {count_decay})")


# ---- sizing ----------------------------------------------------------------------------------------------

def size_pool(budget_bytes: int, dense_bytes: int, kv_bytes: int, workspace_bytes: int, slot_bytes: int, *,
              min_slots: int) -> dict:
    """How many slots of slot_bytes the VRAM budget leaves after the dense core, KV cache and workspaces.
    Raises ColiError, naming every figure and the shortfall, when fewer than min_slots fit."""
    figures = {"budget_bytes": budget_bytes, "dense_bytes": dense_bytes, "kv_bytes": kv_bytes,
               "workspace_bytes": workspace_bytes}
    for name, v in figures.items():
        if v < 0:
            raise ValueError(f"{name} must be >= 0, got {v}")
    if slot_bytes < 1 or min_slots < 0:
        raise ValueError(f"slot_bytes must be >= 1 and min_slots >= 0 (got {slot_bytes}, {min_slots})")
    left = budget_bytes - dense_bytes - kv_bytes - workspace_bytes
    n = max(left, 0) // slot_bytes
    if n < min_slots:
        short = min_slots * slot_bytes - left
        raise ColiError(
            f"VRAM budget {_size(budget_bytes)} is too small: dense core {_size(dense_bytes)}, KV cache "
            f"{_size(kv_bytes)} and workspaces {_size(workspace_bytes)} leave {_size(left)} for expert slots of "
            f"{_size(slot_bytes)}, room for {n} of the {min_slots} needed; {_size(short, up=True)} "
            f"({short} bytes) more is needed (raise --vram-gb to at least {_size(budget_bytes + short, up=True)})")
    return {"slots": int(n), "slot_bytes": slot_bytes, "pool_bytes": int(n * slot_bytes), **figures}


def describe_pool(d: dict) -> str:
    """One start-up log line for a size_pool result."""
    return (f"VRAM budget {_size(d['budget_bytes'])}: dense {_size(d['dense_bytes'])}, KV {_size(d['kv_bytes'])}, "
            f"workspaces {_size(d['workspace_bytes'])}, pool {d['slots']} slots x {_size(d['slot_bytes'])} "
            f"= {_size(d['pool_bytes'])}")


def _size(n: float, *, up: bool = False) -> str:
    """Decimal units (GB = 1e9, as --vram-gb counts them) with one decimal, from 0.1 of the unit up, so the
    figures of one budget read in one unit; up=True rounds up (a shortfall rounded down would not do)."""
    sign, n = ("-", -n) if n < 0 else ("", n)
    for unit, k in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= k / 10:
            v = math.ceil(n / k * 10) / 10 if up else n / k
            return f"{sign}{v:.1f} {unit}"
    return f"{sign}{n:.0f} B"
