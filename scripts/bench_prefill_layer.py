#!/usr/bin/env python3
"""Where a long prefill's dense layer goes: one GLM-5 decoder layer (coli.bench.dense_layer's random stored weights,
an int8 and an int4 dense core) over S = 512, 2,048, 8,192 prompt rows after an empty cache, every backend op of it
timed apart with CUDA events (needs PyCUDA and a CUDA device).

    python scripts/bench_prefill_layer.py [--S 512,2048,8192] [--fmt int8,int4] [--reps 3] [--json-out FILE]

The layer is GlmMoeDsaModel's loop body (coli.bench.dense_layer.layer_body) without the routed experts (their copies
and grouped GEMMs are `coli bench stream`'s MoE rows): the norms, the projections (q_a | kv_a | the indexer's wk and
weights_proj, q_b | the indexer's wq_b, o_proj), rope, the cache writes, the indexer's scores + top-k, mla_attend's
q_abs / context / o, the router with its top-k and the shared expert -- the kernels `coli bench stream` runs there
(the indexer's scores: "indexer_select: indexer_scores_rows" under COLI_INDEXER_KERNELS=auto, the default;
"indexer_select: indexer_scores" under v1).
Each row is one labelled part: its kernels' GPU time, each launch replayed in its place in the sequence (the
recorded launches issued again behind a spin kernel, an event after every launch: bench_kernels.time_launches).
"eager layer" is the same body run as the runtime runs it (host work, uploads of the attention's mask and the
indexer's download included), events around it; the gap to the kernels' sum is that host and copy time.
Prints a table per (format, S) and, last, one JSON line. Takes ~20-40 s on an H200 (most of it building the random
weights and compiling the kernels once).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
for p in (ROOT, ROOT / "scripts"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

F32 = np.float32
# the weights whose launches are labelled by name (AttentionWeights / LayerWeights fields of a MoE layer)
ATTN_WEIGHTS = ("q_a", "q_b", "kv_a", "o", "idx_wq_b", "idx_wk", "idx_weights")
MLP_WEIGHTS = ("router", "shared_gate", "shared_up", "shared_down")


def dense_layer(model, h, positions, cos, sin, cache):
    """Layer 0 of model on h [S, H] at positions 0..S-1 of an empty cache, without its routed experts: the loop body
    of GlmMoeDsaModel._final_hidden with _mlp's moe() left out (route, then the shared expert alone)."""
    c, b, lw = model.config, model.backend, model.layers[0]
    x = b.rms_norm(h, lw.input_norm, c.rms_norm_eps)                                      # [S, H]
    a, _ = model._attention(0, lw.attn, x, positions, cos, sin, cache, 0, None)
    h, x2 = b.add_rms_norm(h, a, lw.post_norm, c.rms_norm_eps)                            # [S, H] each, one op
    b.route(x2, lw.router, lw.router_bias, c.n_group, c.topk_group, c.num_experts_per_tok, c.norm_topk_prob,
            c.routed_scaling_factor)                                                      # [S, K] ids, weights
    return b.add(h, b.swiglu(x2, lw.shared_gate, lw.shared_up, lw.shared_down))


def weight_names(lw) -> dict[int, str]:
    """Device base address -> name of every stored matrix of the layer (kv_b: both head views share it)."""
    from coli.gpu.cuda_weights import QWeight
    out = {}
    for n in ATTN_WEIGHTS:
        w = getattr(lw.attn, n)
        if isinstance(w, QWeight):
            out[w.ptr] = n
    out[lw.attn.w_kb.w.ptr] = "kv_b"
    for n in MLP_WEIGHTS:
        w = getattr(lw, n)
        if isinstance(w, QWeight):
            out[w.ptr] = n
    return out


def label_launches(launches: list[dict], names: dict[int, str]) -> list[str]:
    """One label per recorded launch: a projection by its weight's name (an x split for the tensor cores by the
    weight of the op's next launch), mla_attend's kv_b launches q_abs (the NN product: gemm_nn / mla_qabs / gemv_t)
    or o (the others) -- a long prefill has one of each per block of rows -- the rest context, everything else
    op: kernel."""
    def weight_of(L):
        return next((names[a] for a in L["args"] if isinstance(a, int) and a in names), None)
    ws = [weight_of(L) for L in launches]
    labels = []
    for j, L in enumerate(launches):
        op, k = L["op"], L["kernel"]
        if op in ("linear", "linear_many", "swiglu", "route") and (ws[j] or k == "pf_split_rows"):
            w = ws[j] or next((ws[i] for i in range(j + 1, len(launches)) if launches[i]["op"] == op and ws[i]),
                              None)
            labels.append(f"{op} {w or '?'}: {k}")
        elif op == "mla_attend":
            part = ("context" if ws[j] != "kv_b" else
                    "q_abs" if k.startswith(("gemm_nn", "mla_qabs", "gemv_t")) else "o")
            labels.append(f"mla_attend {part}: {k}")
        else:
            labels.append(f"{op}: {k}")
    return labels


def bench_one(gb, tm, model, S: int, reps: int, rng) -> dict:
    from bench_kernels import LaunchLog, time_launches
    from coli.model.backend import cos_sin_table
    c, rt = model.config, gb.rt
    positions = np.arange(S)
    cos, sin = cos_sin_table(positions, c.qk_rope_head_dim, c.rope_theta)
    h0 = gb.upload(rng.standard_normal((S, c.hidden_size)).astype(F32))

    def eager():
        cache = model.new_cache(S)
        cache.reserve(S)
        y = dense_layer(model, h0, positions, cos, sin, cache)
        return y, cache

    y, cache = eager()                                  # compiles, sizes scratch
    rt.synchronize()
    cache.release()
    walls = []
    for _ in range(reps):
        a, b = rt.event(), rt.event()
        a.record(rt.stream)
        y, cache = eager()
        b.record(rt.stream)
        b.synchronize()
        walls.append(b.time_since(a))
        cache.release()
    log = LaunchLog(gb)
    try:
        y, cache = eager()
    finally:
        log.remove()
    rt.synchronize()
    finite = bool(np.isfinite(rt.to_host(y)).all())
    times = time_launches(rt, tm, log.launches, reps=reps)
    labels = label_launches(log.launches, weight_names(model.layers[0]))
    parts: dict[str, dict] = {}
    for L, lab, t in zip(log.launches, labels, times):
        p = parts.setdefault(lab, {"us": 0.0, "launches": 0, "grid": list(L["grid"])})
        p["us"] += t
        p["launches"] += 1
    cache.release()
    del log
    total = sum(times)
    return {"S": S, "eager_layer_ms": round(float(np.median(walls)), 3), "kernels_ms": round(total / 1e3, 3),
            "launches": len(times), "finite": finite,
            "parts": {k: {"ms": round(v["us"] / 1e3, 3), "share": round(v["us"] / total, 4),
                          "launches": v["launches"], "grid": v["grid"]}
                      for k, v in sorted(parts.items(), key=lambda kv: -kv[1]["us"])}}


def print_table(fmt: str, r: dict) -> None:
    print(f"\n== dense layer, {fmt} core, S = {r['S']:,} (empty cache): kernels {r['kernels_ms']:.2f} ms, "
          f"eager layer {r['eager_layer_ms']:.2f} ms, {r['launches']} launches, finite={r['finite']}")
    print(f"  {'part: kernel':<58} {'ms':>9} {'share':>7} {'n':>4}  grid")
    for k, v in r["parts"].items():
        print(f"  {k:<58} {v['ms']:9.3f} {100 * v['share']:6.1f}% {v['launches']:4d}  {v['grid']}")
    sys.stdout.flush()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--S", default="512,2048,8192", help="prompt rows, comma-separated")
    ap.add_argument("--fmt", default="int8,int4", help="dense-core formats, comma-separated (int8: coli convert's "
                                                        "default)")
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions (medians)")
    ap.add_argument("--json-out", type=Path)
    a = ap.parse_args()
    try:
        Ss = [int(s) for s in a.S.split(",")]
        if min(Ss) < 2:
            raise ValueError
    except ValueError:
        print(f"bench_prefill_layer: --S {a.S!r}: give prompt lengths >= 2, comma-separated", file=sys.stderr)
        return 2
    fmts = a.fmt.split(",")
    bad = [f for f in fmts if f not in ("int8", "int4", "bf16", "f32")]
    if bad:
        print(f"bench_prefill_layer: --fmt {','.join(bad)}: use int8, int4, bf16 or f32", file=sys.stderr)
        return 2
    from coli.gpu.cubin_build import backend_or_refusal
    gb, refusal = backend_or_refusal("bench_prefill_layer")
    if gb is None:
        print(refusal, file=sys.stderr)
        return 2
    from bench_kernels import Timer
    from coli.bench.dense_layer import RandomDense, dense_config
    from coli.config import PRESETS
    from coli.model.forward import GlmMoeDsaModel
    t0 = time.monotonic()
    tm = Timer(gb.rt, spin=True)
    rng = np.random.default_rng(0)
    cfg = dense_config(PRESETS["glm5"], layers=1)
    res: dict = {"device": gb.rt.name, "prefill_kernels": gb.prefill_kernels, "prefill_int8": gb.prefill_int8,
                 "indexer_kernels": gb.indexer_kernels, "layers": {}}
    for fmt in fmts:
        model = GlmMoeDsaModel(cfg, RandomDense(cfg, fmt), gb)
        out = res["layers"][fmt] = {}
        for S in Ss:
            r = out[str(S)] = bench_one(gb, tm, model, S, a.reps, rng)
            print_table(fmt, r)
        del model
    res["wall_s"] = round(time.monotonic() - t0, 1)
    print("\nbench_prefill_layer: " + json.dumps(res), flush=True)
    if a.json_out:
        a.json_out.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
