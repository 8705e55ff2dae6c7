#!/usr/bin/env python3
"""Sweep the dense decode GEMV's compile-time settings (cuda/gemv.cu: GEMV2_U_INT8 / _INT4, GEMV2_MINB, GEMV2_PF;
the dense SwiGLU's MOE2_PF, MOE2_GU_U_INT8 / _INT4, MOE2_DN_U; cuda/attention.cu: MLA_O_PF)
at GLM-5's dense shapes and on the whole dense layer (needs PyCUDA, nvcc and a GPU; refuses with one line
otherwise).

    python scripts/gemv_kernel_sweep.py [--only NAME ...] [--iters 20] [--json-out FILE]

Every variant below is built by nvcc with its -D settings (in parallel) and loaded in place of the shipped modules
(CudaRuntime.use_module). Then, GPU time (scripts/bench_kernels.py's Timer: behind a spin kernel,
median of reps), each matrix set rotating over device copies > 120 MB so L2 never holds the previous call's weights:
  * the projections of a decode layer that read one input, in one gemv2x launch: q_a | kv_a | wk (6144 columns) and
    q_b | wq_b (2048 columns), int8 and int4; and o_proj (6144 x 16384) in one gemv2 launch, int8 and int4;
  * the dense part of a decode layer at T = 2,048 replayed as one CUDA graph of two layers (bench_kernels'
    dense_layer_bench, GEMV v3), int8 and int4 cores.
Each output is checked against the shipped build's bit for bit: every setting keeps a row's sums in the same order
(cuda/gemv.cu), so only a different column split (the host's gemv2_split follows the resident blocks) may change bits
-- where a variant's split differs, its outputs are checked against float64 instead, within the classical bound of
an fp32 sum in any order (f64_close); the same split with other bits fails the check.
Beside each row: the shape's bytes over the time against the device copy measured in the same run.
Prints a table, best first (by the int8 dense layer), and writes JSON (--json-out).
"""

from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
for p in (ROOT, ROOT / "scripts"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from coli.gpu.cubin_build import build_cubin, find_nvcc  # noqa: E402

F32 = np.float32
H = 6144
SHIPPED = dict(GEMV2_U_INT8=2, GEMV2_U_INT4=2, GEMV2_MINB=2, GEMV2_PF=0, MOE2_PF=0, MOE2_GU_U_INT8=4,
               MOE2_GU_U_INT4=6, MOE2_DN_U=2)
SHIPPED_ATTN = dict(MLA_O_PF=0)


def _v(**kw) -> dict:
    """A variant: cuda/gemv.cu's settings (the shipped ones but for kw) and, under "attention", cuda/attention.cu's
    where kw sets any of them (else the shipped module serves attention)."""
    attn = {k: kw.pop(k) for k in list(kw) if k in SHIPPED_ATTN}
    return {"gemv": {**SHIPPED, **kw}, "attention": {**SHIPPED_ATTN, **attn} if attn else None}


# name -> -D settings of cuda/gemv.cu (its header says what each does) and cuda/attention.cu; "default" is the
# shipped build. The 2026-12-02 sweeps (docs/perf-notes.md): of 2/4/8 rows per work item, U, MINB, a pipelined
# segment loop and the L2 prefetches, the prefetches off and U 2/2 won (shipped since); the rows per item and the
# loop lost everywhere and are no longer settings.
VARIANTS = {
    "default": _v(),
    "before": _v(GEMV2_PF=1, GEMV2_U_INT8=4, GEMV2_U_INT4=6, MOE2_PF=1, MLA_O_PF=1),   # the build before the sweeps
    "u4-6": _v(GEMV2_U_INT8=4, GEMV2_U_INT4=6),      # the earlier chunks per lane, prefetches off
    "u2-3": _v(GEMV2_U_INT4=3),                      # the second sweep's int4 batch
    "u1-1": _v(GEMV2_U_INT8=1, GEMV2_U_INT4=1),
    "pf1": _v(GEMV2_PF=1),
    "moe2pf1": _v(MOE2_PF=1),
    "mlaopf1": _v(MLA_O_PF=1),
    "minb3": _v(GEMV2_MINB=3),
    # the dense SwiGLU's (the shared expert's) gate/up and down batches: none won on 2026-12-02
    "gu2-3": _v(MOE2_GU_U_INT8=2, MOE2_GU_U_INT4=3),
    "dn1": _v(MOE2_DN_U=1),
}
SHAPES = {   # name -> (columns, rows of each matrix in the launch)
    "q_a|kv_a|wk": (H, (2048, 576, 128)),
    "q_b|wq_b": (2048, (16384, 4096)),
    "o_proj": (16384, (H,)),
}


def f64_close(y: np.ndarray, ws: list[np.ndarray], x: np.ndarray) -> tuple[bool, float]:
    """y (fp32, the rows of every matrix one after another) against float64 W x: each row within the classical bound
    of an fp32 sum of `cols` products in any order, cols x 2^-24 x sum |w x| (the split only reorders the adds; the
    weights are exact in fp32 -- dequantize()). -> (all within, the largest error over its bound)."""
    W = np.concatenate(ws).astype(np.float64)
    xd = x.astype(np.float64)
    ref, mag = W @ xd, np.abs(W) @ np.abs(xd)
    bound = W.shape[1] * 2.0 ** -24 * mag + 1e-30
    err = np.abs(y.astype(np.float64) - ref)
    return bool((err <= bound).all()), float((err / bound).max())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="*", help="variant names (default: all; 'default' always runs first)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--layer-T", type=int, default=2048)
    ap.add_argument("--json-out", type=Path)
    a = ap.parse_args()
    names = ["default"] + [n for n in (a.only or VARIANTS) if n != "default"]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        print(f"gemv_kernel_sweep: unknown variant(s) {', '.join(unknown)}; known: {', '.join(VARIANTS)}",
              file=sys.stderr)
        return 2
    try:
        from coli.gpu.cuda_backend import CudaBackend
        gb = CudaBackend()
    except Exception as e:      # noqa: BLE001 -- one line, not a traceback, where there is no GPU
        print(f"gemv_kernel_sweep: needs PyCUDA and a GPU ({type(e).__name__}: {e})", file=sys.stderr)
        return 2
    nvcc = find_nvcc()
    if nvcc is None:
        print("gemv_kernel_sweep: needs nvcc (the CUDA toolkit) to build the variants", file=sys.stderr)
        return 2
    import coli.gpu.cuda_backend as cb
    from bench_kernels import Timer, dense_layer_bench, random_matrix_bytes
    from coli.container.quant import decode_matrix
    from coli.gpu.cuda_weights import QWeight, upload_stored

    rt = gb.rt
    tm = Timer(rt, spin=True)
    cc = f"{rt.cc[0]}{rt.cc[1]}"
    jobs = [(n, mod) for n in names for mod in ("gemv", "attention") if VARIANTS[n][mod] is not None]
    with ThreadPoolExecutor(8) as ex:
        done = list(ex.map(lambda j: _build(cc, j[1], VARIANTS[j[0]][j[1]], nvcc), jobs))
    built: dict = {}
    for (n, mod), res in zip(jobs, done):
        built.setdefault(n, {})[mod] = res

    n = 1 << 30
    src, dst = rt.alloc(n), rt.alloc(n)
    rt.copy(int(src), int(dst), n)
    copy_us = tm.per_call_us(lambda i: rt.copy(int(dst), int(src), n), 10)
    copy_bw = 2 * n / copy_us / 1e3
    del src, dst
    out: dict = {"device": rt.name, "sm": cc, "d2d_copy_GBps": round(copy_bw, 1), "variants": {}}

    # the matrix sets, built once: every variant reads the same bytes
    rng = np.random.default_rng(7)
    sets: dict = {}
    for fmt in ("int8", "int4"):
        for name, (cols, shapes) in SHAPES.items():
            host = [random_matrix_bytes(r, cols, fmt, 64, rng) for r in shapes]
            ws0 = [upload_stored(rt, b, lay, (r, cols), "sweep") for (b, lay), r in zip(host, shapes)]
            nb = sum(w.nbytes for w in ws0)
            ncopy = max(2, -(-(120 << 20) // nb))
            copies = [ws0]
            for _ in range(ncopy - 1):
                cp = []
                for w in ws0:
                    buf = rt.alloc(w.nbytes)
                    rt.copy(int(buf), w.ptr, w.nbytes)
                    cp.append(QWeight(int(buf), w.layout, w.shape, buf))
                copies.append(cp)
            x = rng.standard_normal(cols).astype(F32)
            dense = [np.asarray(decode_matrix(b, lay), F32).reshape(r, cols) for (b, lay), r in zip(host, shapes)]
            sets[(fmt, name)] = dict(copies=copies, x=x, xd=gb.upload(x[None]), nb=nb + 4 * (cols + sum(shapes)),
                                     dense=dense, rows=sum(shapes))
    ref_bits: dict = {}
    ref_split: dict = {}

    def _shapes(vname: str, row: dict) -> None:
        """Each matrix set's launch under the loaded build: checked, timed, into row."""
        for (fmt, name), st in sets.items():
            copies, ncopy = st["copies"], len(st["copies"])
            run = (lambda i, c=copies: gb.linear_many(st["xd"], c[i % ncopy])) if len(copies[0]) > 1 else \
                (lambda i, c=copies: [gb.linear(st["xd"], c[i % ncopy][0])])
            y = np.concatenate([rt.to_host(t).reshape(-1) for t in run(0)])
            w0 = copies[0][0]
            kern = f"gemv2x_{fmt}" if len(copies[0]) > 1 else f"gemv2_{fmt}"
            smem = w0.layout.row_data_bytes // 16 * (16 if fmt == "int8" else 32) * 4
            split = cb.gemv2_split(st["rows"], w0.layout.row_data_bytes // 16,
                                   rt.resident_blocks(gb._fn("gemv", kern), cb.GEMV_THREADS, smem))
            key = f"{name} {fmt}"
            if vname == "default":
                ref_bits[key], ref_split[key] = y, split
                ok, how = True, "reference"
            elif np.array_equal(y, ref_bits[key]):
                ok, how = True, "bits equal"
            else:
                ok, ratio = f64_close(y, st["dense"], st["x"])
                how = f"bits differ (split {split} vs {ref_split[key]}); float64: {ratio:.2f} of the bound"
                ok = ok and split != ref_split[key]     # same split, different bits: a bug
            us = tm.per_call_us(run, a.iters, spin_us=300)
            row[key] = {"us": round(us, 2), "of_copy": round(st["nb"] / us / 1e3 / copy_bw, 3), "ok": ok,
                        "check": how, "split": split}
            print(f"{vname:12s} {key:22s} {us:7.2f} us {100 * row[key]['of_copy']:5.1f} % of the copy  {how}",
                  flush=True)

    try:
        for vname in names:
            defs = VARIANTS[vname]
            regs = {k: v for mod in built[vname].values() for k, v in mod[1].items()}
            row: dict = {"defs": defs, "regs_spills": {k: v for k, v in regs.items()
                                                       if k.startswith(("gemv2_int", "gemv2x_int", "moe_gateup_int",
                                                                        "moe_down_int", "mla_o_int"))}}
            out["variants"][vname] = row
            for mod in ("gemv", "attention"):     # a module the variant leaves alone: the shipped source
                rt.use_module(mod, rt.drv.module_from_buffer(built[vname][mod][0]) if mod in built[vname] else None)
            try:
                _shapes(vname, row)
            except Exception as e:      # noqa: BLE001 -- report it and go on with the next variant
                row["error"] = f"{type(e).__name__}: {e}"[:400]
                print(f"{vname:12s} FAILED: {row['error']}", flush=True)
                if vname == "default":
                    raise
                continue
            for fmt in ("int8", "int4"):
                outs: dict = {}
                try:
                    res = dense_layer_bench(gb, tm, fmt, a.layer_T, a.iters, versions=("v3",), outputs=outs,
                                            per_kernel=vname == "default")
                except Exception as e:      # noqa: BLE001 -- report it and go on with the next variant
                    row[f"dense layer {fmt}"] = {"error": f"{type(e).__name__}: {e}"[:400]}
                    print(f"{vname:12s} dense layer {fmt}: {row[f'dense layer {fmt}']['error']}", flush=True)
                    continue
                y = outs["v3"]
                key = f"dense layer {fmt}"
                if vname == "default":
                    ref_bits[key] = y
                    how = "reference"
                else:
                    how = "bits equal" if np.array_equal(y, ref_bits[key]) else \
                        f"bits differ: rel {np.linalg.norm(y - ref_bits[key]) / np.linalg.norm(ref_bits[key]):.1e}"
                row[key] = {"us_per_layer": res["v3"]["us_per_layer"], "repeat": res["v3"]["us_per_layer_repeat"],
                            "pdl_us_per_layer": res["v3"]["pdl"]["us_per_layer"],
                            "replay_equals_eager": res["v3"]["replay_equals_eager"], "check": how}
                if "kernels" in res:          # the shipped build's kernels one by one, in their place in the layer
                    row[key]["kernels"] = res["kernels"]
                print(f"{vname:12s} {key:22s} {res['v3']['us_per_layer']:7.2f} us a layer (PDL "
                      f"{res['v3']['pdl']['us_per_layer']:.2f})  {how}", flush=True)
    finally:
        rt.use_module("gemv", None)
        rt.use_module("attention", None)

    table = sorted(out["variants"].items(), key=lambda kv: kv[1].get("dense layer int8", {}).get("us_per_layer", 1e9))
    print(f"\nbest first by the int8 dense layer (device copy {copy_bw:.0f} GB/s); us (of the copy):")
    cols = [f"{s} {f}" for f in ("int8", "int4") for s in SHAPES]
    print(f"{'variant':12s} {'layer i8':>9s} {'layer i4':>9s} " + " ".join(f"{c[:15]:>15s}" for c in cols))
    for vname, row in table:
        lay = [row.get(f"dense layer {f}", {}).get("us_per_layer") for f in ("int8", "int4")]
        cells = [f"{row[c]['us']:.1f} ({100 * row[c]['of_copy']:.0f}%)" + ("" if row[c]["ok"] else "!")
                 if c in row else "-" for c in cols]
        print(f"{vname:12s} " + " ".join(f"{v:9.1f}" if v else f"{'-':>9s}" for v in lay) + " "
              + " ".join(f"{c:>15s}" for c in cells))
    if a.json_out:
        a.json_out.write_text(json.dumps(out, indent=1))
    bad = [f"{v} {k}" for v, row in out["variants"].items() for k, r in row.items()
           if isinstance(r, dict) and r.get("ok") is False]
    if bad:
        print("FAILED checks: " + ", ".join(bad))
    return 1 if bad else 0


def _build(cc: str, module: str, defs: dict, nvcc: str):
    return build_cubin(f"{module}.cu", cc, defs, nvcc)


if __name__ == "__main__":
    sys.exit(main())
