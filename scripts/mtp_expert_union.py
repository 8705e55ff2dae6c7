#!/usr/bin/env python3
"""How many routed experts a verify step of k+1 positions needs, and what that means for MTP when experts stream.

    .venv/bin/python scripts/mtp_expert_union.py [--trace glm52|uniform] [--tokens 2000] [--json OUT]

A plain decode step reads 8 experts per MoE layer; a verify step of k+1 adjacent positions reads the union of their
experts. Measured here on a routing trace (default: `coli.traces_synth.glm52`, calibrated to GLM-5's published
routing statistics — a synthetic stand-in, not a recorded trace), per layer and averaged. Where decode is bound by
streaming those experts (cold-ram: PCIe), a round's time is about its bytes: the verify step's union over 75 layers
plus the MTP layer's own 8 experts for each of its k draft steps (its attention/dense part and the main dense core
stay resident and are left out). So the speed-up at acceptance a is

    (1 - a^(k+1)) / (1 - a) * 75 * 8 / (75 * U(k+1) + k * 8)

and the break-even acceptance is where it is 1. Warm (every expert resident, reads bound by HBM and the kernels), the
same union is read from device memory: the ratio is the same bytes ratio if the MoE kernels are bandwidth-bound.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np


def union_sizes(idx: np.ndarray, spans=(1, 2, 3, 4)) -> dict[int, float]:
    """idx [T, L, K] -> {s: mean over windows of s consecutive tokens and layers of |union of their experts|}."""
    T, L, K = idx.shape
    out = {}
    for s in spans:
        sizes = []
        for t in range(0, T - s + 1):
            win = idx[t:t + s]                                     # [s, L, K]
            for layer in range(L):
                sizes.append(len(np.unique(win[:, layer, :])))
        out[s] = float(np.mean(sizes))
    return out


def speedup(a: float, k: int, u: dict[int, float], layers: int, top_k: int) -> float:
    tokens = (1 - a ** (k + 1)) / (1 - a)
    return tokens * layers * top_k / (layers * u[k + 1] + k * top_k)


def break_even(k: int, u: dict[int, float], layers: int, top_k: int) -> float | None:
    if speedup(0.999999, k, u, layers, top_k) < 1:
        return None
    lo, hi = 0.0, 0.999999
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if speedup(mid, k, u, layers, top_k) < 1 else (lo, mid)
    return hi


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default="glm52", choices=("glm52", "uniform"))
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--layers", type=int, default=75)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    from coli.traces_synth import generate
    idx, _ = generate(a.trace, a.tokens, a.layers, 256, 8, a.seed)
    u = union_sizes(np.asarray(idx))
    res = {"trace": a.trace, "tokens": a.tokens, "layers": a.layers, "union_experts_per_layer": u, "k": {}}
    for k in (1, 2, 3):
        res["k"][k] = {"verify_bytes_over_plain": round((a.layers * u[k + 1] + k * 8) / (a.layers * 8), 3),
                       "speedup_at_acceptance": {str(x): round(speedup(x, k, u, a.layers, 8), 3) for x in (0.6, 0.8, 0.9)},
                       "break_even_acceptance": (lambda b: None if b is None else round(b, 3))(break_even(k, u, a.layers, 8))}
    print(json.dumps(res, indent=1))
    if a.json:
        a.json.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
