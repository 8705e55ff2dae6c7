"""Fault injection for tests and drills: `COLI_INJECT=kind:rate,kind:rate` (rates in [0, 1]),
seeded by `COLI_INJECT_SEED`. Each stage asks `faults.hit(kind)` at the point where that fault would
happen for real; an unknown kind is an error at start-up so a typo cannot silently test nothing."""

from __future__ import annotations

import os
import random

KNOWN = {
    "read_error",    # reader: a record read fails (EIO)
    "checksum",      # reader: a record fails its checksum
    "copy_error",    # GPU: an H2D copy fails
    "kernel_error",  # GPU: a kernel launch fails
    "oversize",      # GPU: a record is treated as larger than a VRAM slot
    "gpu_lost",      # GPU: the context is lost (a fatal driver error): the executor demotes the run to the CPU
    "start_crash_reader", "start_crash_ramtier", "start_crash_executor",  # a stage dies during start-up
    "request_error", # executor: a request raises an unexpected exception after its first token
}


class Faults:
    def __init__(self, rates: dict[str, float], seed: int = 0):
        self.rates = rates
        self.rng = random.Random(seed)
        self.injected: dict[str, int] = {k: 0 for k in rates}

    @classmethod
    def parse(cls, spec: str, seed: int = 0) -> "Faults":
        rates: dict[str, float] = {}
        for part in filter(None, (p.strip() for p in spec.split(","))):
            kind, _, rate = part.partition(":")
            if kind not in KNOWN:
                raise ValueError(f"COLI_INJECT: unknown fault {kind!r} (known: {', '.join(sorted(KNOWN))})")
            try:
                r = float(rate) if rate else 1.0
            except ValueError:
                raise ValueError(f"COLI_INJECT: rate of {kind!r} must be a number, got {rate!r}") from None
            if not 0.0 <= r <= 1.0:
                raise ValueError(f"COLI_INJECT: rate of {kind!r} must be in [0, 1], got {r}")
            rates[kind] = r
        return cls(rates, seed)

    @classmethod
    def from_env(cls) -> "Faults":
        return cls.parse(os.environ.get("COLI_INJECT", ""), int(os.environ.get("COLI_INJECT_SEED", "0")))

    def hit(self, kind: str) -> bool:
        r = self.rates.get(kind, 0.0)
        if r > 0.0 and self.rng.random() < r:
            self.injected[kind] += 1
            return True
        return False
