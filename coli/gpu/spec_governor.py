"""How many speculative copies to put on the speculative lane for a coming layer (issue 14 §4: speculation never
costs). Pure: VramExperts asks `budget()` at each prefetch and reports `demanded(used_bytes)` at the demand step of
a layer it speculated for.

Why a budget at all: the speculative lane only copies while the demand lane is idle, i.e. in the window between a
layer's last demand copy and the next layer's first (its tail, the next dense part, the router's read-back: a few
hundred microseconds, ~15 MB at the link's pace). Guesses beyond what that window lands are never copied, but each
still costs the compute thread a speculative slot (acquire, often an eviction: the pool's ranking in numpy) at the
prefetch and its cleanup (invalidate, revoke the hit, two releases) at the demand, on the path from the router to the
first demand copy: measured on the H200, 8 guesses a layer of which 1 landed part of its record cost ~200 us a layer
more than they saved (docs/perf-notes.md). So the budget follows what the window delivered:

    used     the bytes of speculative copies that a demand then used: a complete copy's record, or the prefix a
             demand took over from a copy cut short (VramExperts' handoff); a guess never demanded uses nothing
    EMA      of `used` per speculated step, weight ALPHA for the newest
    budget   round(EMA / record bytes) + 1 copies: the records the window fills (a part from half a record on),
             plus one more -- so a window that lands every copy it is given gets one more to try
    pause    after IDLE_STEPS speculated steps in a row that used nothing (wrong guesses, or a window too short for
             one tile), no speculative copy for PAUSE_PREFETCHES prefetches, then one copy again as a probe
"""

from __future__ import annotations

ALPHA = 0.25
IDLE_STEPS = 16
PAUSE_PREFETCHES = 64


class SpecGovernor:
    def __init__(self, record_bytes: int, *, alpha: float = ALPHA, idle_steps: int = IDLE_STEPS,
                 pause_prefetches: int = PAUSE_PREFETCHES, max_budget: int | None = None):
        if record_bytes <= 0:
            raise ValueError(f"record_bytes must be > 0, got {record_bytes}")
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.record_bytes, self.alpha = int(record_bytes), float(alpha)
        self.idle_steps, self.pause_prefetches = int(idle_steps), int(pause_prefetches)
        self.max_budget = max_budget
        self.ema = 0.0              # used bytes per speculated step
        self.idle = 0               # speculated steps in a row that used nothing
        self.paused = 0             # prefetches left without speculation
        self.pauses = 0             # times it paused (a counter for coli stats)

    def budget(self) -> int:
        """Speculative copies for the layer being prefetched now (0 while paused)."""
        if self.paused > 0:
            self.paused -= 1
            return 0
        n = int(self.ema / self.record_bytes + 0.5) + 1
        return n if self.max_budget is None else min(n, self.max_budget)

    def demanded(self, used_bytes: int) -> None:
        """A layer that had speculative copies was demanded; `used_bytes` of them were used."""
        used = max(0, int(used_bytes))
        self.ema += self.alpha * (used - self.ema)
        if used > 0:
            self.idle = 0
            return
        self.idle += 1
        if self.idle >= self.idle_steps:
            self.idle = 0
            self.paused = self.pause_prefetches
            self.pauses += 1
