#!/usr/bin/env python3
"""Sweep the tensor-core MoE decode kernels' compile-time settings at GLM-5's expert shape (needs PyCUDA, a GPU).

    python scripts/moe_kernel_sweep.py [--iters 20] [--sets 24] [--json-out FILE]

One run measures, on the same records (8 routed experts, 2048 x 6144 int4 g64, rotating over --sets groups so the
L2 never holds a previous launch's weights):
  * the ceilings: device-to-device copy (read + write counted) and `read_ceiling`, a kernel that only reads the
    same bytes with the same 16-byte streaming loads;
  * the scalar v2 kernels (gemv.cu) and every variant below of cuda/moe_mma.cu: each compiled by nvcc with its
    -D settings (in parallel), checked against float64 numpy (rel. err <= 1e-5, else marked FAILED and not
    timed), timed for gate/up (with the x split), down and the layer, with registers and spills from ptxas.
All times are GPU time (each timed run queued behind a spin kernel, scripts/bench_kernels.py's Timer).
Prints a table, best first, and writes JSON. Used to choose MMA_D / MMA_MINB in cuda/moe_mma.cu (perf-notes).
"""

from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_kernels import H, IM, K, Timer, moe_bench_setup  # noqa: E402
from coli.gpu.cubin_build import build_cubin  # noqa: E402

# name -> -D settings of cuda/moe_mma.cu: MMA_D gate/up steps in flight per warp; MMA_DT down tiles (16 rows)
# per warp, MMA_DD down steps in flight; MMA_MINB blocks per SM for the register allocator
def _v(d=4, dt=2, dd=2, minb=2, **extra):
    return dict(MMA_D=d, MMA_DT=dt, MMA_DD=dd, MMA_MINB=minb, MMA_L2PF=extra.pop("MMA_L2PF", 128), **extra)


VARIANTS = {     # MMA_L2PF: the weight loads' L2 fetch-size hint in bytes (0 none)
    "default": _v(), "l2pf0": _v(MMA_L2PF=0), "l2pf256": _v(MMA_L2PF=256), "d5": _v(d=5), "d3": _v(d=3),
    "dd3": _v(dd=3), "dt1dd4": _v(dt=1, dd=4), "dt4dd1": _v(dt=4, dd=1),
    # diagnostic: the same loads and loop, no arithmetic (checked results are wrong by design: FAILED, timed)
    "readonly": _v(MMA_READONLY=1), "readonly-l2pf0": _v(MMA_L2PF=0, MMA_READONLY=1),
}


def compile_variant(cc: str, defs: dict) -> tuple[bytes, dict]:
    """nvcc -cubin of cuda/moe_mma.cu with the settings -> (cubin, {kernel: [registers, spill bytes]})."""
    return build_cubin("moe_mma.cu", cc, defs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--sets", type=int, default=24)
    ap.add_argument("--only", nargs="*", help="variant names (default: all)")
    ap.add_argument("--json-out", type=Path)
    a = ap.parse_args()

    from coli.gpu.cuda_backend import CudaBackend

    gb = CudaBackend()
    rt = gb.rt
    drv = rt.drv
    tm = Timer(rt, spin=True)
    rng = np.random.default_rng(0)
    cc = f"{rt.cc[0]}{rt.cc[1]}"
    names = a.only or list(VARIANTS)
    with ThreadPoolExecutor(8) as ex:
        built = dict(zip(names, ex.map(lambda n: compile_variant(cc, VARIANTS[n]), names)))
    out: dict = {"device": rt.name, "sm": cc, "variants": {}}

    n = 1 << 30
    src, dst = rt.alloc(n), rt.alloc(n)
    rt.copy(int(src), int(dst), n)
    copy_us = tm.per_call_us(lambda i: rt.copy(int(dst), int(src), n), 10)
    copy_bw = out["d2d_copy_GBps"] = round(2 * n / copy_us / 1e3, 1)
    del src, dst

    m = moe_bench_setup(gb, rng, a.sets)
    lay, tables, x, wts, y = m.lay, m.tables, m.x, m.wts, m.y
    want_h, want_y, gu_bytes, dn_bytes = m.want_h, m.want_y, m.gu_bytes, m.dn_bytes
    out.update(gu_bytes=gu_bytes, dn_bytes=dn_bytes)
    frac = lambda nb, us: round(nb / us / 1e3 / copy_bw, 3)   # noqa: E731

    # ceilings: read the same bytes, nothing else
    sink = rt.alloc(16)
    f_read = rt.module("gemv").get_function("read_ceiling")
    f_read.prepare("PqqiP")
    rb = rt.resident_blocks(f_read, 256) * 2
    gu_span = lay.up.end - lay.gate.offset
    for key, off, nb in (("read_gateup", lay.gate.offset, gu_span), ("read_down", lay.down.offset, lay.down.nbytes)):
        us = tm.per_call_us(lambda i: f_read.prepared_async_call((rb, 1, 1), (256, 1, 1), rt.stream,
                                                                  tables[i % a.sets].ptr, off, nb, K, sink), a.iters)
        out[key] = {"us": round(us, 2), "GBps": round(K * nb / us / 1e3, 1), "of_copy": frac(K * nb, us)}
    us = Timer(rt).per_call_us(lambda i: f_read.prepared_async_call((1, 1, 1), (32, 1, 1), rt.stream,
                                                                    tables[0].ptr, 0, 16, 1, sink), a.iters)
    out["launch_issue_us"] = round(us, 2)     # launches of a kernel that does nothing, no spin: the host's rate
    print(json.dumps({k: out[k] for k in ("d2d_copy_GBps", "read_gateup", "read_down", "launch_issue_us")}),
          flush=True)

    def measure(tag, gateup, down, h, info):
        r = dict(info)
        rt.upload_bytes(np.full(K * IM * 4, 0xFF, np.uint8), h.ptr)
        rt.upload_bytes(np.full(H * 4, 0xFF, np.uint8), y.ptr)
        gateup(0)
        down(0)
        rt.synchronize()
        hh, yy = rt.to_host(h), rt.to_host(y)[0]
        r["gateup_rel_err"] = float(max(np.linalg.norm(hh[k] - want_h[k]) / np.linalg.norm(want_h[k])
                                        for k in range(K)))
        r["down_rel_err"] = float(np.linalg.norm(yy - want_y) / np.linalg.norm(want_y))
        r["ok"] = bool(np.isfinite(hh).all() and np.isfinite(yy).all() and r["gateup_rel_err"] < 1e-5
                       and r["down_rel_err"] < 1e-5)
        if r["ok"] or tag.startswith("readonly"):      # diagnostics are wrong by design, but timed
            r["gateup_us"] = round(tm.per_call_us(gateup, a.iters), 2)
            r["down_us"] = round(tm.per_call_us(down, a.iters), 2)
            r["layer_us"] = round(tm.per_call_us(lambda i: (gateup(i), down(i)), a.iters), 2)
            r["layer_us_repeat"] = round(tm.per_call_us(lambda i: (gateup(i), down(i)), a.iters), 2)
            lu = min(r["layer_us"], r["layer_us_repeat"])
            r.update(gateup_frac=frac(gu_bytes, r["gateup_us"]), down_frac=frac(dn_bytes, r["down_us"]),
                     layer_frac=frac(gu_bytes + dn_bytes, lu))
        out["variants"][tag] = r
        print(f"{tag}: {json.dumps(r)}", flush=True)

    # the backend's own kernels: scalar v2, and the tensor-core ones as built by default (the layer is 2 launches)
    for ver in ("v2", "mma"):
        sc = gb.moe_scratch(lay, K, version=ver)
        measure(f"{ver} (backend)", lambda i, sc=sc: gb.moe_gateup(sc, tables[i % a.sets].ptr, x.ptr),
                lambda i, sc=sc: gb.moe_down(sc, tables[i % a.sets].ptr, wts.ptr, y.ptr, False), sc.h, {})

    sc = gb.moe_scratch(lay, K, version="mma")      # buffers for the variants
    g, d = lay.gate, lay.down
    sm_g = H // 32 * 128 + H // 64 * 32 + 256
    sm_d = K * (IM // 32 * 128 + IM // 64 * 32)
    for name in names:
        cubin, regs = built[name]
        mod = drv.module_from_buffer(cubin)
        fs, fg, fd = (mod.get_function(n) for n in ("moe_split_x4", "moe_gateup_mma_int4", "moe_down_mma_int4"))
        dn_rows = 16 * VARIANTS[name]["MMA_DT"]
        fs.prepare("PiiPPP")
        fg.prepare("PqqiiiiqiPPPPPPP")
        fd.prepare("PqiiiiqiPPPPPi")
        for f, sm in ((fg, sm_g), (fd, sm_d)):
            if sm > 48 * 1024:
                f.set_attribute(drv.function_attribute.MAX_DYNAMIC_SHARED_SIZE_BYTES, sm)
        info = {"defs": VARIANTS[name], "gateup_regs_spill": regs.get("moe_gateup_mma_int4"),
                "down_regs_spill": regs.get("moe_down_mma_int4"),
                "gateup_blocks_per_sm": rt.resident_blocks(fg, 256, sm_g) // rt.sm_count,
                "down_blocks_per_sm": rt.resident_blocks(fd, 256, sm_d) // rt.sm_count}

        def gateup(i, fs=fs, fg=fg):
            fs.prepared_async_call((H // 64, 1, 1), (32, 1, 1), rt.stream, x.ptr, 1, H, sc.xq.ptr, sc.xc.ptr,
                                   sc.xf.ptr)
            fg.prepared_async_call((K * IM // 64, 1, 1), (256, 1, 1), rt.stream, tables[i % a.sets].ptr, g.offset,
                                   lay.up.offset, IM, H, 64, g.rows_per_tile, g.tile_bytes, K, sc.xq.ptr, sc.xc.ptr,
                                   sc.xf.ptr, sc.h.ptr, sc.hq.ptr, sc.hc.ptr, sc.hf.ptr, shared_size=sm_g)

        def down(i, fd=fd, dn_rows=dn_rows):
            fd.prepared_async_call((H // dn_rows, 1, 1), (256, 1, 1), rt.stream, tables[i % a.sets].ptr, d.offset, H, IM,
                                   64, d.rows_per_tile, d.tile_bytes, K, wts.ptr, sc.hq.ptr, sc.hc.ptr, sc.hf.ptr,
                                   y.ptr, 0, shared_size=sm_d)
        try:
            measure(name, gateup, down, sc.h, info)
        except Exception as e:      # noqa: BLE001 -- one failing variant must not end the sweep
            out["variants"][name] = {**info, "ok": False, "error": f"{type(e).__name__}: {e}"[:300]}
            print(f"{name}: FAILED {e}", flush=True)
            rt.synchronize()

    rows = sorted(out["variants"].items(), key=lambda kv: kv[1].get("layer_us", 1e9))
    print(f"\nd2d copy {copy_bw} GB/s; read-only kernel: gate/up {out['read_gateup']['of_copy']:.0%}, "
          f"down {out['read_down']['of_copy']:.0%} of it; empty launch {out['launch_issue_us']} us")
    print(f"{'variant':10} {'gate/up us':>10} {'down us':>8} {'layer us':>9} {'of copy':>8}  regs g/d")
    for name, r in rows:
        if r.get("layer_us"):
            print(f"{name:10} {r['gateup_us']:10.1f} {r['down_us']:8.1f} {min(r['layer_us'], r['layer_us_repeat']):9.1f}"
                  f" {r['layer_frac']:8.1%}  {r.get('gateup_regs_spill')} {r.get('down_regs_spill')}")
        else:
            print(f"{name:10} FAILED {r.get('error', '')} g {r.get('gateup_rel_err')} d {r.get('down_rel_err')}")
    if a.json_out:
        a.json_out.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
