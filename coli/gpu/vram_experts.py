"""The VRAM execution cache as an expert source for the CUDA backend: a pool of expert slots in one device
allocation, filled from pinned host memory by the copy lanes (coli.gpu.lanes), with every expert the GPU
cannot take computed on the CPU instead (never an error, never a wrong token).

Per MoE layer step (`stream(layer, ids)`), two-phase:
  1. VRAM hits are yielded at once (with the events of a copy still in flight, if any);
  2. misses are asked of the host tier in one batch; each is copied as soon as its host record is there
     (RAM-resident ones at once, disk misses when their read lands). Between the phases, and whenever the
     next host record will take a while, a FLUSH marker lets the backend launch what it holds.
The earlier steps' bookkeeping (reaping their landed copies) waits until this step's copies are issued, so the path
from the router's result to the first copy on the bus is only the lookups and the first acquire (docs/gpu.md,
"A streaming MoE layer, step by step"). A speculative copy that its demand cuts short hands the prefix that landed
to the demand, which copies only the rest; how many guesses are copied at all is SpecGovernor's budget.

Fallbacks to the CPU (counted per kind in `fallbacks`, logged once per kind): `oversize` (record larger
than a slot), `no_slot` (every slot pinned, even after launching what is held), `copy_error` (the H2D copy
failed), `kernel_error` (the MoE kernels failed to launch; the backend computes that batch on the CPU). A
speculative copy whose unleased host slot was recycled meanwhile fails its generation check and is copied
again on demand (`stale_copies`); a demand copy holds a lease, so its check cannot fail (`eviction_races`
counts it if it ever does, and the slot is dropped).
A fatal driver error (context lost) is raised as `GpuLost` for the owner to demote the run to the CPU.

Host tiers implement `HostTier` (below): the RAM tier's shared-memory arena in the stage runtime
(stages/executor/gpu_host.py), or pinned read buffers over a container for `coli run`
(coli/gpu/host_records.py).

Keys: key = layer * E + expert. Slot s lives at base + s * slot_bytes.
"""

from __future__ import annotations

import itertools
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Protocol

import numpy as np

from coli.container.format import RecordLayout, align
from coli.container.reader import decode_expert_record
from coli.errors import ColiError
from coli.gpu.driver import DriverError, EventPool, get_driver, handle_of
from coli.gpu.lanes import DEFAULT_TILE_BYTES, CopyJob, CopyLane
from coli.gpu.layer_ahead import AHEAD_FRACTION, AHEAD_TILE_BYTES, ahead_of, first_ahead
from coli.gpu.cuda_weights import FLUSH, DeviceRecord, HostExpert, check_record_formats
from coli.gpu.pool import SlotPool, staging_slots
from coli.gpu.spec_governor import SpecGovernor
from coli.weights import ExpertWeights

SLOT_ALIGN = 4096
FALLBACK_KINDS = ("oversize", "no_slot", "copy_error", "kernel_error")


class GpuLost(ColiError):
    """The CUDA context is gone (a fatal driver error): the run must continue on the CPU."""


@contextmanager
def fatal_is_gpu_lost():
    """A fatal driver error inside (a lost context) becomes GpuLost, which demotes the run to the CPU; others pass."""
    try:
        yield
    except DriverError as e:
        if e.fatal:
            raise GpuLost(f"the GPU failed fatally ({e}); continuing on the CPU") from None
        raise


@dataclass(eq=False)
class HostRecord:
    """An expert record readable at host address `addr` (registered/pinned memory); `array` is the same
    bytes as uint8 [nbytes]. `token` is the tier's own handle (lease, generation)."""

    layer: int
    expert: int
    addr: int
    nbytes: int
    array: np.ndarray
    token: Any = None


class HostTier(Protocol):
    def grants(self, layer: int, ids: list[int]) -> Iterator[HostRecord | None]: ...
    # each id once, in arrival order; None when the next will take a while (a disk read)
    def release(self, rec: HostRecord) -> None: ...
    def probe(self, layer: int, expert: int) -> HostRecord | None: ...   # resident now? no lease taken
    def still_valid(self, rec: HostRecord) -> bool: ...                   # not recycled since grant/probe
    def prefetch(self, layer: int, ids: list[int]) -> None: ...           # warm the host tier (no answer)
    def pinned_ranges(self) -> list[tuple[int, int]]: ...                 # (addr, nbytes) to register
    def reclaim_hook(self, fn: Callable[[], None]) -> None: ...           # called while the tier waits


def speculative_copies_default(env: dict | None = None) -> bool:
    """COLI_SPEC_COPIES: "0" (default) the pilot's RAM-resident guesses are not copied to VRAM ahead of their demand;
    "1" they go to the speculative copy lane. It used to cost (H200, spec-ram, ORACLE pilot: 2.93 tok/s on against
    3.43 off -- every trickle cut short by its own demand and copied again); with the landed prefix handed to the
    demand and SpecGovernor's budget it pays a little (3.77 on against 3.68 off, docs/perf-notes.md, issue 14 §4).
    Still off by default: measured with an oracle's guesses only, not with the real pilot's."""
    v = (os.environ if env is None else env).get("COLI_SPEC_COPIES", "0").strip()
    if v not in ("0", "1"):
        raise ColiError(f"COLI_SPEC_COPIES={v!r}: use 0 (no speculative VRAM copies, the default) or 1")
    return v == "1"


class VramExperts:
    def __init__(self, backend, host: HostTier, layout: RecordLayout, n_layers: int, n_experts: int, top_k: int,
                 n_slots: int, *, policy: str = "freq", tile_bytes: int = DEFAULT_TILE_BYTES, faults=None,
                 log=None, register: bool = True, slot_bytes: int | None = None, retain: bool = True,
                 sync: bool = False, speculate: bool | None = None, spec_budget: int | None = None,
                 ahead_layers: list[int] | None = None, ahead_fraction: float = AHEAD_FRACTION):
        """retain=False: a demand-loaded slot is invalidated once its copy has landed (freed when its readers
        are done), so nothing stays resident and every step misses (the `cold-ram`/`disk` benchmarks).
        sync=True (the `sync` benchmark baseline): a tile is the whole record, the host waits for each copy
        to finish before yielding it, and no FLUSH markers are yielded (except when no slot is free until
        the held records are launched), so the backend copies every expert and then computes.
        speculate: the pilot's RAM-resident guesses go to the speculative copy lane (None: COLI_SPEC_COPIES, off by
        default -- measured a net cost, see speculative_copies_default); off, a guess only warms the host tier.
        spec_budget: speculative copies per prefetch (None: as many as the idle window has been landing, see
        coli/gpu/spec_governor.py; a number: up to that many, whatever they deliver -- tests of single copies).
        ahead_layers: the model's MoE layers, for layer-ahead prefill copies (coli/gpu/layer_ahead.py): a step that
        asked for >= ahead_fraction of its layer's experts puts every expert of the next MoE layer on the speculative
        lane, whatever `speculate` says and outside the governor's budget (not guesses: that layer needs them all);
        a forward step whose rows are expected to ask for that share (begin_step) does so for its first MoE layer.
        None (the default here; the product decides in coli/gpu/setup.py): none."""
        check_record_formats(layout)
        self.b, self.rt, self.host, self.layout = backend, backend.rt, host, layout
        self.E, self.K = n_experts, top_k
        self.faults, self.log = faults, log
        self.drv = get_driver()
        self.ctx = self.drv.current_context()
        # a slot holds one record of the container's layout (slot_bytes overrides it: tests of oversize records)
        self.slot_bytes = align(layout.nbytes if slot_bytes is None else slot_bytes, SLOT_ALIGN)
        self.retain, self.sync = bool(retain), bool(sync)
        self.speculate = speculative_copies_default() if speculate is None else bool(speculate)
        self.tile = self.slot_bytes if self.sync else max(4096, int(tile_bytes))
        self.ahead_tile = max(self.tile, AHEAD_TILE_BYTES)   # layer-ahead copies' tile (coli/gpu/layer_ahead.py)
        self.split = layout.down.offset            # gate/up bytes come first in a record
        self.n_slots = int(n_slots)
        self.pool = SlotPool(self.n_slots, self.slot_bytes, policy, n_keys=n_layers * n_experts,
                             staging=staging_slots(self.n_slots, top_k), spec_displaces=True)
        self._mem = self.rt.alloc(self.n_slots * self.slot_bytes)
        self.base = int(self._mem)
        self.events = EventPool(self.drv)
        self.demand = CopyLane(self.drv, self.ctx, self.events, "demand", inline=True)   # issued on this thread
        self.spec = CopyLane(self.drv, self.ctx, self.events, "speculative", speculative=True, demand=self.demand)
        self.slot_job: list[CopyJob | None] = [None] * self.n_slots      # the copy that filled the slot
        self.slot_src: list[HostRecord | None] = [None] * self.n_slots   # its source (speculative: unleased)
        # one driver event per slot, recorded on the compute stream after the kernels that last read it; a copy
        # into the slot waits for it on its lane (None until the slot is first read)
        self._consumed_ev = [self.drv.event_create(timing=False) for _ in range(self.n_slots)]
        self.slot_consumed: list[int | None] = [None] * self.n_slots
        self._compute_stream = handle_of(self.rt.stream)
        self._pending: list[tuple[CopyJob, HostRecord | None, int]] = []  # copies whose source is held
        self._spec_jobs: dict[int, CopyJob] = {}                          # slot -> speculative job in flight
        # how many guesses go to the speculative lane: what the idle window delivered (coli/gpu/spec_governor.py)
        self.spec_budget = None if spec_budget is None else int(spec_budget)
        self.governor = SpecGovernor(layout.nbytes, max_budget=top_k) if spec_budget is None else None
        self._spec_layers: dict[int, int] = {}        # layer -> speculative copies put on the lane for it
        self._spec_used = 0                           # bytes of them the current step used
        # slot -> bytes of a guess that landed whole and was finished by a reap (the router's before_host_wait, a
        # step's): counted in _spec_used when a demand then hits it, as one still in flight at its lookup is
        self._spec_landed: dict[int, int] = {}
        self.ahead_layers = None if ahead_layers is None else sorted(int(m) for m in ahead_layers)
        self.ahead_fraction = float(ahead_fraction)
        self._ahead: set[CopyJob] = set()             # layer-ahead copies not finished yet (a subset of _spec_jobs')
        self._registered: list[int] = []
        # copies whose events records handed out still carry (their kernels not queued yet): copy -> such records.
        # A reap that finishes one of them meanwhile parks its events here, not in the pool: recorded again by the
        # next copy, they would make those kernels wait for it (a false dependency). Back at the last on_consumed.
        self._readers: dict[CopyJob, int] = {}
        self._parked: dict[CopyJob, list[int]] = {}
        self.fallbacks = {k: 0 for k in FALLBACK_KINDS}
        self._logged: set[str] = set()
        self.stats = {"copies": 0, "copy_bytes": 0, "demand_copy_s": 0.0, "spec_copies": 0, "spec_bytes": 0,
                      "spec_copy_s": 0.0, "spec_cancelled": 0, "stale_copies": 0, "eviction_races": 0, "steps": 0,
                      "spec_handoffs": 0, "spec_handoff_bytes": 0,
                      # layer-ahead prefill copies (also counted in spec_*): layers copied ahead, copies put on the
                      # lane, and bytes of them that landed (whole copies, and prefixes a demand took over); of the
                      # layers, those that were a forward's first MoE layer, copied from its step's start
                      "ahead_layers": 0, "ahead_copies": 0, "ahead_bytes": 0, "ahead_first": 0}
        # per demand copy: its device time, lane start event -> last tile done (the start event fires when the
        # demand stream reaches the job, after the slot's previous readers), and its bytes (same index)
        self.delays_us: list[float] = []
        self.delay_nbytes: list[int] = []
        self.timeline: list[dict] | None = None      # see start_timeline
        self._tl_ref = 0
        self.t0 = time.perf_counter()
        if register:
            try:
                for addr, n in host.pinned_ranges():
                    self.drv.host_register(addr, n)
                    self._registered.append(addr)
            except BaseException:               # a range the driver refuses: the others go back, nothing hooked
                for addr in self._registered:
                    self.drv.host_unregister(addr)
                self._registered.clear()
                self.spec.close()               # the lanes made above (the speculative one has its thread)
                self.demand.close()
                raise
        # after the registration: a constructor that fails there leaves the host tier's and the backend's hooks as
        # they were (review8)
        host.reclaim_hook(lambda: self._reap(wait=True))
        backend.on_kernel_error = self._on_kernel_error
        from coli.gpu.busy import BusyClock
        self.busy = BusyClock(self.drv, handle_of(self.rt.stream))
        backend.busy = self.busy
        self._last = (time.perf_counter(), 0.0, 0.0, 0.0)   # (t, demand copy s, spec copy s, SM busy s)
        backend.before_host_wait = self._land_pending

    # ---- the expert source ------------------------------------------------------------------------------
    def begin_step(self, tokens: int) -> None:
        """A forward step of `tokens` rows begins (coli/model/forward.py, before its first layer). A long prefill from
        its start (coli/gpu/layer_ahead.py first_ahead: its rows are expected to ask for >= ahead_fraction of a
        layer's experts) puts every expert of the forward's first MoE layer on the speculative lane now, as
        `_copy_ahead` does for the next layer, so they cross while the dense layers before it run; that layer's step
        cancels what is still queued (`_stop_ahead`) and copies the rest on demand, so a prompt that asks for fewer
        than expected costs no demand a slot or a wait (a short one copies nothing: first_ahead says no).
        Counted in ahead_layers / ahead_copies / ahead_bytes as the others, and in ahead_first."""
        first = None if self.ahead_layers is None else first_ahead(tokens, self.ahead_layers, self.E, self.K,
                                                                    self.ahead_fraction)
        if first is None:
            return
        with fatal_is_gpu_lost():
            if self._copy_ahead(*first):
                self.stats["ahead_first"] += 1

    def stream(self, layer: int, ids: list[int]) -> Iterator[Any]:
        with fatal_is_gpu_lost():
            yield from self._stream(layer, ids)
            nxt = None if self.ahead_layers is None else ahead_of(layer, len(ids), self.ahead_layers, self.E,
                                                                   self.ahead_fraction)
            if nxt is not None:                  # every expert of the step handed out, its copies issued:
                if not self.sync:                # the held batch launched first (the same batch the backend
                    yield FLUSH                  # launches after the last item), then the next layer's copies
                self._copy_ahead(*nxt)

    def _stream(self, layer: int, ids: list[int]) -> Iterator[Any]:
        if self.faults is not None and self.faults.hit("gpu_lost"):
            raise GpuLost("injected gpu_lost (a fatal driver error, as if the context were lost)")
        # The previous steps' copies are finished (generation check, slot READY, lease back: ~25 us of Python
        # each) after this step's misses are on the bus, not before: that bookkeeping sat between the router
        # and the first copy (~200 us a layer on the H200, docs/perf-notes.md). Deferred only where it cannot
        # change a decision: every miss finds a free slot without the slots the reap would free; with retain off
        # the older slots are unmapped at once (no hit on them, no eviction ranking for them).
        if self._ahead:                          # before the reap, which frees their slots (and before the cancel of
            self._stop_ahead(layer * self.E, (layer + 1) * self.E, set(ids))   # this step's own keys below)
        older = {id(job) for job, _rec, _s in self._pending} if self._can_defer_reap(ids) else None
        if older is None:
            self._reap(wait=not self.retain)     # retain off: every landed copy is dropped before the lookups
        elif not self.retain:                    # ... or at least not found (the reap frees them later)
            for _job, _rec, s in self._pending:
                if self.pool.is_mapped(s):
                    self.pool.unmap(s)
        if self._spec_jobs:                      # this step's keys on the speculative lane stop now, all of them:
            keys = {layer * self.E + e for e in ids}     # cancelled one by one at their lookups, the next one
            for job in self._spec_jobs.values():         # could start its trickle meanwhile (a tile each)
                if job.key in keys and not job.submitted.is_set():
                    self.spec.cancel(job)
                    self.stats["spec_cancelled"] += 1
        self.pool.begin_step()
        self.stats["steps"] += 1
        misses: list[int] = []
        handoff: dict[int, tuple[int, CopyJob]] = {}     # expert -> (slot, its cut-short speculative copy)
        speculated = self._spec_layers.pop(layer, 0)
        self._spec_used = 0
        hits = 0
        early: tuple[HostRecord, Any] | None = None     # the first miss, loaded before the hits' FLUSH (below)
        held: HostRecord | None = None                  # a granted record not handed out yet (or a CPU fallback's)
        try:                                            # from the hits on: a step closed at any yield cleans up
            for e in ids:
                s = self._demand_hit(layer * self.E + e, handoff, e)
                if s is None:
                    misses.append(e)
                else:
                    hits += 1
                    yield e, self._device_record(layer, e, s)
            if not misses:
                return
            grants: Iterator[HostRecord | None] = iter(self.host.grants(layer, misses))
            if hits and not self.sync:
                # the first miss's copy goes on the bus before the hits' kernels are launched at the FLUSH (the
                # backend's Python, tens of µs a batch, that the link would otherwise idle through); its handle is
                # yielded after the FLUSH, where it was, so the batches and their order stay the same. Only while a
                # slot is free: then the acquire ranks every mapped key, pinned or not, as it would after the FLUSH;
                # with none free only unpinned slots are reusable and the hits, pinned until the FLUSH, would drop
                # out of the ranking -- another key evicted (tests/vram/test_early_first_miss.py)
                if self.pool.n_free > 0:
                    first = next(grants, None)
                    if first is not None:
                        early = (first, self._miss(layer, first, handoff))
                        grants = itertools.chain([first], grants)
                    else:                        # a disk read on its way first: as before
                        grants = itertools.chain([None], grants)
                yield FLUSH
            for rec in grants:
                if rec is None:                  # a disk read is on its way: time to reap meanwhile
                    if older:
                        self._reap(wait=not self.retain, only=older)
                        older = None
                    if not self.sync:
                        yield FLUSH
                    continue
                if early is not None and rec is early[0]:
                    h, early = early[1], None
                else:
                    h = self._miss(layer, rec, handoff)
                if h is FLUSH:                       # no free slot until the held records are launched
                    held = rec                       # granted, no slot: a step stopped at this FLUSH gives it back
                    yield FLUSH
                    h = self._load(layer, rec, retry=True)
                    held = None                      # a copy issued owns it now (a CPU fallback sets it again)
                if isinstance(h, HostExpert):        # computed on the CPU from the host slot: it goes back after
                    held = rec
                yield rec.expert, h
                if isinstance(h, HostExpert):
                    held = None
                    self.host.release(rec)
        finally:
            if held is not None:                 # the step stopped while this record was held (review8)
                self.host.release(held)
            if early is not None:                # loaded before the FLUSH, never handed out: the step stopped there
                self._drop_early(*early)
            for s, job in handoff.values():      # never granted (the step stopped early): drop them
                self._drop_handoff(s, job)
            if speculated and self.governor is not None:
                self.governor.demanded(self._spec_used)
            if older:                            # this step's copies are issued: now the older ones (landed
                self._reap(wait=not self.retain, only=older)   # before this router ran: no real wait)

    def _miss(self, layer: int, rec: HostRecord, handoff: dict) -> Any:
        """A granted miss's handle: its copy issued (or the rest of a speculative copy cut short), a CPU fallback, or
        FLUSH when no slot is free until the held records are launched."""
        ho = handoff.pop(rec.expert, None)
        return self._load(layer, rec) if ho is None else self._resume(layer, rec, *ho)

    def _drop_early(self, rec: HostRecord, h: Any) -> None:
        """The first miss was loaded before the FLUSH that launches the hits and the consumer stopped at that FLUSH (the
        backend raised while launching them): nothing will read it. A device record gives its slot pin back (as the
        backend does for records it held; its copy lands and is reaped as any other, which returns the lease); a CPU
        fallback or a FLUSH (no slot) holds no copy, so the host lease goes back now."""
        if isinstance(h, DeviceRecord):
            h.on_consumed(None)
        else:
            self.host.release(rec)

    def _land_pending(self) -> None:
        """The backend's host is about to block for a router's top-k (or a step's token), which the GPU computes after
        every demand copy issued so far has landed (the MoE kernels that read them come first on the compute stream):
        finish those copies now, each as it lands, so that the next step's `_stream` finds nothing to reap between
        its router and its first copy. The same bookkeeping the step would do there (`_reap` of every landed copy),
        so the same slots are READY at its lookups and the pool decides the same; only earlier. A speculative copy
        is not waited for (it may still trickle after the router): finished ones are reaped, the others stay."""
        if self._pending or self._spec_jobs:
            with fatal_is_gpu_lost():
                self._reap(wait=True)

    def _can_defer_reap(self, ids: list[int]) -> bool:
        return bool(self._pending) and not self.sync and self.pool.n_free >= len(ids)

    def prefetch(self, layer: int, ids: list[int]) -> None:
        """The pilot's guesses for a coming layer: RAM-resident ones go to the speculative lane (when speculate is
        on), the others to the host tier's prefetch."""
        budget = 0 if not self.speculate else (self.governor.budget() if self.governor is not None
                                               else self.spec_budget)
        put = self._speculate(layer, ids, budget)
        if put:
            self._spec_layers[layer] = self._spec_layers.get(layer, 0) + put

    def _copy_ahead(self, layer: int, ids: list[int]) -> int:
        """A long prefill's step is handed out and launched: `ids` of the next MoE layer `layer` (every expert, from
        coli/gpu/layer_ahead.py ahead_of) to the speculative lane, outside the governor's books. After the launch, so
        the probes and acquires (O(slots) each where a copy displaces a key) are not between the step's last copy
        and its last kernels; the step's keys are unpinned then but still not displaced (used in this step).
        Also the forward's first MoE layer at the step's start (begin_step): the last step's keys, the previous
        forward's last MoE layer, are the ones kept then."""
        put = self._speculate(layer, ids, budget=self.E, ahead=True)
        if put:
            self.stats["ahead_layers"] += 1
            self.stats["ahead_copies"] += put
        return put

    def _stop_ahead(self, lo: int, hi: int, ids: set[int]) -> None:
        """A step of the layer with keys [lo, hi) begins: layer-ahead copies still queued for any other key stop (a
        forward that ended early, or experts this step did not ask for) -- they would hold slots this step's demand
        may need; the reap frees their slots. The trickle's current one finishes its tile first. This step's own
        keys are cancelled by the caller and taken over by the demand."""
        for job in self._ahead:
            if job.submitted.is_set() or job.cancelled or (lo <= job.key < hi and job.key - lo in ids):
                continue
            self.spec.cancel(job)
            self.stats["spec_cancelled"] += 1

    def _speculate(self, layer: int, ids: list[int], budget: int, ahead: bool = False) -> int:
        """Up to `budget` of ids that are RAM-resident and not in VRAM go to the speculative lane, each into a slot
        the pool gives up for a guess; the cold ones to the host tier's prefetch. -> how many were put."""
        cold: list[int] = []
        put = 0
        for e in ids:
            key = layer * self.E + e
            if self.pool.slot_of(key) is not None:
                continue
            rec = self.host.probe(layer, e)
            if rec is None:
                cold.append(e)
                continue
            if put >= budget:                    # in RAM already: nothing to warm, no speculative copy (off, or
                continue                         # beyond what the idle window has been landing)
            if rec.nbytes > self.slot_bytes:
                continue
            s = self._acquire(key, speculative=True)
            if s is None:
                continue
            job = CopyJob(key, self.base + s * self.slot_bytes, rec.addr, rec.nbytes, self.split,
                          self.ahead_tile if ahead else self.tile, wait_event=self.slot_consumed[s])
            self.slot_job[s], self.slot_src[s] = job, rec
            self._spec_jobs[s] = job
            if ahead:
                self._ahead.add(job)
            self.spec.submit(job)
            put += 1
        if cold:
            self.host.prefetch(layer, cold)
        return put

    # ---- hits -----------------------------------------------------------------------------------------------
    def _demand_hit(self, key: int, handoff: dict, e: int) -> int | None:
        s = self.pool.lookup(key)                # pins s when it holds key (READY or still loading)
        if s is None:
            return None
        job = self._spec_jobs.pop(s, None)
        if job is None:
            self._spec_used += self._spec_landed.pop(s, 0)
            return s
        if not job.submitted.is_set():
            if not job.cancelled:
                self.stats["spec_cancelled"] += 1
            if not self.spec.cancel(job):        # the trickle has it: it stops after its in-flight tile
                self.spec.wait_submitted(job)
        if (job.error is None and 0 < job.bytes_done < job.nbytes and self.slot_src[s] is not None
                and self.host.still_valid(self.slot_src[s])):
            # cut short with a prefix landed: a miss for the books (the host tier must lease the record), but
            # the slot and its prefix stay; the miss path copies only the rest (_resume)
            self.pool.revoke_hit(s)
            handoff[e] = (s, job)
            return None
        guess = job not in self._ahead           # a layer-ahead copy is not the governor's to judge
        if self._finish_spec(s, job, demanded=True):
            if guess:
                self._spec_used += job.nbytes
            return s
        self.pool.revoke_hit(s)                  # not a hit after all: the miss path copies it again
        self.pool.release(s)                     # the lookup's pin; the slot was dropped
        return None

    def _resume(self, layer: int, rec: HostRecord, s: int, job: CopyJob) -> Any:
        """A demand takes over a speculative copy into s that was cut short: when the leased record is the one
        the trickle read, still of the same generation, the demand lane copies the bytes after the landed prefix
        (the slot's earlier readers were waited for by the trickle); else the prefix is dropped and the record
        is loaded as any miss."""
        src = self.slot_src[s]
        if src is None or rec.addr != src.addr or rec.nbytes != src.nbytes or not self.host.still_valid(src):
            self._drop_handoff(s, job)
            return self._load(layer, rec)
        done = job.bytes_done
        self._free_events(job)
        self.slot_job[s], self.slot_src[s] = None, None
        self.pool.release(s)                     # the speculative pin; the lookup's goes with the kernels
        self.stats["spec_handoffs"] += 1
        self.stats["spec_handoff_bytes"] += done
        if job in self._ahead:
            self._ahead.discard(job)
            self.stats["ahead_bytes"] += done
        else:
            self._spec_used += done
        inject = self.faults is not None and self.faults.hit("copy_error")
        rest = CopyJob(job.key, job.dst + done, job.src + done, job.nbytes - done, max(0, job.split - done),
                       self.tile, inject_error=inject)
        return self._issue(layer, rec, s, rest)

    def _drop_handoff(self, s: int, job: CopyJob) -> None:
        self._finish_spec(s, job, demanded=True)     # incomplete: slot invalidated, speculative pin dropped
        self.pool.release(s)                         # the lookup's pin

    def _finish_spec(self, s: int, job: CopyJob, demanded: bool) -> bool:
        """A speculative copy into s is over (or, when demanded, is made to end now): True when the slot holds
        the key's bytes -- every tile landed and the unleased host source was not recycled meanwhile. Drops
        the speculative pin either way."""
        if demanded and not job.submitted.is_set():
            self.stats["spec_cancelled"] += 1
            if not self.spec.cancel(job):        # the trickle has it: it stops after its in-flight tile
                self.spec.wait_submitted(job)
        complete = job.error is None and job.tiles_done == job.n_tiles
        if complete:
            self.drv.event_sync(job.ev_done)
            self._account(job, speculative=True)
        src = self.slot_src[s]
        ok = complete and src is not None and self.host.still_valid(src)
        if complete and not ok:            # detected by the generation check: the demand copies it again
            self.stats["stale_copies"] += 1
            if "stale_copy" not in self._logged and self.log is not None:
                self._logged.add("stale_copy")
                self.log.warning("stale_copy", key=job.key, note="the host slot was recycled under a speculative "
                                 "copy; discarded and copied again on demand (logged once; counted in stats)")
        if not complete:
            self._free_events(job)
        self.slot_job[s], self.slot_src[s] = None, None
        if ok:
            self.pool.loaded(s)
        else:
            self.pool.invalidate(s)
        self.pool.release(s)
        self._ahead.discard(job)
        return ok

    def _device_record(self, layer: int, e: int, s: int) -> DeviceRecord:
        job = self.slot_job[s]
        ready = job.ev_gateup if job is not None else None
        ready_down = job.ev_done if job is not None else None
        if job is not None:                      # its events stay out of the pool until these kernels are queued
            self._readers[job] = self._readers.get(job, 0) + 1

        def consumed(_ev, s=s, job=job):
            # called right after the kernels reading s were queued: mark that point on the compute stream
            self.drv.event_record(self._consumed_ev[s], self._compute_stream)
            self.slot_consumed[s] = self._consumed_ev[s]      # a later copy into s waits for it on its lane
            self.pool.release(s)
            if job is not None:
                self._unread(job)

        return DeviceRecord(self.base + s * self.slot_bytes, self.layout, ready=ready, ready_down=ready_down,
                            on_consumed=consumed, fetch_host=lambda: self._fetch_host(layer, e, s))

    # ---- misses ---------------------------------------------------------------------------------------------
    def _load(self, layer: int, rec: HostRecord, retry: bool = False) -> Any:
        key = layer * self.E + rec.expert
        if rec.nbytes > self.slot_bytes or (self.faults is not None and self.faults.hit("oversize")):
            self._fallback_note("oversize", f"layer {layer} expert {rec.expert}: record of {rec.nbytes} bytes, "
                                            f"slots of {self.slot_bytes}")
            return self._host_expert(rec, "oversize")
        if retry:
            self._reap(wait=True)                # slots whose copies are still loading cannot be handed out
        s = self._acquire(key, retry=retry)
        if s is None:
            if not retry:
                return FLUSH
            self._fallback_note("no_slot", f"layer {layer} expert {rec.expert}: every VRAM slot is in use")
            return self._host_expert(rec, "no_slot")
        inject = self.faults is not None and self.faults.hit("copy_error")
        job = CopyJob(key, self.base + s * self.slot_bytes, rec.addr, rec.nbytes, self.split, self.tile,
                      wait_event=self.slot_consumed[s], inject_error=inject)
        return self._issue(layer, rec, s, job)

    def _issue(self, layer: int, rec: HostRecord, s: int, job: CopyJob) -> Any:
        """Put a demand copy into slot s (pinned, loading) on the demand lane: its DeviceRecord, or on a copy
        error the CPU fallback (the slot invalidated, its pin dropped)."""
        self.demand.submit(job)
        self.demand.wait_submitted(job)
        if self.sync and job.error is None:
            self.drv.event_sync(job.ev_done)     # the sync baseline: the bytes are there before the yield
        if job.error is not None:
            if isinstance(job.error, DriverError) and job.error.fatal:
                raise job.error
            try:                                 # a half that was issued must land before the slot is reused
                self.drv.stream_sync(self.demand.stream)
            except DriverError as e:
                if e.fatal:
                    raise
            self._free_events(job)
            self.pool.invalidate(s)
            self.pool.release(s)
            self._fallback_note("copy_error", f"layer {layer} expert {rec.expert}: {job.error}")
            return self._host_expert(rec, "copy_error")
        self.slot_job[s] = job
        self._pending.append((job, rec, s))
        return self._device_record(layer, rec.expert, s)

    def _acquire(self, key: int, **kw) -> int | None:
        """pool.acquire, and a slot it hands out forgets the landed guess it held (`_spec_landed`): another key now."""
        s = self.pool.acquire(key, **kw)
        if s is not None:
            self._spec_landed.pop(s, None)
        return s

    def _host_expert(self, rec: HostRecord, reason: str) -> HostExpert:
        return HostExpert(decode_expert_record(rec.array, self.layout), reason)

    def _fetch_host(self, layer: int, e: int, s: int) -> ExpertWeights:
        """The record's host copy for a CPU fallback after its kernels failed: from the host tier if it is still
        resident there (a probe: no message, so no request nested inside the one in flight), checked against
        recycling; else the bytes of its VRAM slot, read back once every copy has landed (the same bytes)."""
        rec = self.host.probe(layer, e)
        if rec is not None:
            w = decode_expert_record(rec.array, self.layout)
            w = ExpertWeights(np.array(w.gate), np.array(w.up), np.array(w.down))
            if self.host.still_valid(rec):
                return w
        self._reap(wait=True)
        return self.b._record_to_host(DeviceRecord(self.base + s * self.slot_bytes, self.layout))

    # ---- completions ----------------------------------------------------------------------------------------
    def _reap(self, wait: bool = False, only: set[int] | None = None) -> None:
        """Finish copies whose bytes have landed: generation check, slot READY, host lease back, busy time.
        only: the ids of the demand jobs to finish (the others stay pending)."""
        for s, job in list(self._spec_jobs.items()):
            if job.submitted.is_set() and (job.error is not None or job.cancelled or not job.ev_done
                                           or self.drv.event_done(job.ev_done)):
                del self._spec_jobs[s]
                guess = job not in self._ahead   # a layer-ahead copy is not the governor's to judge
                if self._finish_spec(s, job, demanded=False) and guess:
                    self._spec_landed[s] = job.nbytes
        keep = []
        for job, rec, s in self._pending:
            if only is not None and id(job) not in only:
                keep.append((job, rec, s))
                continue
            if wait:
                self.drv.event_sync(job.ev_done)
            elif not self.drv.event_done(job.ev_done):
                keep.append((job, rec, s))
                continue
            if rec is not None and not self.host.still_valid(rec):
                # cannot happen while the lease is held; if it does, the bytes in the slot are suspect
                self.stats["eviction_races"] += 1
                if self.log:
                    self.log.error("eviction_race", key=job.key, slot=s)
                self.pool.invalidate(s)
            else:
                self.pool.loaded(s)
                if not self.retain and self.pool.is_mapped(s):
                    # unmapped now; the slot frees when its readers release it (a deferred reap can find it
                    # evicted by a later step's miss already: unmapped, and freed by `loaded` if unpinned)
                    self.pool.invalidate(s)
            self._account(job, speculative=False)
            if self.slot_job[s] is job:
                self.slot_job[s] = None
            if rec is not None:
                self.host.release(rec)
        self._pending = keep

    def start_timeline(self) -> None:
        """From now on, keep every copy's and compute span's device times (µs after a reference event on the
        compute stream): the per-lane timeline `coli bench` plots. Call finish() before reading `timeline`."""
        self.busy.collect(wait=True)
        ref = self.drv.event_create(timing=True)
        self.drv.event_record(ref, self._compute_stream)
        self._tl_ref, self.timeline = ref, []
        self.busy.ref, self.busy.timeline = ref, self.timeline

    def _account(self, job: CopyJob, speculative: bool) -> None:
        ms = self.drv.elapsed_ms(job.ev_start, job.ev_done)
        if self.timeline is not None and len(self.timeline) < 20000:
            self.timeline.append({"lane": "speculative" if speculative else "demand",
                                  "t0_us": 1e3 * self.drv.elapsed_ms(self._tl_ref, job.ev_start),
                                  "t1_us": 1e3 * self.drv.elapsed_ms(self._tl_ref, job.ev_done), "label": str(job.key)})
        if speculative:
            if job in self._ahead:
                self.stats["ahead_bytes"] += job.nbytes
            self.stats["spec_copies"] += 1
            self.stats["spec_bytes"] += job.nbytes
            self.stats["spec_copy_s"] += ms / 1e3
        else:
            self.stats["copies"] += 1
            self.stats["copy_bytes"] += job.nbytes
            self.stats["demand_copy_s"] += ms / 1e3
            if len(self.delays_us) < 100_000:
                self.delays_us.append(ms * 1e3)
                self.delay_nbytes.append(job.nbytes)
        self._free_events(job)

    def _free_events(self, job: CopyJob) -> None:
        evs = [ev for ev in (job.ev_start, job.ev_gateup, job.ev_done) if ev]
        if job in self._readers:                 # a record handed out still waits on them: parked (see __init__)
            self._parked.setdefault(job, []).extend(evs)
        else:
            for ev in evs:
                self.events.put(ev)
        job.ev_start = job.ev_gateup = job.ev_done = 0

    def _unread(self, job: CopyJob) -> None:
        """A record carrying job's events had its kernels queued: at the last one, parked events go back."""
        n = self._readers.pop(job) - 1
        if n:
            self._readers[job] = n
        else:
            for ev in self._parked.pop(job, ()):
                self.events.put(ev)

    # ---- fallbacks, stats, shutdown -------------------------------------------------------------------------
    def _fallback_note(self, kind: str, detail: str) -> None:
        self.fallbacks[kind] += 1
        if kind not in self._logged and self.log is not None:
            self._logged.add(kind)
            self.log.warning("cpu_fallback", kind=kind, detail=detail, note="logged once per kind; counted in stats")

    def _on_kernel_error(self, err, ids) -> None:
        self._fallback_note("kernel_error", f"{err} (experts {ids})")

    def finish(self) -> None:
        """End of a request: every copy landed and accounted."""
        self._reap(wait=True)

    def snapshot(self) -> dict:
        """Counters for `coli stats`: pool hits/misses/evictions, fallbacks per kind, copies, and the busy
        fractions of the demand lane, the speculative lane and the SMs since the previous snapshot (from CUDA
        event timings), plus their running totals in seconds."""
        self.busy.collect()
        now = time.perf_counter()
        t0, d0, s0, b0 = self._last
        dt = max(now - t0, 1e-9)
        dem, spec, sm = self.stats["demand_copy_s"], self.stats["spec_copy_s"], self.busy.busy_s
        self._last = (now, dem, spec, sm)
        d = dict(self.pool.stats.as_dict())
        d.update({f"fallback_{k}": v for k, v in self.fallbacks.items()})
        d.update(self.stats)
        d["cpu_fallbacks"] = sum(self.fallbacks.values())
        d["vram_slots"] = self.n_slots
        d["vram_resident"] = self.pool.resident
        d["sm_busy_s"] = round(sm, 6)
        d["copy_busy"] = round(min(1.0, (dem - d0) / dt), 4)
        d["spec_busy"] = round(min(1.0, (spec - s0) / dt), 4)
        d["spec_tiles_yielded"] = self.spec.yield_waits     # speculative tiles that waited for an idle demand lane
        if self.governor is not None:
            d["spec_budget_ema_bytes"] = int(self.governor.ema)  # what the idle window has been landing per layer
            d["spec_pauses"] = self.governor.pauses
        d["sm_busy"] = round(min(1.0, (sm - b0) / dt), 4)
        n = d.get("hits", 0) + d.get("misses", 0)
        d["vram_hit_rate"] = round(d.get("hits", 0) / n, 4) if n else 0.0
        return d

    def close(self) -> None:
        self.b.busy = None
        if getattr(self.b, "before_host_wait", None) == self._land_pending:
            self.b.before_host_wait = None
        try:
            self._reap(wait=True)
        except DriverError:
            # the context is gone: no DMA is running any more, so the host leases can go back as they are
            for _job, rec, _s in self._pending:
                if rec is not None:
                    try:
                        self.host.release(rec)
                    except Exception:
                        pass
            self._pending = []
        for job in self._spec_jobs.values():
            job.cancelled = True
        self._ahead.clear()
        self._readers.clear()
        for evs in self._parked.values():       # records never consumed: nothing will wait on these any more
            for ev in evs:
                self.events.put(ev)
        self._parked.clear()
        self.spec.close()
        self.demand.close()
        for addr in self._registered:
            try:
                self.drv.host_unregister(addr)
            except DriverError:
                pass
        self._registered.clear()
        for ev in self._consumed_ev:
            self.drv.event_destroy(ev)
        self._consumed_ev = []
        if self._tl_ref:
            self.drv.event_destroy(self._tl_ref)
            self._tl_ref = 0
