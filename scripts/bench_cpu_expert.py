#!/usr/bin/env python3
"""Check `coli plan`'s CPU-path compute figure against the real numpy MoE path, GLM-5-shaped.

    .venv/bin/python scripts/bench_cpu_expert.py [--format int4] [--group 64] [--experts 8]

Prediction: `coli.probe.cpu_expert_speed` (one matrix of the layout, constant bytes) x experts.
Outcome: one token through `NumpyBackend.moe` over `--experts` real quantised GLM-5 expert records (random
weights quantised by the converter's own code), each decoded from its record bytes as the executor decodes a
RAM-tier slot (`decode_expert_record`). Prints both and their ratio; docs/perf-notes.md keeps the results."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

H, IM = 6144, 2048  # GLM-5 hidden size and expert width


def main(argv=None) -> int:
    from coli.container.format import RecordLayout
    from coli.container.quant import encode_matrix, quantize
    from coli.container.reader import decode_expert_record
    from coli.model.numpy_backend import NumpyBackend
    from coli.probe import cpu_expert_speed

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--format", default="int4")
    ap.add_argument("--group", type=int, default=64)
    ap.add_argument("--experts", type=int, default=8, help="routed experts of the token (GLM-5: 8 per MoE layer)")
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args(argv)

    lay = RecordLayout.make(H, IM, a.format, a.group, 512)
    rng = np.random.default_rng(0)
    record = np.zeros(lay.nbytes, np.uint8)
    for m in lay.matrices:                                   # one real record, copied for every expert
        w = (rng.standard_normal((m.rows, m.cols), np.float32) * 0.02).astype(np.float32)
        data, meta = quantize(w, a.format, a.group)
        record[m.offset:m.end] = encode_matrix(m, data, meta)
    records = [record.copy() for _ in range(a.experts)]

    pred = cpu_expert_speed(lay.gate.rows, lay.gate.cols, a.format, a.group, 512, repeats=a.repeats)
    be = NumpyBackend()
    x = rng.standard_normal((1, H), np.float32)                                  # [1, H]: one token
    idx = np.arange(a.experts, dtype=np.int64)[None, :]                          # [1, K]
    wts = np.full((1, a.experts), 1.0 / a.experts, np.float32)                   # [1, K]
    best = float("inf")
    for _ in range(a.repeats):
        t0 = time.perf_counter()
        be.moe(x, idx, wts, ((e, decode_expert_record(records[e], lay)) for e in range(a.experts)))
        best = min(best, time.perf_counter() - t0)
    print(f"{a.format}{' g' + str(a.group) if a.format in ('int4', 'int2') else ''}, {a.experts} GLM-5 experts, one token: "
          f"predicted {a.experts * pred.expert_s:.2f} s ({pred.expert_s * 1e3:.0f} ms per expert; {pred.note}), "
          f"measured {best:.2f} s through NumpyBackend.moe (best of {a.repeats}); measured / predicted = "
          f"{best / (a.experts * pred.expert_s):.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
