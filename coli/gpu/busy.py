"""How busy the compute stream (the SMs) is, from CUDA events on it.

The backend marks points on the compute stream: `start` (a forward begins: embed), `route` (a router's
choices are about to be read back: the host waits here), `moe_start` (a MoE batch's copy waits are behind
it, its kernels follow), `moe_end` (its kernels are queued before this), `end` (logits/argmax read back).
Spans that hold kernels and no copy wait -- start/moe_end -> route/end, moe_start -> moe_end -- are busy
time; the rest (host round trips, waiting for copies) is idle. The spans include gaps where the host did
not launch fast enough, so the figure is an upper bound of the SMs' busy time (docs/gpu.md)."""

from __future__ import annotations

from collections import deque

from coli.gpu.driver import Driver, EventPool

OPEN = {"start", "moe_start", "moe_end"}
CLOSE = {"route", "moe_end", "end"}


class BusyClock:
    def __init__(self, drv: Driver, stream: int):
        self.drv, self.stream = drv, stream
        self.events = EventPool(drv)
        self.marks: deque[tuple[str, int]] = deque()
        self.busy_s = 0.0
        self._open: int | None = None
        self.ref: int | None = None              # with `timeline`: spans as (t0_us, t1_us) after this event
        self.timeline: list[dict] | None = None

    def mark(self, kind: str) -> None:
        ev = self.events.get()
        self.drv.event_record(ev, self.stream)
        self.marks.append((kind, ev))
        if len(self.marks) > 4096:
            self.collect(wait=True)

    def collect(self, wait: bool = False) -> float:
        """Add the finished spans to busy_s (in order; stops at the first mark not reached yet)."""
        while self.marks:
            kind, ev = self.marks[0]
            if wait:
                self.drv.event_sync(ev)
            elif not self.drv.event_done(ev):
                break
            self.marks.popleft()
            if kind in CLOSE and self._open is not None:
                self.busy_s += self.drv.elapsed_ms(self._open, ev) / 1e3
                if self.timeline is not None and self.ref is not None and len(self.timeline) < 20000:
                    self.timeline.append({"lane": "compute", "t0_us": 1e3 * self.drv.elapsed_ms(self.ref, self._open),
                                          "t1_us": 1e3 * self.drv.elapsed_ms(self.ref, ev), "label": kind})
            if self._open is not None:
                self.events.put(self._open)
                self._open = None
            if kind in OPEN:
                self._open = ev
            else:
                self.events.put(ev)
        return self.busy_s
