"""Copy lanes: H2D copies of expert records from pinned host memory into VRAM slots, in tiles, each lane
its own CUDA stream driven by its own worker thread.

    demand lane       copies what the current layer needs, whole records back to back, one copy per half with
                      two events per record: after the gate/up part (the fused gate/up kernel may start)
                      and after the down part.
    speculative lane  copies predicted records (the pilot's guesses) in tiles, at most IN_FLIGHT = 2 on the bus
                      at once, and only while the demand lane is idle (nothing queued, its stream drained): a
                      demand copy that arrives finds at most two speculative tiles on the bus ahead of it, so
                      speculation delays a demand by at most two tile transfers.

The main (compute) thread submits `CopyJob`s and waits on the host only until a job is *submitted* (its
events recorded: a few microseconds), never for the bytes; the compute stream waits on the job's events
on the device. The demand lane is `inline`: `submit` issues the job's copies on the caller's thread at once
(six driver calls) instead of handing it to a worker -- a thread hop (notify, wake, GIL, wake back) cost
~50-100 us before the first copy of every MoE layer, on the critical path from the router to the bus
(docs/perf-notes.md, "MoE-layer overhead"). The speculative lane keeps its worker: its trickle waits. A slot being overwritten may still be read by kernels queued earlier: a job carries the
slot's last "consumed" event, and the lane's stream waits on it before the first tile.

Timing: every job records start/end events on its lane; `LaneClock` turns finished jobs into busy seconds
(the `coli stats` copy-lane busy fractions).
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from coli.gpu.driver import Driver, DriverError, EventPool, handle_of

DEFAULT_TILE_BYTES = 1 << 20     # --stream-tile-kb 1024 (docs/gpu.md: chosen from the tile-size sweep)
IN_FLIGHT = 2                    # speculative tiles on the bus at once: the delay bound of a demand copy, in tiles


@dataclass(eq=False)
class CopyJob:
    """Copy `nbytes` from host `src` to device `dst` in tiles; bytes [0, split) are gate/up, [split, n) down."""

    key: int
    dst: int
    src: int
    nbytes: int
    split: int
    tile: int
    wait_event: Any = None          # the slot's previous readers (event); the lane waits for it on the device
    inject_error: bool = False      # fault injection: the copy fails as if the driver had refused it
    ev_gateup: int = 0              # recorded after the last gate/up tile
    ev_done: int = 0                # recorded after the last tile
    ev_start: int = 0
    submitted: threading.Event = field(default_factory=threading.Event)
    error: Exception | None = None
    cancelled: bool = False         # speculative jobs only: skip the rest (a demand took the key over)
    started: bool = False           # the worker took it off the queue (set under the lane's lock)
    tiles_done: int = 0
    bytes_done: int = 0             # speculative: bytes [0, bytes_done) have landed (tiles go in order, each
                                    # synchronised before the next): what a demand that takes over need not copy

    @property
    def n_tiles(self) -> int:
        """Tiles of the speculative trickle (the unit it yields the bus in)."""
        return max(1, -(-self.split // self.tile) + -(-(self.nbytes - self.split) // self.tile))


class CopyLane:
    """One stream + one worker thread. `speculative=True` gives the one-tile-at-a-time, demand-yields policy;
    `demand` is then the lane it yields to. `inline=True` (demand lanes only): no worker, `submit` issues the
    whole job on the caller's thread (the caller must have the context current)."""

    def __init__(self, drv: Driver, ctx: int, events: EventPool, name: str, *, speculative: bool = False,
                 demand: "CopyLane | None" = None, inline: bool = False):
        if inline and speculative:
            raise ValueError("a speculative lane trickles from its own worker thread: it cannot be inline")
        self.drv, self.ctx, self.events, self.name = drv, ctx, events, name
        self.speculative, self.inline = speculative, bool(inline)
        self.demand = demand
        self.stream = drv.stream_create()
        self._q: deque[CopyJob] = deque()
        self._cv = threading.Condition()
        self._stop = False
        self.yield_waits = 0           # speculative tiles that waited for the demand lane to go idle
        self.error: Exception | None = None   # what stopped the worker, if anything did
        self._thread = None
        if not self.inline:
            self._thread = threading.Thread(target=self._loop, name=f"coli-{name}-lane", daemon=True)
            self._thread.start()

    # ---- main thread ----------------------------------------------------------------------------------
    def submit(self, job: CopyJob) -> CopyJob:
        job.ev_start = self.events.get()
        job.ev_gateup = self.events.get()
        job.ev_done = self.events.get()
        if self.inline:
            self._issue(job)
            return job
        with self._cv:
            self._q.append(job)
            self._cv.notify()
        return job

    def wait_submitted(self, job: CopyJob) -> None:
        """Wait until the worker has issued (or skipped) the job; a dead worker is an error, not a hang."""
        if self.inline:
            return                     # issued by submit itself
        while not job.submitted.wait(0.5):
            if not self._thread.is_alive():
                raise DriverError(f"the {self.name} copy lane's worker thread has died "
                                  f"({self.error or 'no error recorded'})", 999)

    def cancel(self, job: CopyJob) -> bool:
        """Stop a job of this lane: True when it had not started, so nothing of it was or will be issued and it is
        over now (no need to wait_submitted, whose handshake with the worker costs a thread hop per job); False
        when the worker has it -- it stops after the tile in flight, wait_submitted for that."""
        with self._cv:
            job.cancelled = True
            if job.started or job.submitted.is_set():
                return False
            try:
                self._q.remove(job)
            except ValueError:
                pass
            job.submitted.set()
            return True

    def busy(self) -> bool:
        """Work queued or in flight on this lane (a host-side view plus a stream query)."""
        with self._cv:
            if self._q:
                return True
        return not self.drv.stream_idle(self.stream)

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout=5)
        try:
            self.drv.stream_sync(self.stream)
            self.drv.stream_destroy(self.stream)
        except DriverError:
            pass

    # ---- worker thread ----------------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            self.drv.set_context(self.ctx)   # the primary context, current in this thread too
            self._serve()
        except BaseException as e:           # noqa: BLE001 -- kept for wait_submitted's error message
            self.error = e
            raise

    def _serve(self) -> None:
        while True:
            with self._cv:
                while not self._q and not self._stop:
                    self._cv.wait()
                if self._stop:
                    return
                job = self._q.popleft()
                job.started = True
            self._issue(job)

    def _issue(self, job: CopyJob) -> None:
        if job.cancelled:
            job.submitted.set()
            return
        try:
            if job.inject_error:
                raise DriverError(f"injected copy_error (H2D copy of {job.nbytes} bytes to 0x{job.dst:x})", 1)
            if self.speculative:
                self._run_trickle(job)
            else:
                self._run_whole(job)
        except Exception as e:     # noqa: BLE001 -- reported to the owner of the job, never lost
            job.error = e
        finally:
            job.submitted.set()

    def _begin(self, job: CopyJob) -> None:
        if job.wait_event is not None:
            self.drv.stream_wait(self.stream, handle_of(job.wait_event))
        self.drv.event_record(job.ev_start, self.stream)

    def _tile(self, job: CopyJob, off: int, n: int) -> None:
        self.drv.copy_htod_async(job.dst + off, job.src + off, n, self.stream)
        job.tiles_done += 1

    def _tiles(self, job: CopyJob, lo: int, hi: int):
        off = lo
        while off < hi:
            n = min(job.tile, hi - off)
            yield off, n
            off += n

    def _run_whole(self, job: CopyJob) -> None:
        """Demand: the gate/up bytes in one copy, an event, the down bytes in one copy, an event. One call per
        half, not per tile: on the H200, 1 MiB tiles issued back to back reach 48.6 GB/s against 55.0 for a
        whole buffer (docs/performance.md); tiles only matter where a copy must yield the bus (the speculative
        lane)."""
        self._begin(job)
        for lo, hi, mark in ((0, job.split, job.ev_gateup), (job.split, job.nbytes, job.ev_done)):
            if hi > lo:
                self._tile(job, lo, hi - lo)
            self.drv.event_record(mark, self.stream)

    def _run_trickle(self, job: CopyJob) -> None:
        """Speculative: tiles only while the demand lane is idle, at most IN_FLIGHT of them on the bus at once (the
        next is issued before the one before it is waited for, so the bus does not idle for a synchronisation
        between tiles; a demand copy arriving finds at most IN_FLIGHT speculative tiles ahead of it). The half
        events are recorded in order behind their tiles; the job's `submitted` is set only once every tile issued
        has landed (a demand that wants this key meanwhile cancels the rest and takes over the landed prefix,
        `bytes_done`, see VramExperts)."""
        self._begin(job)
        free = [self.events.get() for _ in range(IN_FLIGHT)]
        flight: deque[tuple[int, int]] = deque()        # (tile event, end offset of that tile), oldest first

        def land_oldest():
            ev, end = flight.popleft()
            self.drv.event_sync(ev)
            job.bytes_done = end                         # tiles land in order: [0, end) is there
            free.append(ev)

        try:
            for lo, hi, mark in ((0, job.split, job.ev_gateup), (job.split, job.nbytes, job.ev_done)):
                for off, n in self._tiles(job, lo, hi):
                    if job.cancelled:
                        break
                    waited = False
                    while self.demand is not None and self.demand.busy() and not job.cancelled:
                        # wait for the demand lane to drain inside the driver, not in a Python sleep loop: the
                        # GIL stays free for the compute thread (a 20 us poll took it ~50 000 times a second,
                        # and the compute thread's router -> first copy path is pure Python)
                        waited = True
                        self.drv.stream_sync(self.demand.stream)
                        if self._stop:
                            return
                    self.yield_waits += waited
                    if job.cancelled:
                        break
                    if not free:
                        land_oldest()
                    self._tile(job, off, n)
                    ev = free.pop()
                    self.drv.event_record(ev, self.stream)
                    flight.append((ev, off + n))
                self.drv.event_record(mark, self.stream)
            while flight:
                land_oldest()
        finally:
            for ev, _end in flight:
                free.append(ev)
            for ev in free:
                self.events.put(ev)
