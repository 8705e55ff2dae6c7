#!/usr/bin/env python3
"""Quantisation fidelity of the container formats against fp32, on tiny random glm_moe_dsa oracles.

    .venv/bin/python scripts/quant_fidelity.py [--oracles 4] [--write docs/quantization.md] [--workdir DIR]

For each oracle (scripts/make_oracle.py `build_oracle`, transformers-built fp32 models: vocab 512, hidden 128,
4 layers = 1 dense + 3 MoE, 16 experts top-4, expert width 64, 32 indexer heads, index_topk 8), the checkpoint
is converted once with `--experts f32 --dense f32` (the reference, bit-exact to the checkpoint) and once per
format combination below. Each container runs the same numpy forward (coli's CPU path) with teacher forcing
over a fixed token set: the oracle's prompt followed by its own greedy continuation (52 tokens), and 64 uniformly
random tokens (seeded by the oracle seed). At every position we compare the next-token distribution with the
reference: top-1 agreement (same argmax) and KL(p_ref || p_quant) in nats. The table reports the mean over all
positions of all oracles, and the worst oracle's top-1.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

ORACLES = [dict(seed=1234), dict(seed=1), dict(seed=2), dict(seed=3, indexer_pattern="FFSS")]

# (experts, dense, group) ; group applies to int4/int2 (experts and dense alike)
COMBOS = [
    ("int8", "int8", 64), ("int8", "bf16", 64),
    ("int4", "int8", 32), ("int4", "bf16", 32),
    ("int4", "int8", 64), ("int4", "bf16", 64),
    ("int4", "int8", 128), ("int4", "bf16", 128),
    ("int2", "int8", 64), ("int2", "bf16", 64),
    ("int2", "int8", 32), ("int2", "bf16", 32),
    # context rows: lossless experts with a quantised core, and all-bf16
    ("f32", "int8", 64), ("bf16", "bf16", 64),
    # the smallest core: what a 16 GB GPU needs for GLM-5 (coli plan)
    ("int4", "int4", 64),
]


def _label(fmt: str, group: int) -> str:
    return f"{fmt} g{group}" if fmt in ("int4", "int2") else fmt


def _logits(model_dir: Path, seqs: list[list[int]]) -> np.ndarray:
    from coli.loader import load_model
    model, _ = load_model(model_dir)
    out = []
    for ids in seqs:
        cache = model.new_cache(len(ids) + 8)
        out.append(model.forward(ids, cache, all_logits=True))
    return np.concatenate(out).astype(np.float64)          # [positions, V]


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def compare(ref: np.ndarray, got: np.ndarray) -> tuple[float, float]:
    lp, lq = _log_softmax(ref), _log_softmax(got)
    kl = (np.exp(lp) * (lp - lq)).sum(-1)
    top1 = (ref.argmax(-1) == got.argmax(-1)).mean()
    return float(top1), float(kl.mean())


def run(n_oracles: int, work: Path, log=print) -> dict:
    from make_oracle import build_oracle
    from coli.container.writer import ConvertOptions, convert

    results: dict[str, dict] = {}
    margins: list[float] = []
    spreads: list[float] = []
    oracles = ORACLES[:n_oracles]
    for spec in oracles:
        name = f"seed {spec['seed']}" + (f" {spec['indexer_pattern']}" if "indexer_pattern" in spec else "")
        t0 = time.perf_counter()
        od = work / f"oracle-{spec['seed']}"
        info = build_oracle(od, check_safety=False, force=True, **spec)
        rng = np.random.default_rng(spec["seed"])
        seqs = [info["prompt_ids"] + info["greedy_tokens"], rng.integers(2, 512, 64).tolist()]
        ref_dir = work / f"ref-{spec['seed']}"
        convert(od, ref_dir, ConvertOptions(experts="f32", dense="f32"), threads=1)
        ref = _logits(ref_dir, seqs)
        top2 = np.sort(ref, -1)[:, -2:]
        margins.extend((top2[:, 1] - top2[:, 0]).tolist())
        spreads.extend(ref.std(-1).tolist())
        for experts, dense, group in COMBOS:
            key = f"{_label(experts, group)} | {_label(dense, group)}"
            d = work / f"c-{spec['seed']}-{experts}-{dense}-{group}"
            convert(od, d, ConvertOptions(experts=experts, dense=dense, group=group), threads=1)
            top1, kl = compare(ref, _logits(d, seqs))
            r = results.setdefault(key, {"experts": _label(experts, group), "dense": _label(dense, group),
                                         "per_oracle": {}})
            r["per_oracle"][name] = {"top1": top1, "kl": kl, "positions": int(ref.shape[0])}
            shutil.rmtree(d)
        log(f"{name}: {len(COMBOS)} combinations in {time.perf_counter() - t0:.1f} s")
    for r in results.values():
        po = r["per_oracle"].values()
        n = sum(p["positions"] for p in po)
        r["top1"] = sum(p["top1"] * p["positions"] for p in po) / n
        r["kl"] = sum(p["kl"] * p["positions"] for p in po) / n
        r["worst_top1"] = min(p["top1"] for p in po)
    return {"oracles": [dict(o) for o in oracles], "positions_per_oracle": 52 + 64, "results": results,
            "fp32_margin_median": float(np.median(margins)), "fp32_logit_std_median": float(np.median(spreads))}


def bits_per_weight(fmt: str, group: int) -> float:
    return {"int4": 4 + 16 / group, "int2": 2 + 32 / group, "int8": 8.0, "bf16": 16.0, "f32": 32.0}[fmt]


def markdown(res: dict, seconds: float) -> str:
    from coli.container.format import RecordLayout
    lines = [
        "# Quantisation fidelity",
        "",
        "Produced by `scripts/quant_fidelity.py` (rerun it to refresh this page). Teacher forcing on a fixed token set,",
        "each quantised container against the fp32 container of the same checkpoint, both through coli's numpy forward.",
        "",
        "Oracles: " + ", ".join(f"seed {o['seed']}" + (f" (indexer pattern {o['indexer_pattern']})" if "indexer_pattern" in o else "")
                                for o in res["oracles"]) + ":",
        "tiny random `glm_moe_dsa` models built with transformers by `scripts/make_oracle.py` (vocab 512, hidden 128,",
        "1 dense + 3 MoE layers, 16 routed experts top-4, expert width 64, 32 indexer heads, index_topk 8, fp32; norms,",
        "k_norm bias, router and correction bias randomised). Token set per oracle: its 20-token prompt + its 32 greedy",
        f"tokens, and 64 random tokens: {res['positions_per_oracle']} positions per oracle.",
        "",
        "* **top-1**: share of positions whose argmax equals the fp32 argmax (mean over all positions of all oracles;",
        "  *worst* = the lowest oracle).",
        "* **KL**: mean KL(p_fp32 ‖ p_quant) per position, nats.",
        "* **GLM-5 expert**: bytes of one routed expert record at that format (H 6144, Im 2048, 512 KiB tiles).",
        "",
        "| experts | dense core | top-1 | worst top-1 | mean KL (nats) | GLM-5 expert |",
        "|---|---|---|---|---|---|",
    ]
    for r in res["results"].values():
        fmt, _, g = r["experts"].partition(" g")
        rec = RecordLayout.make(6144, 2048, fmt, int(g or 64), 512).nbytes
        lines.append(f"| {r['experts']} | {r['dense']} | {100 * r['top1']:.1f} % | {100 * r['worst_top1']:.1f} % | "
                     f"{r['kl']:.2e} | {rec / 1e6:.2f} MB |")
    R = res["results"]

    def kl(e, d):
        return R[f"{e} | {d}"]["kl"]

    lines += [
        "",
        "## Reading it",
        "",
        f"* With a bf16 dense core, routed experts cost KL {kl('int8', 'bf16'):.1e} at int8, "
        f"{kl('int4 g32', 'bf16'):.1e} / {kl('int4 g64', 'bf16'):.1e} / {kl('int4 g128', 'bf16'):.1e} at int4 g32 / g64 / g128 "
        f"and {kl('int2 g64', 'bf16'):.1e} at int2 g64 (bf16 everywhere: {kl('bf16', 'bf16'):.1e}). "
        "int2 is an order of magnitude worse than int4 and only for experiments.",
        f"* An int8 dense core alone (f32 experts) costs KL {kl('f32', 'int8'):.1e}, more than int4 experts with a bf16 core: "
        "in these models the core's rounding dominates once it is int8. It is spread over the whole core — keeping any "
        "one group (indexer, attention, embeddings, MLPs) in f32 removed at most ~30 % of it on seed 1234 (a one-off experiment, not part of this script). A bf16 core is "
        "the choice where quality matters and it fits (GLM-5: ~38 GB vs ~19 GB at int8).",
        f"* An int4 g64 core (with int4 g64 experts) costs KL {kl('int4 g64', 'int4 g64'):.1e}, "
        f"{kl('int4 g64', 'int4 g64') / kl('int4 g64', 'int8'):.1f}x the int8 core's {kl('int4 g64', 'int8'):.1e}: the smallest "
        "core, the one a 16 GB GPU needs for GLM-5 (`coli plan`), and why `coli convert` keeps int8 as its default.",
        f"* top-1 is a noisy measure on these models: their next-token distributions are almost flat (median fp32 "
        f"top-1/top-2 logit margin {res['fp32_margin_median']:.3f} against a logit spread — std over the vocabulary — of "
        f"{res['fp32_logit_std_median']:.3f}), so the argmax flips at perturbations a trained model would shrug off. "
        "KL is the steadier measure here.",
        "* These are random models, not GLM-5: Gaussian weights (no outlier channels), tiny widths, and 16 experts per "
        "layer instead of 256, so the balance between core and expert error will differ in GLM-5. Every expert is "
        "64 wide, so `int4 g128` on `down_proj` (64 inputs) is one padded group, the same as g64 there. Use the table to "
        "rank formats and see the size of effects, not as a promise about GLM-5 quality; measure the real model before "
        "choosing. Norms, routers, the correction bias and `weights_proj` stay fp32 in every row (`keep_full_precision`).",
        "",
        f"Run time: {seconds:.0f} s on the 2-core development VM.",
        "",
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--oracles", type=int, default=len(ORACLES), help=f"how many oracles (1..{len(ORACLES)})")
    ap.add_argument("--write", type=Path, default=None, help="write the markdown report here")
    ap.add_argument("--json", type=Path, default=None, help="write the raw results here")
    ap.add_argument("--workdir", type=Path, default=None)
    a = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="coli-fidelity-", dir=a.workdir))
    t0 = time.perf_counter()
    try:
        res = run(max(1, min(a.oracles, len(ORACLES))), work, log=lambda m: print(m, file=sys.stderr))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    seconds = time.perf_counter() - t0
    md = markdown(res, seconds)
    if a.write:
        a.write.write_text(md)
    if a.json:
        a.json.write_text(json.dumps(res, indent=1))
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
