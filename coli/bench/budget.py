"""The consumer-budget rows of `coli bench stream` (issue 14 §3): several --vram-gb budgets in one run, and next to
each measured row what the project's own models predict for the same case -- `coli sim`'s hit rates for the same
trace tokens, pool size and policy, and `coli plan`'s tokens/s bound for the same machine figures. Pure (no GPU):
tested on the CPU (tests/bench/test_budget.py).

    budgets = parse_budgets("16,24,32")                       # -> [16.0, 24.0, 32.0]
    hits = predict_hits(trace_idx, tokens=18, warmup=2, vram_slots=21, ram_slots=40)
    bound = plan_bound(16, 64, dense="int8", group=64, pcie_gbps=55.0, disk_gbps=1.9)
"""

from __future__ import annotations

import math

import numpy as np

from coli.errors import ColiError


def parse_budgets(text: str | float | int) -> list[float]:
    """--vram-gb: one budget or a comma-separated list ("16,24,32"), each > 0, in GB; in order, duplicates dropped."""
    if isinstance(text, (int, float)):
        parts = [str(text)]
    else:
        parts = [p.strip() for p in str(text).split(",")]
    out: list[float] = []
    for p in parts:
        try:
            v = float(p)
        except ValueError:
            raise ColiError(f"--vram-gb {text!r}: {p!r} is not a number (give GB, e.g. 16 or 16,24,32)") from None
        if not math.isfinite(v) or v <= 0:
            raise ColiError(f"--vram-gb {text!r}: each budget must be > 0 GB (got {p!r})")
        if v not in out:
            out.append(v)
    if not out:
        raise ColiError("--vram-gb: give at least one budget in GB (e.g. 16 or 16,24,32)")
    return out


def budget_name(base: str, vram_gb: float, several: bool) -> str:
    """Row name of a budget scenario: "budget" / "budget-nospec", with the budget appended when a run has several."""
    return f"{base}-{vram_gb:g}gb" if several else base


def replayed_tokens(idx: np.ndarray, tokens: int) -> np.ndarray:
    """The trace tokens a decode of `tokens` one-token steps replays from token 0 (TraceRouting wraps around)."""
    idx = np.asarray(idx)
    return idx[np.arange(tokens) % idx.shape[0]]


def predict_hits(idx: np.ndarray, *, tokens: int, warmup: int, vram_slots: int, ram_slots: int,
                 policy: str | None = None, ram_policy: str = "lru") -> dict:
    """`coli sim` for a budget row: the VRAM pool as the engine runs it (one pool of vram_slots records shared by
    every layer, `policy` = the pool's default), over the trace tokens the decode replays, hits counted after the
    warm-up tokens as the bench counts them; the RAM tier (ram_slots records, LRU) sees the VRAM misses. Without
    speculation: the speculative lane's prefetches are what the sim leaves out."""
    from coli.sim import DEFAULT_POLICY, miss_stream, simulate
    pol = policy or DEFAULT_POLICY
    seq = replayed_tokens(idx, tokens)
    v = simulate(seq, pol, shared=True, capacity=int(vram_slots), warmup=warmup, record_hits=True)
    below = miss_stream(seq, v.hit_mask)
    r = simulate(below, ram_policy, shared=True, capacity=int(ram_slots), warmup=warmup)
    return {"policy": pol, "ram_policy": ram_policy, "vram": v.hit_rate, "ram": r.hit_rate,
            "vram_requests": v.requests, "ram_requests": r.requests}


def plan_bound(vram_gb: float, ram_gb: float, *, dense: str, group: int, pcie_gbps: float | None,
               disk_gbps: float | None, experts: str = "int4") -> dict:
    """`coli plan` for the full GLM-5 at this budget with the run's measured link and disk rates: its expected
    tokens/s (a transfer bound: uniform routing, compute not counted), VRAM slots and hit rates; None where a rate
    was not measured."""
    from coli.config import PRESETS
    from coli.plan import Hardware, make_plan, sizes_from_config
    if not pcie_gbps or not disk_gbps:
        return {"tokens_per_s": None, "why": "no measured H2D or NVMe rate in this run"}
    m = sizes_from_config(PRESETS["glm5"], "glm5", experts=experts, dense=dense, group=group)
    p = make_plan(m, Hardware(vram_gb=vram_gb, ram_gb=ram_gb, disk_gbps=disk_gbps, pcie_gbps=pcie_gbps))
    return {"tokens_per_s": p.tokens_per_s["expected"], "bound_by": p.tokens_per_s["expected_bound_by"],
            "vram_slots": p.slots["vram"], "ram_slots": p.slots["ram"], "dense_bytes": m.dense_bytes,
            "hit_rate_vram": p.per_token["hit_rate_vram"], "hit_rate_ram_or_vram": p.per_token["hit_rate_ram_or_vram"],
            "ok": p.ok, "problems": p.problems}
