#!/usr/bin/env python3
"""Sweep the tensor-core prefill kernels' compile-time settings (cuda/prefill_mma.cu) on the grouped MoE prefill of a
2,048-token GLM-5 prompt (needs PyCUDA, nvcc and a GPU; refuses with one line otherwise).

    python scripts/pf_kernel_sweep.py [--out FILE.json] [--only NAME ...] [--iters 3]

Every variant below is built by nvcc with its -D settings (in parallel), loaded in place of the shipped module
(CudaRuntime.use_module) with the host's block shape set to match, and then
  * checked on the big case against the default build's output: the same bits (every variant but the diagnostics
    computes each output's 64-column integer sums and their fp32 flush in the same order, so anything else is a
    bug), and on a small GLM-5-shaped case (12 experts, 70 tokens) against float64 numpy, each output within a bound
    derived from the magnitudes (the split's 2^-27 per block, the fp32 roundings of every stage: `f64_bound`);
  * timed with CUDA events behind a spin kernel (scripts/bench_kernels.py's Timer: GPU time, warm-up, median of
    reps): the whole moe() op (x split, both launches, the slot sum -- the figure bench_kernels' prefill row
    gives), the gate/up and down launches alone on the same pair tiles, and the dense 2048 x 6144 GEMM at
    S = 2,048 (checked bitwise against the default too), int4 g64 and int8 (pf_linear_int8: the int8 dense core
    `coli convert` stores by default); the int8 one also on a small kv_a-shaped case (576 x 6144, S = 70: a partial
    row block and token tile) against float64 within `linear_f64_bound` (its bits are NOT the fp32 tiles': only
    float64 is the reference).
Effective TFLOP/s = 2 x S x top-k x 3 x Im x H / time (the four int8 parts the tensor cores multiply not counted).
Prints a table, best first, and writes JSON (--out). Diagnostics (PF_DIAG) are wrong by design: timed, not checked.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
for p in (ROOT, ROOT / "scripts", ROOT / "tests"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from coli.gpu.cubin_build import build_cubin, find_nvcc  # noqa: E402

F32 = np.float32
H, IM, K, E, S = 6144, 2048, 8, 256, 2048          # GLM-5: hidden, moe_intermediate, top-k, experts; prompt length
SMEM_SM86 = 99 * 1024                                # sm_86 / sm_89 opt-in shared memory per block
# the settings every variant below starts from: the first build (2026-12-01 afternoon, 87.3 TFLOP/s in the sweep)
BASE = dict(PF_ROWS=256, PF_TOKS=32, PF_STAGES=3, PF_MINB=2, PF_EPI=0, PF_HOIST=0, PF_SKIP=0, PF_DIAG=0)
# the shipped build: the fastest setting the H200 ran that keeps the bits everywhere (2026-12-01 18:35 UTC: skip 99.4
# TFLOP/s against base 87.3; 2026-12-02 ~00:38 UTC: epi1-skip 101.8 against skip 98.7 in one run; epi2-skip, 103.5,
# keeps them only inside a range of |x| -- docs/perf-notes.md)
DEFAULTS = {**BASE, "PF_SKIP": 1, "PF_EPI": 1}


def _v(**kw) -> dict:
    return {**BASE, **kw}


# name -> -D settings (prefill_mma.cu's header says what each does); "default" is the shipped build
VARIANTS = {
    "default": dict(DEFAULTS),
    "base": _v(),                                           # the first build (every setting off)
    "epi1": _v(PF_EPI=1),                                   # magic folded into the pairs' FFMA: 7 ops per output
    "epi2": _v(PF_EPI=2),                                   # ... and fe too: 6 FFMA per output (was 9)
    "skip": _v(PF_SKIP=1),                                  # partial tiles' absent quads skip their MMAs
    "epi2-skip": _v(PF_EPI=2, PF_SKIP=1),                   # both (and no spills at 128 registers)
    "epi1-skip": _v(PF_EPI=1, PF_SKIP=1),                   # the same without EPI 2's range note (exact anywhere)
    "epi2-skip-hoist": _v(PF_EPI=2, PF_SKIP=1, PF_HOIST=1),
    # full warps (all 16 rows present) run their 4 quads as one basic block: quad q + 1's B loads and MMAs may go
    # under quad q's flush (SASS: docs/perf-notes.md, "the main loop's SASS per IMMA")
    "skip2": _v(PF_SKIP=2),
    "epi1-skip2": _v(PF_EPI=1, PF_SKIP=2),
    # + copies from one pointer per kind (a split-x row per thread), stage offsets by adds: ~-70 SASS a step
    "skip2-hoist2": _v(PF_SKIP=2, PF_HOIST=2),
    "epi1-skip2-hoist2": _v(PF_EPI=1, PF_SKIP=2, PF_HOIST=2),
    "epi1-skip-hoist2": _v(PF_EPI=1, PF_SKIP=1, PF_HOIST=2),
    "epi2-skip-128x32-minb3": _v(PF_EPI=2, PF_SKIP=1, PF_ROWS=128, PF_TOKS=32, PF_MINB=3),
    "epi2-minb1": _v(PF_EPI=2, PF_MINB=1),                  # no register cap: no spills, 2 warps per scheduler
    "epi2-hoist": _v(PF_EPI=2, PF_HOIST=1),                 # copy sources found once per block
    "epi2-hoist-minb1": _v(PF_EPI=2, PF_HOIST=1, PF_MINB=1),
    "epi2-stages2": _v(PF_EPI=2, PF_STAGES=2),
    "epi2-stages4": _v(PF_EPI=2, PF_STAGES=4),              # gate/up: 1 block per SM (124 KB)
    "epi2-128x64": _v(PF_EPI=2, PF_ROWS=128, PF_TOKS=64),   # the first build's shape
    "epi2-128x32-minb3": _v(PF_EPI=2, PF_ROWS=128, PF_TOKS=32, PF_MINB=3),   # 4 warps, 170 registers, 3 per SM
    "epi2-256x64-minb1": _v(PF_EPI=2, PF_TOKS=64, PF_MINB=1),                # 16 warps, 1 block per SM
    # diagnostics: the same loads and MMAs, a flush of ~1 op per output (what the epilogue costs); wrong by design
    "diag": _v(PF_DIAG=1),
    "diag-minb1": _v(PF_DIAG=1, PF_MINB=1),
    "diag-skip": _v(PF_DIAG=1, PF_SKIP=1),                  # against skip / epi2-skip: "diag" above has no SKIP
}


def pf_threads(defs: dict) -> int:
    return 32 * (defs["PF_ROWS"] // 64) * (defs["PF_TOKS"] // 16)


def smem_bytes(defs: dict, cols: int, group: int, fmt: str = "int4") -> int:
    """cuda_backend.pf_smem for these settings."""
    if fmt == "int8":
        return defs["PF_STAGES"] * (defs["PF_ROWS"] * 64 + defs["PF_TOKS"] * (256 + 48)) + defs["PF_ROWS"] * 16 \
            + defs["PF_TOKS"] * 4
    stage = defs["PF_ROWS"] * 32 + defs["PF_TOKS"] * (256 + 48)
    scales = -(-(defs["PF_ROWS"] * (cols // group) * 2) // 16) * 16
    return defs["PF_STAGES"] * stage + scales + defs["PF_ROWS"] * 16 + defs["PF_TOKS"] * 4


def compile_variant(nvcc: str, cc: str, defs: dict) -> tuple[bytes, dict]:
    """nvcc -cubin of cuda/prefill_mma.cu with the settings -> (cubin, {kernel: [registers, spill bytes]})."""
    return build_cubin("prefill_mma.cu", cc, defs, nvcc)


def f64_bound(x, idx, w, mats):
    """float64 reference of the grouped MoE and a per-element bound on |GPU - reference| from the magnitudes.
    Per 64-column block the split drops < 2^-27 of the block's largest |x| per element; each block's flush rounds
    twice (the parts' combination, the accumulating FFMA: 2.5 nG 2^-24 of the |W| |x| companion, the formula test's
    count); SiLU ~3 ulp (expf 2, the add and the division), the products h = silu(g) u and w y one rounding each,
    the K-slot sum K roundings; |silu'| <= 1.1. First-order terms, each at its worst: a loose bound, so a variant
    that breaks an index (errors the size of the values) still fails it by orders of magnitude."""
    u = 2.0 ** -24
    x64 = x.astype(np.float64)
    ax = np.abs(x64)
    nG = x.shape[1] // 64
    blk = ax.reshape(len(x), nG, 64).max(axis=2)                        # [S, nG]
    want, bound, slot_mag = (np.zeros_like(x64) for _ in range(3))

    def gemm_err(m, v_abs, v_blk):
        """[n, rows]: the split's and the flush's error of v @ m.T (m [rows, C] float64, v |.| [n, C], blocks)."""
        am = np.abs(m)
        ng = m.shape[1] // 64
        return 2.0 ** -27 * v_blk @ am.reshape(m.shape[0], ng, 64).sum(axis=2).T + 2.5 * ng * u * (v_abs @ am.T)
    with np.errstate(over="ignore"):
        for e, (g, up, d) in mats.items():
            tok, slot = np.nonzero(idx == e)
            if tok.size == 0:
                continue
            g, up, d = (m.astype(np.float64) for m in (g, up, d))
            wk = w[tok, slot].astype(np.float64)[:, None]
            gv, uv = x64[tok] @ g.T, x64[tok] @ up.T                   # [n, Im]
            sg = gv / (1 + np.exp(-gv))
            h = sg * uv
            eg, eu = gemm_err(g, ax[tok], blk[tok]), gemm_err(up, ax[tok], blk[tok])
            eh = 1.1 * eg * np.abs(uv) + np.abs(sg) * eu + 1.1 * eg * eu + 7 * u * np.abs(h)
            ah = np.abs(h) + eh                                          # |the GPU's h| at most
            hblk = ah.reshape(len(tok), -1, 64).max(axis=2)
            mag = ah @ np.abs(d).T                                       # [n, H]
            ey = eh @ np.abs(d).T + gemm_err(d, ah, hblk) + u * mag
            np.add.at(want, tok, wk * (h @ d.T))
            np.add.at(bound, tok, wk * ey)
            np.add.at(slot_mag, tok, wk * mag)
    bound += (idx.shape[1] + 1) * u * slot_mag                           # the routing product and the slot sum
    return want, bound


def linear_f64_bound(x: np.ndarray, w: np.ndarray, extra_roundings: int = 4) -> tuple[np.ndarray, np.ndarray]:
    """float64 x @ w.T and a per-element bound on the tensor-core prefill GEMM's error (x [S, C] float32, w [N, C]
    the stored weights' values): the split drops < 2^-27 of each 64-column block's largest |x| per element (against
    that block's |w|); per block the parts' combination rounds (int8: the two pairs and their sum, F0 + F1 / 2^7
    needing 27 bits) and the accumulating FFMA rounds once more (nG of them over the row, each at most 2^-24 of the
    running |w| |x| companion); int8's row scale multiplies once at the end. (nG + extra_roundings) 2^-24 of the
    companion plus the split's term: first-order, each at its worst, so an index error (errors the size of the
    values) exceeds it by orders of magnitude."""
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    nG = x.shape[1] // 64
    blk = np.abs(x64).reshape(len(x), nG, 64).max(axis=2)                     # [S, nG]
    wblk = np.abs(w64).reshape(len(w), nG, 64).sum(axis=2)                    # [N, nG]
    bound = 2.0 ** -27 * blk @ wblk.T + (nG + extra_roundings) * 2.0 ** -24 * (np.abs(x64) @ np.abs(w64).T)
    return x64 @ w64.T, bound


def unknown_variants(prog: str, names) -> str | None:
    """The one-line refusal of --only names that are not VARIANTS (None: all known)."""
    unknown = sorted(set(names or ()) - set(VARIANTS))
    return f"{prog}: unknown variant(s) {', '.join(unknown)}; known: {', '.join(VARIANTS)}" if unknown else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    ap.add_argument("--only", nargs="*", help="variant names (default: all; 'default' always runs: the reference)")
    ap.add_argument("--iters", type=int, default=3, help="calls per timed repetition")
    a = ap.parse_args()
    refusal = unknown_variants("pf_kernel_sweep", a.only)
    if refusal:
        print(refusal, file=sys.stderr)
        return 2
    nvcc = find_nvcc()
    from coli.gpu.cubin_build import backend_or_refusal
    gb, refusal = backend_or_refusal("pf_kernel_sweep")
    if gb is None:
        print(refusal, file=sys.stderr)
        return 2
    if nvcc is None:
        print("pf_kernel_sweep: needs nvcc (the CUDA toolkit) to build the variants; put it on PATH", file=sys.stderr)
        return 2
    import coli.gpu.cuda_backend as cb
    from bench_kernels import Timer, record_pool
    from coli.container.format import RecordLayout
    from coli.gpu.cuda_weights import DeviceRecord
    from gpu_helpers import random_record, rel_err

    t_start = time.time()
    rt = gb.rt
    cc = f"{rt.cc[0]}{rt.cc[1]}"
    names = ["default"] + [n for n in (a.only or VARIANTS) if n != "default"]
    with ThreadPoolExecutor(min(16, len(names) + 1)) as ex:
        futs = {n: ex.submit(compile_variant, nvcc, cc, VARIANTS[n]) for n in names}
        peak_build = ex.submit(compile_variant, nvcc, cc, {**DEFAULTS, "PF_PEAK": 1})
    built, out = {}, {"device": rt.name, "sm": cc, "S": S, "experts": E, "top_k": K, "H": H, "Im": IM,
                      "flops": 2 * S * K * 3 * IM * H, "variants": {}}
    for n, f in futs.items():
        try:
            built[n] = f.result()
        except Exception as e:      # noqa: BLE001 -- a variant that does not build is a row, not the end
            out["variants"][n] = {"defs": VARIANTS[n], "ok": False, "error": f"build: {str(e)[-300:]}"}
    print(f"built {len(built)} of {len(names)} variants for sm_{cc} in {time.time() - t_start:.0f} s", flush=True)
    if "default" not in built:
        print(f"pf_kernel_sweep: the default build failed: {out['variants']['default']['error']}", file=sys.stderr)
        return 1

    tm = Timer(rt, spin=True)
    try:
        out["mma_peak"] = mma_peak(rt, peak_build.result()[0])
        print(f"mma_peak: {json.dumps(out['mma_peak'])}", flush=True)
    except Exception as e:      # noqa: BLE001 -- the ceiling is context, not the sweep
        out["mma_peak"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    rng = np.random.default_rng(0)
    flops = out["flops"]
    # the big case: 2,048 tokens over 256 GLM-5 experts (8 distinct records repeated: 4.8 GB, no L2 reuse between
    # experts), as scripts/bench_kernels.py's prefill row
    lay = RecordLayout.make(H, IM, "int4", 64, 512)
    _, pool, _ = record_pool(rt, lay, E, rng, n_distinct=8)
    recs = {e: DeviceRecord(int(pool) + e * lay.nbytes, lay) for e in range(E)}
    x_big = gb.upload(rng.standard_normal((S, H)).astype(F32))
    ids = np.stack([rng.choice(E, K, replace=False) for _ in range(S)]).astype(np.int64)
    wp = rng.uniform(0.1, 0.5, (S, K)).astype(F32)
    # the small case against float64: 12 GLM-5 experts, 70 tokens (~47 pairs each: partial tiles)
    es, ss = 12, 70
    small = [random_record(H, IM, "int4", rng, group=64) for _ in range(es)]
    srecs = {}
    for e_, (buf, slay, _) in enumerate(small):
        dptr = rt.alloc(slay.nbytes)
        rt.upload_bytes(buf, int(dptr))
        srecs[e_] = DeviceRecord(int(dptr), slay, owner=dptr)
    xs = rng.standard_normal((ss, H)).astype(F32)
    sidx = np.stack([rng.choice(es, K, replace=False) for _ in range(ss)]).astype(np.int64)
    sw = rng.uniform(0.1, 1.0, (ss, K)).astype(F32)
    want_small, bound_small = f64_bound(xs, sidx, sw, {e_: m for e_, (_, _, m) in enumerate(small)})
    x_small = gb.upload(xs)
    # and the dense GEMM beside it (q_a_proj: 2048 x 6144 g64, S = 2,048), the other user of these kernels
    from bench_kernels import random_matrix_bytes
    from coli.gpu.cuda_weights import upload_stored
    wb, wlay = random_matrix_bytes(2048, H, "int4", 64, rng)
    w_dense = upload_stored(rt, wb, wlay, (2048, H), "sweep")
    x_dense = gb.upload(rng.standard_normal((S, H)).astype(F32))
    wb8, wlay8 = random_matrix_bytes(2048, H, "int8", 0, rng)                  # the int8 dense core's q_a
    w_dense8 = upload_stored(rt, wb8, wlay8, (2048, H), "sweep")
    from gpu_helpers import stored_matrix                                     # kv_a: 576 rows, a partial block
    kb, klay, kref = stored_matrix(576, H, "int8", rng)
    w_kv8 = upload_stored(rt, kb, klay, (576, H), "sweep")
    xk = rng.standard_normal((70, H)).astype(F32)
    xk[3] *= np.float32(2.0 ** -30)                                           # a token far below the others
    want_kv8, bound_kv8 = linear_f64_bound(xk, kref)
    x_kv8 = gb.upload(xk)
    print(f"inputs ready in {time.time() - t_start:.0f} s", flush=True)

    def moe_big():
        return gb.moe(x_big, ids, wp, ((e, recs[e]) for e in range(E)))

    saved = (cb.PF_ROWS, cb.PF_TOKS, cb.PF_STAGES, gb.prefill_kernels)
    gb.prefill_kernels = "mma"
    gb.prefill_int8 = True          # the int8 GEMM rows are pf_linear_int8's (the product's default; COLI_PREFILL_INT8=0 turns it off)
    shipped_big = gb.to_host(moe_big())          # the module as the backend builds it (PyCUDA): "default" must match
    ref_big = ref_dense = ref_dense8 = None
    try:
        for n in names:
            if n not in built:
                continue
            defs = VARIANTS[n]
            cubin, regs = built[n]
            r = {"defs": defs, "regs_spill": regs, "threads": pf_threads(defs),
                 "smem_gateup": smem_bytes(defs, H, 64), "smem_down": smem_bytes(defs, IM, 64),
                 "smem_int8": smem_bytes(defs, H, 0, "int8")}
            r["fits_sm86"] = max(r["smem_gateup"], r["smem_down"]) <= SMEM_SM86
            out["variants"][n] = r
            if max(r["smem_gateup"], r["smem_down"]) > rt.smem_optin:
                r.update(ok=False, error=f"shared memory {max(r['smem_gateup'], r['smem_down'])} B > "
                         f"{rt.smem_optin} B of this device")
                print(f"{n}: {r['error']}", flush=True)
                continue
            try:
                rt.use_module("prefill_mma", rt.drv.module_from_buffer(cubin))
                cb.PF_ROWS, cb.PF_TOKS, cb.PF_STAGES = defs["PF_ROWS"], defs["PF_TOKS"], defs["PF_STAGES"]
                r.update(_measure(gb, cb, tm, n, defs, moe_big, x_big, ids, wp, recs, flops, a.iters))
                us = tm.per_call_us(lambda i: gb.linear(x_dense, w_dense), a.iters * 2, reps=3, warmup=1,
                                    spin_us=20000)
                r.update(dense_us=round(us, 1), dense_TFLOPs=round(2 * S * 2048 * H / us / 1e6, 2))
                us8 = tm.per_call_us(lambda i: gb.linear(x_dense, w_dense8), a.iters * 2, reps=3, warmup=1,
                                     spin_us=20000)
                r.update(dense8_us=round(us8, 1), dense8_TFLOPs=round(2 * S * 2048 * H / us8 / 1e6, 2))
                got_dense = gb.to_host(gb.linear(x_dense, w_dense))
                got_dense8 = gb.to_host(gb.linear(x_dense, w_dense8))
                got_kv8 = gb.to_host(gb.linear(x_kv8, w_kv8))
                ex8 = np.abs(got_kv8.astype(np.float64) - want_kv8) / bound_kv8
                r["int8_f64_err_over_bound"] = float(np.nanmax(np.where(np.isfinite(ex8), ex8, np.inf)))
                got_big = gb.to_host(moe_big())
                if n == "default":
                    ref_big, ref_dense, ref_dense8 = got_big, got_dense, got_dense8
                    r["bits_equal_shipped"] = bool(np.array_equal(got_big, shipped_big, equal_nan=True))
                    gb.prefill_kernels = "v1"           # the fp32 tiles on the same case: context, not a check
                    v1 = gb.to_host(gb.linear(x_kv8, w_kv8)).astype(np.float64)
                    gb.prefill_kernels = "mma"
                    r["int8_v1_f64_err_over_bound"] = float(np.max(np.abs(v1 - want_kv8) / bound_kv8))
                diag = bool(defs["PF_DIAG"])
                r["bits_equal_default"] = bool(np.array_equal(got_big, ref_big, equal_nan=True)
                                               and np.array_equal(got_dense, ref_dense, equal_nan=True)
                                               and np.array_equal(got_dense8, ref_dense8, equal_nan=True))
                if not r["bits_equal_default"]:
                    r["max_abs_diff_default"] = float(np.nanmax(np.abs(got_big.astype(np.float64) - ref_big)))
                got_small = gb.to_host(gb.moe(x_small, sidx, sw, ((e_, srecs[e_]) for e_ in range(es))))
                excess = np.abs(got_small.astype(np.float64) - want_small) / bound_small
                r["f64_rel_err"] = rel_err(got_small, want_small) if np.isfinite(got_small).all() else float("inf")
                r["f64_err_over_bound"] = float(np.nanmax(np.where(np.isfinite(excess), excess, np.inf)))
                r["diagnostic"] = diag
                r["ok"] = diag or (r["bits_equal_default"] and r["f64_err_over_bound"] <= 1.0
                                   and r["int8_f64_err_over_bound"] <= 1.0 and r.get("bits_equal_shipped", True))
            except Exception as e:      # noqa: BLE001 -- one failing variant must not end the sweep
                r.update(ok=False, error=f"{type(e).__name__}: {str(e)[:300]}")
                try:
                    rt.synchronize()
                except Exception as e2:     # noqa: BLE001 -- a kernel fault poisons the context: stop, keep rows
                    out["stopped"] = f"after {n}: the device context is lost ({str(e2)[:200]})"
                    print(f"{n}: FAILED {r['error']}\n{out['stopped']}", flush=True)
                    break
            print(f"{n}: {json.dumps({k: v for k, v in r.items() if k != 'defs'})}", flush=True)
    finally:
        cb.PF_ROWS, cb.PF_TOKS, cb.PF_STAGES, gb.prefill_kernels = saved
        out["seconds"] = round(time.time() - t_start, 1)
        if a.out:                               # first, and even when the loop ends early: the rows measured
            a.out.write_text(json.dumps(out, indent=1))
        if "stopped" not in out:
            rt.use_module("prefill_mma", None)
    _table(out)
    return 0 if all(v.get("ok") for v in out["variants"].values()
                    if not v.get("error", "").startswith("shared memory")) else 1


def mma_peak(rt, cubin: bytes, iters: int = 4096) -> dict:
    """The rate of mma.sync.m16n8k32 u8 x s8 alone (prefill_mma.cu's pf_mma_peak: 8 independent chains per warp,
    register operands) with 1, 2 and 8 blocks of 8 warps per SM, in int8 TOPS (2 ops per multiply-add), and what
    it caps: the four int8 parts make an effective TFLOP/s cost 4 int8 ones, so the grouped MoE prefill can reach
    at most TOPS / 4 effective, times the tiles' fill."""
    from bench_kernels import Timer
    mod = rt.drv.module_from_buffer(cubin)
    f = mod.get_function("pf_mma_peak")
    f.prepare("iP")
    sink = rt.alloc(16)
    by_warps = {}
    for per_sm in (1, 2, 8):
        blocks = rt.sm_count * per_sm
        us = Timer(rt).per_call_us(lambda i: f.prepared_async_call((blocks, 1, 1), (256, 1, 1), rt.stream, iters,
                                                                   sink), 3, reps=3, warmup=1)
        by_warps[str(8 * per_sm)] = round(blocks * 8 * iters * 8 * 4096 * 2 / us / 1e6, 1)
    return {"TOPS_by_warps_per_sm": by_warps, "ceiling_effective_TFLOPs": round(max(by_warps.values()) / 4, 1)}


def _measure(gb, cb, tm, name, defs, moe_big, x_big, ids, wp, recs, flops, iters) -> dict:
    """GPU times of the whole moe() op and of its gate/up and down launches alone on the same pair tiles."""
    rt = gb.rt
    us = tm.per_call_us(lambda i: moe_big(), iters, reps=3, warmup=1, spin_us=150000)
    r = {"moe_ms": round(us / 1e3, 3), "moe_TFLOPs": round(flops / us / 1e6, 2)}
    lay = recs[0].layout
    g, d = lay.gate, lay.down
    xq, xm = gb._pf_split(x_big.ptr, S, H)
    table, tiles_d, tok_d, slot_d, pw_d, n_tiles, P = gb._moe_pairs(ids, wp, recs, list(range(E)), cb.PF_TOKS)
    hq = rt.empty((P * g.rows * 4,), np.uint8)
    hm = rt.empty((P * (g.rows // 64) * 12,), np.int32)
    Y = gb.empty((S, K, H))
    f_gu, f_dn = gb._fn("prefill_mma", "pf_gateup_int4"), gb._fn("prefill_mma", "pf_down_int4")
    sm_gu, sm_dn = cb.pf_smem(g.cols, g.group), cb.pf_smem(d.cols, d.group)
    rt.allow_smem(f_gu, sm_gu)
    rt.allow_smem(f_dn, sm_dn)
    thr = cb.pf_threads()

    def gateup(i):
        rt.launch(f_gu, (g.rows // (cb.PF_ROWS // 2), n_tiles), thr, table.ptr, g.offset, lay.up.offset, g.rows,
                  g.cols, g.group, g.rows_per_tile, g.tile_bytes, tiles_d.ptr, tok_d.ptr, xq.ptr, xm.ptr, hq.ptr,
                  hm.ptr, smem=sm_gu)

    def down(i):
        rt.launch(f_dn, (d.rows // cb.PF_ROWS, n_tiles), thr, table.ptr, d.offset, d.rows, d.cols, d.group,
                  d.rows_per_tile, d.tile_bytes, tiles_d.ptr, tok_d.ptr, slot_d.ptr, pw_d.ptr, hq.ptr, hm.ptr, K,
                  Y.ptr, smem=sm_dn)
    gu_us = tm.per_call_us(gateup, iters * 2, reps=3, warmup=1, spin_us=2000)
    dn_us = tm.per_call_us(down, iters * 2, reps=3, warmup=1, spin_us=2000)
    f_gu_flops, f_dn_flops = 2 * P * 2 * IM * H, 2 * P * IM * H
    r.update(tiles=n_tiles, pairs=P, tile_fill=round(P / (n_tiles * cb.PF_TOKS), 3),
             gateup_us=round(gu_us, 1), gateup_TFLOPs=round(f_gu_flops / gu_us / 1e6, 2),
             down_us=round(dn_us, 1), down_TFLOPs=round(f_dn_flops / dn_us / 1e6, 2),
             kernels_TFLOPs=round(flops / (gu_us + dn_us) / 1e6, 2),
             blocks_per_sm_gateup=rt.resident_blocks(f_gu, thr, sm_gu) // rt.sm_count,
             blocks_per_sm_down=rt.resident_blocks(f_dn, thr, sm_dn) // rt.sm_count)
    return r


def _table(out: dict) -> None:
    rows = sorted(out["variants"].items(), key=lambda kv: kv[1].get("moe_ms", 1e9))
    print(f"\ngrouped MoE prefill, S = {S}, {E} experts top-{K}, {H} x {IM} int4 g64, {out['device']} "
          f"(sm_{out['sm']}), {out['seconds']} s")
    pk = out.get("mma_peak", {})
    if "ceiling_effective_TFLOPs" in pk:
        rates = ", ".join(f"{v} TOPS at {k} warps/SM" for k, v in pk["TOPS_by_warps_per_sm"].items())
        print(f"mma.sync u8 x s8 alone: {rates} -> at most {pk['ceiling_effective_TFLOPs']} effective TFLOP/s with "
              f"four parts (times the tiles' fill)")
    print(f"{'variant':20} {'moe ms':>7} {'TFLOP/s':>8} {'gu us':>7} {'dn us':>7} {'kern TF':>8} {'dense TF':>8} "
          f"{'int8 TF':>8} {'regs gu/dn':>14} {'blk/SM':>6} {'99KB':>4}  check")
    for n, r in rows:
        if "moe_ms" not in r:
            print(f"{n:20} FAILED {r.get('error', '')}")
            continue
        rg = r["regs_spill"].get("pf_gateup_int4", ["?", "?"])
        rd = r["regs_spill"].get("pf_down_int4", ["?", "?"])
        if r.get("diagnostic"):
            chk = "diagnostic (not checked)"
        elif "bits_equal_default" not in r:
            chk = f"ERROR {r.get('error', '')}"
        else:
            chk = (f"{'same bits' if r['bits_equal_default'] else 'BITS DIFFER'}, f64 err/bound "
                   f"{r['f64_err_over_bound']:.2g} (int8 {r['int8_f64_err_over_bound']:.2g})"
                   f"{'' if r.get('ok') else '  FAILED'}")
        print(f"{n:20} {r['moe_ms']:7.2f} {r['moe_TFLOPs']:8.1f} {r['gateup_us']:7.0f} {r['down_us']:7.0f} "
              f"{r['kernels_TFLOPs']:8.1f} {r.get('dense_TFLOPs', float('nan')):8.1f} "
              f"{r.get('dense8_TFLOPs', float('nan')):8.1f} "
              f"{f'{rg[0]}+{rg[1]}/{rd[0]}+{rd[1]}':>14} "
              f"{r['blocks_per_sm_gateup']:>3}/{r['blocks_per_sm_down']:<2} {'yes' if r['fits_sm86'] else 'no':>4}"
              f"  {chk}")


if __name__ == "__main__":
    raise SystemExit(main())
