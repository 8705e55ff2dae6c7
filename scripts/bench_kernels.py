#!/usr/bin/env python3
"""GPU kernel benchmark at GLM-5's shapes (needs PyCUDA and a CUDA device).

    python scripts/bench_kernels.py [--iters 20] [--sets 24] [--json-out FILE]

Measures, in one run:
  1. the device-to-device copy bandwidth (cuMemcpyDtoDAsync of 1 GiB, bytes read + written counted): the
     ceiling of any weight-streaming kernel on this device;
  2. the fused MoE decode (every kernel version: v1, v2 scalar; mma on the tensor cores): one launch of gate/up for 8 experts (2048 x 6144 int4, group 64, each record in
     the container's tile format) and one launch of down (6144 x 2048) with the weighted sum; achieved HBM
     bandwidth = bytes of the stored matrices read (+ the small vectors) / kernel time, as a fraction of (1).
     Records rotate over --sets distinct groups of 8 (> 2 GB) so the 60 MB L2 never holds a previous launch's
     weights; the target is >= 60 % of the copy bandwidth;
  3. the other main kernels at GLM-5 shapes (dense GEMV, lm_head, MLA attention, indexer, router, norms, rope,
     prefill GEMMs) with their times and, for weight-streaming ones, bandwidth; the dense GEMVs in both versions
     (gemv v1 / gemv2) as fractions of (1); MLA decode attention at T = 2,048 and 16,384 (DSA top-2,048), every
     version (COLI_ATTN_KERNELS) in one run, the default's parts (q_abs, context, o; the GEMVs split2 uses for
     q_abs and o), every split version's context alone, and each tile kernel's (tile1, tile2, tile3) context
     launches apart (part, combine) and chunk sweep. --attn-only: the copy and these rows;
  4. the whole dense part of a decode layer replayed as one CUDA graph (int8 and int4 cores, T = --layer-T), each
     GEMV version captured twice: ordinary edges and programmatic kernel->kernel edges (PDL, coli/gpu/pdl.py),
     timed interleaved, each replay checked bitwise against the eager step; the default version also with each
     MoE layer's shared expert on a second branch of the graph (COLI_GRAPH_BRANCHES=1: row "branches").
     --dense-layer-only: the copy, the dense GEMVs and these rows;
  5. the prefill indexer's scores at GLM-5's shape, S = T = 8,192 and 2,560: indexer_scores (v1) against
     indexer_scores_rows, TFLOP/s of the scored pairs, bits compared (also in --prefill-only). --indexer-only: the
     copy and these rows.
Prints a table and, last, one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

F32 = np.float32
H, IM, K, V = 6144, 2048, 8, 154880
VERSIONS = ("v1", "v2", "mma")     # fused MoE decode kernel versions, oldest first (cuda_backend.MOE_KERNELS)
MOE_K_MAX = 8                      # experts per fused decode launch (cuda_backend.MOE_MAXK)
ATTN_BENCH_VERSIONS = ("v1", "split1", "split2", "tile1", "tile2", "tile3")   # cuda_backend.ATTN_VERSIONS, oldest first
ATTN_TILE_VERSIONS = ("tile1", "tile2", "tile3")   # the tile kernels: their context's launches apart and chunk sweeps


def random_matrix_bytes(rows, cols, fmt, group, rng, tile_kb=512):
    """Tile bytes of a random stored matrix (random codes + fp16 scales, like a converted checkpoint)."""
    from coli.container.format import MatrixLayout
    from coli.container.quant import encode_matrix
    lay = MatrixLayout.make(rows, cols, fmt, group, tile_kb)
    if fmt == "int4":
        data = rng.integers(0, 256, (rows, lay.row_data_bytes), dtype=np.uint8) | np.uint8(0x11)
        sc = rng.uniform(0.2, 1.0, (rows, lay.n_groups)) * 0.05 / 7
    elif fmt == "int8":
        data = rng.integers(-127, 128, (rows, lay.row_data_bytes), dtype=np.int8).view(np.uint8)
        sc = rng.uniform(0.2, 1.0, (rows, 1)) * 0.05 / 127
    else:
        w = (rng.standard_normal((rows, cols)) * 0.02).astype(F32)
        from coli.container.quant import quantize
        data, meta = quantize(w, fmt, group)
        return encode_matrix(lay, data, meta), lay
    meta = np.ascontiguousarray(sc.astype(np.float16)).view(np.uint8).reshape(rows, -1)
    return encode_matrix(lay, data, meta), lay


class Timer:
    """Per-call GPU time of a launch sequence. With spin=True each timed run starts behind `bench_spin` (a kernel
    that waits iters x 50 us), so the host has enqueued every call before the first one runs: the events then
    time the kernels back to back -- GPU time -- instead of the rate at which Python issues launches (~8 us
    per launch on the H200 machine, comparable to a small kernel)."""

    def __init__(self, rt, spin: bool = False):
        self.rt = rt
        self.spin = None
        if spin:
            self.spin = rt.module("gemv").get_function("bench_spin")
            self.spin.prepare("q")

    def per_call_us(self, fn, iters: int, reps: int = 5, warmup: int = 3, spin_us: int = 50) -> float:
        """Median over `reps` of (time of `iters` back-to-back calls) / iters, timed with CUDA events. spin_us per
        call must cover the host's cost of issuing one (an op of several launches and allocations needs more)."""
        for _ in range(warmup):
            fn(0)
        self.rt.synchronize()
        out = []
        for r in range(reps):
            a, b = self.rt.event(), self.rt.event()
            if self.spin is not None:
                self.spin.prepared_async_call((1, 1, 1), (1, 1, 1), self.rt.stream, int(iters * spin_us * 1000))
            a.record(self.rt.stream)
            for i in range(iters):
                fn(r * iters + i)
            b.record(self.rt.stream)
            b.synchronize()
            out.append(b.time_since(a) * 1e3 / iters)
        return float(np.median(out))


def record_pool(rt, lay, nrec, rng, n_distinct=4):
    """nrec expert records (random int4 bytes, n_distinct different ones repeated so several input sets don't sit
    in L2 together) in one device allocation -> (the distinct host records, device base address, nrec)."""
    host_recs = []
    for _ in range(n_distinct):
        buf = np.zeros(lay.nbytes, np.uint8)
        for m in lay.matrices:
            b, _ = random_matrix_bytes(m.rows, m.cols, "int4", 64, rng)
            buf[m.offset:m.end] = b
        host_recs.append(buf)
    pool = rt.alloc(nrec * lay.nbytes)
    for i in range(nrec):
        rt.upload_bytes(host_recs[i % n_distinct], int(pool) + i * lay.nbytes)
    return host_recs, pool, nrec


def moe_bench_setup(gb, rng, sets: int):
    """The fused-decode benchmark's inputs at GLM-5's expert shape (8 experts, 2048 x 6144 int4 g64): records
    rotating over `sets` groups of 8 (> 2 GB, so L2 holds no previous launch's weights), their device tables,
    x, routing weights, an output, and the float64 numpy reference of h (gate/up) and y (down) for set 0."""
    from types import SimpleNamespace

    from coli.container.format import RecordLayout
    from coli.container.quant import decode_matrix
    rt = gb.rt
    lay = RecordLayout.make(H, IM, "int4", 64, 512)
    host_recs, pool, nrec = record_pool(rt, lay, sets * K, rng)
    tables = [rt.to_device(np.array([int(pool) + (s * K + k) * lay.nbytes for k in range(K)], np.uint64))
              for s in range(sets)]
    x = gb.upload(rng.standard_normal((1, H)).astype(F32))
    wts = gb.upload(rng.uniform(0.1, 0.5, K).astype(F32))
    y = gb.empty((1, H))
    xs, w_h = rt.to_host(x)[0], rt.to_host(wts)
    want_h, want_y = [], np.zeros(H, np.float64)
    for k in range(K):
        rec = host_recs[k % len(host_recs)]
        G, U, D = (decode_matrix(rec[m.offset:m.end], m) for m in lay.matrices)
        g, u = G.astype(np.float64) @ xs, U.astype(np.float64) @ xs
        hk = g / (1 + np.exp(-g)) * u
        want_h.append(hk)
        want_y += w_h[k] * (D.astype(np.float64) @ hk.astype(F32))
    return SimpleNamespace(lay=lay, host_recs=host_recs, pool=pool, nrec=nrec, tables=tables, x=x, wts=wts, y=y,
                           want_h=want_h, want_y=want_y,
                           gu_bytes=K * (lay.gate.nbytes + lay.up.nbytes) + 4 * (H + K * IM),
                           dn_bytes=K * lay.down.nbytes + 4 * (K * IM + H))


def run_moe_compare(a) -> dict:
    """Run moe_compare in a child process (timeout 100 s); its JSON, or {"error": ...}."""
    import os
    import subprocess
    import tempfile
    with tempfile.NamedTemporaryFile("r", suffix=".json", delete=False) as f:
        path = f.name
    cmd = [sys.executable, str(Path(__file__).resolve()), "--moe-compare", path, "--iters", str(a.iters),
           "--sets", str(a.sets)]
    try:
        p = subprocess.run(cmd, timeout=100, capture_output=True, text=True)
        sys.stdout.write(p.stdout)
        sys.stdout.write(p.stderr[-3000:])
        err = None if p.returncode == 0 else f"child exit {p.returncode}"
    except subprocess.TimeoutExpired:
        err = "child timed out (100 s)"
    try:
        out = json.loads(Path(path).read_text() or "{}")
    except (OSError, ValueError):
        out = {}
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass
    if err:
        out["error"] = err
        for ver in VERSIONS:         # a version without a verdict when the child died did not finish
            out.setdefault(ver, {"ok": False, "error": err})
            if "ok" not in out[ver]:
                out[ver].update(ok=False, error=err)
    return out


def moe_compare(a, path: Path) -> int:
    """Child process: the fused MoE decode at GLM-5's expert shape (int4 g64, K = 8), every version (v1, v2, mma)
    in turn, each checked against numpy and timed (gate/up, down, both); results written to `path` after each
    step, so that a fault or hang in a newer version still leaves the older ones' numbers."""
    from coli.gpu.cuda_backend import CudaBackend

    gb = CudaBackend()
    rt = gb.rt
    tm = Timer(rt, spin=True)      # GPU time: the mma layer is three launches, a v1/v2 layer two
    rng = np.random.default_rng(0)
    out: dict = {}

    def save():
        path.write_text(json.dumps(out))

    n = 1 << 30
    src, dst = rt.alloc(n), rt.alloc(n)
    rt.copy(int(src), int(dst), n)
    copy_us = tm.per_call_us(lambda i: rt.copy(int(dst), int(src), n), 10)
    out["d2d_copy_GBps"] = round(2 * n / copy_us / 1e3, 1)
    del src, dst
    save()

    m = moe_bench_setup(gb, rng, a.sets)
    lay, tables, x, wts, y = m.lay, m.tables, m.x, m.wts, m.y
    want_h, want_y, gu_bytes, dn_bytes = m.want_h, m.want_y, m.gu_bytes, m.dn_bytes
    out.update(gu_bytes=gu_bytes, dn_bytes=dn_bytes)

    for ver in VERSIONS:
        r = out[ver] = {}
        save()
        try:
            sc = gb.moe_scratch(lay, K, version=ver)
            assert sc.version == ver, (sc.version, ver)
            h = sc.h

            def gateup(i, sc=sc):
                assert gb.moe_gateup(sc, tables[i % a.sets].ptr, x.ptr)

            def down(i, sc=sc):
                assert gb.moe_down(sc, tables[i % a.sets].ptr, wts.ptr, y.ptr, False)
            # poison the outputs, run set 0 (records 0..7 = host_recs[k % 4]), compare with numpy in float64
            rt.upload_bytes(np.full(K * IM * 4, 0xFF, np.uint8), h.ptr)
            rt.upload_bytes(np.full(H * 4, 0xFF, np.uint8), y.ptr)
            gateup(0)
            rt.synchronize()
            hh = rt.to_host(h)
            r["gateup_rel_err"] = float(max(np.linalg.norm(hh[k] - want_h[k]) / np.linalg.norm(want_h[k])
                                            for k in range(K)))
            down(0)
            rt.synchronize()
            yy = rt.to_host(y)[0]
            r["down_rel_err"] = float(np.linalg.norm(yy - want_y) / np.linalg.norm(want_y))
            r["ok"] = bool(np.isfinite(hh).all() and np.isfinite(yy).all() and r["gateup_rel_err"] < 1e-5
                           and r["down_rel_err"] < 1e-5)
            save()
            r["gateup_us"] = round(tm.per_call_us(gateup, a.iters), 2)
            r["down_us"] = round(tm.per_call_us(down, a.iters), 2)
            r["layer_us"] = round(tm.per_call_us(lambda i: (gateup(i), down(i)), a.iters), 2)
            r["layer_us_repeat"] = round(tm.per_call_us(lambda i: (gateup(i), down(i)), a.iters), 2)
            for key, nb in (("gateup", gu_bytes), ("down", dn_bytes), ("layer", gu_bytes + dn_bytes)):
                r[f"{key}_frac"] = round(nb / r[f"{key}_us"] / 1e3 / out["d2d_copy_GBps"], 3)
        except Exception as e:      # noqa: BLE001 -- report and keep what was measured
            r.update(ok=False, error=f"{type(e).__name__}: {e}"[:500])
        save()
        print(f"moe {ver}: {json.dumps(r)}", flush=True)
    return 0


class LaunchLog:
    """Records, while installed on a backend, every kernel launch (function, grid, block, arguments, shared memory),
    labelled with the outermost backend op that issued it and, on that op's first launch, the bytes of the stored
    weights it reads; keeps every buffer allocated meanwhile alive, so the launches can be issued again for timing."""

    OPS = ("rms_norm", "layer_norm", "linear", "linear_many", "rope", "split_cols", "write_rows", "indexer_select",
           "mla_attend", "swiglu", "route", "moe_step", "add", "add_rms_norm", "norm_many", "rope_many",
           "write_rows_many")

    def __init__(self, gb):
        self.gb, self.launches, self.keep, self._op, self._bytes = gb, [], [], None, 0
        rt = gb.rt
        self._saved = {"launch": rt.launch, "empty": rt.empty}

        def launch(fn, grid, block, *args, smem=0):
            self.launches.append({"op": self._op or "?", "fn": fn, "grid": tuple(grid), "block": block, "args": args,
                                  "smem": smem, "kernel": getattr(fn, "coli_name", "?"), "bytes": self._bytes})
            self._bytes = 0
            return self._saved["launch"](fn, grid, block, *args, smem=smem)

        def empty(*a, **kw):
            out = self._saved["empty"](*a, **kw)
            self.keep.append(out)
            return out
        rt.launch, rt.empty = launch, empty
        for name in self.OPS:
            setattr(gb, name, self._wrap(name, getattr(gb, name)))

    def _wrap(self, name, fn):
        def op(*args, **kw):
            if self._op is not None:                  # an op inside another (route's linear): the outer one's label
                return fn(*args, **kw)
            self._op, self._bytes = name, _weight_bytes(args)
            try:
                return fn(*args, **kw)
            finally:
                self._op, self._bytes = None, 0
        return op

    def remove(self) -> None:
        rt = self.gb.rt
        del rt.launch, rt.empty
        for name in self.OPS:
            delattr(self.gb, name)


def _weight_bytes(args) -> int:
    from coli.gpu.cuda_weights import HeadView, QWeight
    seen, n = set(), 0
    for a in args:
        for w in (a if isinstance(a, (list, tuple)) else [a]):
            w = w.w if isinstance(w, HeadView) else w
            if isinstance(w, QWeight) and id(w) not in seen:
                seen.add(id(w))
                n += w.nbytes
    return n


def ks_sweep(gb, tm, fn, iters: int) -> dict:
    """GPU time of fn (a gemv2 / gemv2x call) with every column split forced (gb.gemv_ks = 1, 2, 4, 8), GEMV v3."""
    before = gb.gemv_kernels
    gb.gemv_kernels, out = "v3", {}
    try:
        for ks in (1, 2, 4, 8):
            gb.gemv_ks = ks
            out[ks] = round(tm.per_call_us(fn, iters, spin_us=300), 2)
    finally:
        gb.gemv_ks, gb.gemv_kernels = None, before
    return out


def time_launches(rt, tm, launches, reps: int = 7) -> list[float]:
    """GPU time of each recorded launch in its place in the sequence: the whole sequence issued behind bench_spin with
    an event after every launch, median over reps of each gap (us)."""
    evs = [rt.event() for _ in range(len(launches) + 1)]
    per = []
    for _ in range(reps):
        tm.spin.prepared_async_call((1, 1, 1), (1, 1, 1), rt.stream, int(len(launches) * 40 * 1000))
        evs[0].record(rt.stream)
        for j, L in enumerate(launches):
            rt.launch(L["fn"], L["grid"], L["block"], *L["args"], smem=L["smem"])
            evs[j + 1].record(rt.stream)
        evs[-1].synchronize()
        per.append([evs[j + 1].time_since(evs[j]) * 1e3 for j in range(len(launches))])
    return [float(v) for v in np.median(np.array(per), axis=0)]


def dense_layer_bench(gb, tm, fmt: str, T: int, iters: int, versions=("v3", "v2", "v1"), layers: int = 2,
                      outputs: dict | None = None, per_kernel: bool = True) -> dict:
    """The dense part of GLM-5 decode layers (coli.bench.dense_layer: attention + indexer + router + shared expert, the
    routed sum dropped) with a `fmt` dense core at cache length T, captured as ONE CUDA graph of `layers` layers (their
    weights together > 2x L2, so a replay reads them from HBM) per GEMV version, replayed: GPU time per layer. Also
    the default version's kernels one by one (op, kernel, grid, us, weight bytes) and the replay's output against the
    eager step's (the same kernels: identical) and against the other versions'. outputs: where given, each version's
    replayed output (host array) lands there under its name (scripts/gemv_kernel_sweep.py compares builds bit for
    bit); per_kernel=False leaves out the one-by-one kernel times."""
    from coli.bench.dense_layer import RandomDense, dense_config, layer_steady
    from coli.config import PRESETS
    from coli.gpu.graphs import DeviceStep, StepLayout, attn_span
    from coli.model.backend import cos_sin_table
    from coli.model.forward import GlmMoeDsaModel
    rt = gb.rt
    cfg = dense_config(PRESETS["glm5"], layers=layers)
    model = GlmMoeDsaModel(cfg, RandomDense(cfg, fmt), gb)
    rng = np.random.default_rng(1)
    cache = model.new_cache(T)
    for lc in cache.layers:                          # a filled cache: the attention reads real numbers
        for buf in (lc.lat, lc.k_pe, lc.k_idx):
            rt.upload_bytes(rng.standard_normal(buf.shape).astype(F32), buf.ptr)
    cache.length = pos = T - 1
    positions = np.array([pos])
    cos, sin = cos_sin_table(positions, cfg.qk_rope_head_dim, cfg.rope_theta)
    layout = StepLayout(cfg.qk_rope_head_dim // 2, tuple(cfg.moe_layers), cfg.num_experts_per_tok)
    st = DeviceStep(rt, layout, None, cfg.n_routed_experts, None, cfg.hidden_size)
    layout.pack(st.pinned_in, 0, pos, cos, sin)
    rt.upload_bytes(st.pinned_in, st.dyn.ptr)
    st.pos, st.capacity, st.mode, st.keep = pos, cache.capacity, "dropped", []
    st.attn_n_max = attn_span(T, cfg.index_topk, cfg.num_attention_heads, cfg.kv_lora_rank, rt.sm_count,
                              gb.attn_chunk)
    h0 = gb.upload(rng.standard_normal((1, cfg.hidden_size)).astype(F32))
    x0 = gb.rms_norm(h0, model.layers[0].input_norm, cfg.rms_norm_eps)   # outside the graph: each layer's nodes alone

    def body():
        # every layer as the forward runs one in the model's middle: its last residual add fused with the next input
        # norm (layer_steady), so a layer's nodes are a middle layer's
        h, x, allowed = h0, x0, None
        for i in range(layers):
            h, x, allowed = layer_steady(model, i, h, x, positions, cos, sin, cache, pos, allowed)
        return h

    out: dict = {"fmt": fmt, "T": T, "layers": layers,
                 "weight_bytes_per_layer": sum(w.nbytes for w in _layer_weights(model.layers[0]))}
    results = {}
    before, branches_before = gb.gemv_kernels, gb.graph_branches
    gb.graph_branches = False     # the versions' rows one chain of nodes; the "branches" row turns them on itself
    try:
        for ver in versions:
            gb.gemv_kernels = ver
            gb.step = st
            try:
                eager = rt.to_host(body())                                    # compiles, sizes scratch; reference
                # the same body captured twice: ordinary edges, programmatic (PDL)
                graphs = {pdl: _capture(rt, body, pdl) for pdl in (False, True)}
                if ver == versions[0]:          # and once with the shared expert on a second branch of the graph
                    branched = _capture_branched(gb, body)
            finally:
                gb.step = None
            replays = {}
            for pdl, (g, y) in graphs.items():
                g.launch(rt)
                replays[pdl] = rt.to_host(y)
            g, g1 = graphs[False][0], graphs[True][0]
            results[ver] = replay = replays[False]
            # interleaved (off, on, off, on): a clock or thermal drift during the run does not favour either
            us, us_p = (tm.per_call_us(lambda i: gr.launch(rt), iters) / layers for gr in (g, g1))
            us2, us2_p = (tm.per_call_us(lambda i: gr.launch(rt), iters) / layers for gr in (g, g1))
            out[ver] = {"us_per_layer": round(us, 2), "us_per_layer_repeat": round(us2, 2), "graph_nodes": g.nodes,
                        "replay_equals_eager": bool(np.array_equal(replay, eager)),
                        "finite": bool(np.isfinite(replay).all()),
                        "pdl": {"us_per_layer": round(us_p, 2), "us_per_layer_repeat": round(us2_p, 2),
                                "edges": g1.pdl_edges, "replay_equals_eager": bool(np.array_equal(replays[True], eager)),
                                "saved_us_per_layer": round((us + us2 - us_p - us2_p) / 2, 2)}}
            if ver == versions[0]:
                out[ver]["branches"] = _time_branched(rt, tm, branched, eager, iters, layers, g)
            for gr in (g, g1):
                gr.close()
        if outputs is not None:
            outputs.update(results)
        ref = results[versions[-1]].astype(np.float64)
        for ver in versions:
            out[ver]["rel_diff_vs_" + versions[-1]] = float(np.linalg.norm(results[ver] - ref) / np.linalg.norm(ref))
        if not per_kernel:
            return out
        # the default version's kernels one by one, in their place in the sequence
        gb.gemv_kernels = versions[0]
        log = LaunchLog(gb)
        gb.step = st
        try:
            body()
        finally:
            gb.step = None
            log.remove()
        rt.synchronize()
        first = [L for L in log.launches]
        times = time_launches(rt, tm, first)
        nl = len(first) // layers
        out["kernels"] = [{"op": L["op"], "kernel": L["kernel"], "grid": list(L["grid"]), "us": round(t, 2),
                           "bytes": L["bytes"]} for L, t in zip(first[:nl], times[:nl])]
        out["kernels_us_sum_per_layer"] = round(sum(times) / layers, 2)
    finally:
        gb.gemv_kernels, gb.graph_branches = before, branches_before
    return out


def _capture(rt, body, pdl: bool = False):
    """body() captured into one CUDA graph -> (graph, body's output); a failure leaves no capture open."""
    rt.begin_capture()
    try:
        y = body()
        return rt.end_capture(pdl=pdl), y
    except BaseException:
        rt.abort_capture()
        raise


def _capture_branched(gb, body):
    """body captured with the graph branches on (gb.graph_branches, what COLI_GRAPH_BRANCHES=1, the default, sets:
    each MoE layer's shared expert beside the router, the absorbed queries beside the cache write and the indexer)
    -> (graph, output) or the error's text."""
    before, gb.graph_branches = gb.graph_branches, True
    try:
        return _capture(gb.rt, body)
    except Exception as e:      # noqa: BLE001 -- reported in the row, the other rows stand
        return f"{type(e).__name__}: {e}"[:300]
    finally:
        gb.graph_branches = before


def _time_branched(rt, tm, branched, eager, iters: int, layers: int, chain) -> dict:
    """The branched graph's GPU time per layer against the one-chain graph's, timed interleaved (chain, branched,
    chain, branched: a drift favours neither), and its replay against the eager step (bit for bit: the same
    kernels)."""
    if isinstance(branched, str):
        return {"error": branched}
    g, y = branched
    try:
        g.launch(rt)
        same = bool(np.array_equal(rt.to_host(y), eager))
        t = [tm.per_call_us(lambda i: gr.launch(rt), iters) / layers for gr in (chain, g, chain, g)]
        return {"us_per_layer": round((t[1] + t[3]) / 2, 2), "chain_us_per_layer": round((t[0] + t[2]) / 2, 2),
                "graph_nodes": g.nodes, "replay_equals_eager": same,
                "saved_us_per_layer": round((t[0] + t[2] - t[1] - t[3]) / 2, 2)}
    finally:
        g.close()


def _layer_weights(lw) -> list:
    from coli.gpu.cuda_weights import QWeight
    a = lw.attn
    ws = [a.q_a, a.q_b, a.kv_a, a.w_kb.w, a.o, a.idx_wq_b, a.idx_wk, a.idx_weights, lw.router, lw.shared_gate,
          lw.shared_up, lw.shared_down]
    return [w for w in ws if isinstance(w, QWeight)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--sets", type=int, default=24, help="distinct groups of 8 experts the decode rotates over")
    ap.add_argument("--json-out", type=Path)
    ap.add_argument("--dense-16k", action="store_true", help="also time attention over all 16,384 keys (no DSA)")
    ap.add_argument("--dense-only", action="store_true",
                    help="only the copy, the dense GEMVs and the attention rows (skip the MoE and the other kernels)")
    ap.add_argument("--prefill-only", action="store_true",
                    help="only the copy and the prefill rows (int4 and int8 GEMMs, the grouped MoE; fp32 v1 against "
                         "the tensor cores)")
    ap.add_argument("--pf-variants", action="store_true",
                    help="with --prefill-only: also the tensor-core MoE prefill rebuilt with other PF_MINB / PF_STAGES")
    ap.add_argument("--attn-only", action="store_true", help="only the copy and the attention rows")
    ap.add_argument("--indexer-only", action="store_true",
                    help="only the copy and the prefill indexer rows (indexer_scores v1 against indexer_scores_rows)")
    ap.add_argument("--dense-layer-only", action="store_true",
                    help="only the copy, the dense GEMVs and the whole dense layer replayed as a CUDA graph")
    ap.add_argument("--layer-T", type=int, default=2048, help="cache length of the dense layer row")
    ap.add_argument("--moe-compare", type=Path, help=argparse.SUPPRESS)   # the child process of section 2
    a = ap.parse_args()
    if a.moe_compare:
        return moe_compare(a, a.moe_compare)

    from coli.container.format import RecordLayout
    from coli.model.backend import cos_sin_table
    from coli.gpu import attention_split
    from coli.gpu.cuda_backend import CudaBackend, DeviceMask
    from coli.gpu.cuda_weights import DeviceRecord, HeadView, QWeight

    gb = CudaBackend()
    rt = gb.rt
    tm = Timer(rt, spin=True)
    rng = np.random.default_rng(0)
    rows: list[dict] = []
    res: dict = {"device": rt.name, "sm": f"{rt.cc[0]}{rt.cc[1]}", "sms": rt.sm_count}

    def add(name, us, nbytes=None, note=""):
        r = {"kernel": name, "us": round(us, 2)}
        if nbytes:
            r["GBps"] = round(nbytes / us / 1e3, 1)
        if note:
            r["note"] = note
        rows.append(r)
        return r

    # ---- 1. device-to-device copy -----------------------------------------------------------------------
    n = 1 << 30
    src, dst = rt.alloc(n), rt.alloc(n)
    rt.copy(int(src), int(dst), n)   # touch
    copy_us = tm.per_call_us(lambda i: rt.copy(int(dst), int(src), n), 10)
    copy_bw = 2 * n / copy_us / 1e3   # GB/s, read + write
    res["d2d_copy_GBps"] = round(copy_bw, 1)
    add("d2d copy 1 GiB (read+write)", copy_us, 2 * n)
    del src, dst
    if a.prefill_only:
        prefill_bench(gb, tm, rng, res, add, variants=a.pf_variants)
    if a.prefill_only or a.indexer_only:
        indexer_bench(gb, tm, rng, res, add)
    if a.indexer_only:
        return _report(a, res, rows, copy_bw, rt)

    if a.dense_layer_only:
        a.dense_only = True
    if not (a.dense_only or a.attn_only or a.prefill_only):    # --dense-only: the copy, the GEMVs, attention
        # ---- 2. fused MoE decode at GLM-5's expert shape, int4 g64: every kernel version (v1, v2, mma) --------------
        # Measured in a child process (moe_compare below), so that a new kernel that faults or hangs cannot take the
        # rest of this benchmark down with it; if the default fails there, this process uses the newest that passed.
        cmp_res = run_moe_compare(a)
        res["moe_compare"] = cmp_res
        lay = RecordLayout.make(H, IM, "int4", 64, 512)
        want = gb._moe_version(lay, K)        # what the backend's default picks for this launch
        ok = [v for v in VERSIONS if cmp_res.get(v, {}).get("ok", False)]
        use = want if want in ok else (ok[-1] if ok else "v1")
        if use != want:
            print(f"!! moe {want} kernels failed in the comparison "
                  f"({cmp_res.get(want, {}).get('error', cmp_res.get('error'))}); the rest of this benchmark"
                  f" uses {use}", flush=True)
            gb.moe_kernels = use
        best = cmp_res.get(use, {})
        lay = RecordLayout.make(H, IM, "int4", 64, 512)
        gu_bytes = K * (lay.gate.nbytes + lay.up.nbytes) + 4 * (H + K * IM)
        dn_bytes = K * lay.down.nbytes + 4 * (K * IM + H)
        for ver in VERSIONS:
            v = cmp_res.get(ver, {})
            tag = f"{ver}{'' if v.get('ok') else ' FAILED'}"
            for key, label, nb in (("gateup_us", "moe_gateup_int4  8 x (2 x 2048 x 6144) g64", gu_bytes),
                                   ("down_us", "moe_down_int4    8 x 6144 x 2048 g64", dn_bytes),
                                   ("layer_us", "moe decode layer (gate/up + down)", gu_bytes + dn_bytes)):
                if v.get(key):
                    r = add(f"{label} [{tag}]", v[key], nb)
                    r["of_copy"] = f"{100 * r['GBps'] / copy_bw:.0f}%"
        if best.get("layer_us"):
            res.update(moe_kernels=use,
                       moe_gateup_us=best["gateup_us"], moe_down_us=best["down_us"], moe_layer_us=best["layer_us"],
                       moe_gateup_GBps=round(gu_bytes / best["gateup_us"] / 1e3, 1),
                       moe_down_GBps=round(dn_bytes / best["down_us"] / 1e3, 1),
                       moe_layer_GBps=round((gu_bytes + dn_bytes) / best["layer_us"] / 1e3, 1),
                       moe_bytes_per_layer=gu_bytes + dn_bytes)
            for k in ("gateup", "down", "layer"):
                res[f"moe_{k}_frac"] = round(res[f"moe_{k}_GBps"] / copy_bw, 3)

        # records for the moe() op below (the kernels the backend now launches)
        host_recs, pool, nrec = record_pool(rt, lay, a.sets * K, rng)
        x = gb.upload((rng.standard_normal((1, H)) * 1.0).astype(F32))

        # the whole moe() op (host: table upload, grouping; device: the same two launches)
        recs = {e: DeviceRecord(int(pool) + e * lay.nbytes, lay) for e in range(nrec)}
        routes = [np.array([[s * K + k for k in range(K)]], np.int64) for s in range(a.sets)]
        wh = rng.uniform(0.1, 0.5, (1, K)).astype(F32)

        def moe_op(i):
            ids = routes[i % a.sets]
            gb.moe(x, ids, wh, ((int(e), recs[int(e)]) for e in ids[0]))
        t0 = time.perf_counter()
        for i in range(50):
            moe_op(i)
        rt.synchronize()
        add("moe() op, one token (host + device)", (time.perf_counter() - t0) / 50 * 1e6, gu_bytes + dn_bytes,
            "wall clock incl. Python")

        # the decode layer per number of experts in one launch (streaming submits partial batches: VRAM hits first,
        # then misses as they land), scalar v2 against the tensor-core kernels forced on (GPU time)
        per_k = {}
        xk = gb.upload(rng.standard_normal((1, H)).astype(F32))
        wk = gb.upload(np.full(MOE_K_MAX, 0.125, F32))
        yk = gb.empty((1, H))
        for k in range(1, MOE_K_MAX + 1):
            ktabs = [rt.to_device(np.array([int(pool) + ((s * K + j) % nrec) * lay.nbytes for j in range(k)], np.uint64))
                     for s in range(a.sets)]
            row = {}
            for ver in ("v2", "mma"):
                sc = gb.moe_scratch(lay, k, version=ver)
                if sc.version != ver:
                    continue
                row[ver] = round(tm.per_call_us(
                    lambda i, sc=sc: (gb.moe_gateup(sc, ktabs[i % a.sets].ptr, xk.ptr),
                                      gb.moe_down(sc, ktabs[i % a.sets].ptr, wk.ptr, yk.ptr, False)), a.iters), 2)
            row["auto"] = gb._moe_version(lay, k, "auto")
            per_k[k] = row
            print(f"moe decode layer, K = {k}: {row}", flush=True)
        res["moe_layer_us_per_k"] = per_k
        del pool

    # ---- 3. other kernels at GLM-5 shapes ---------------------------------------------------------------------
    if a.prefill_only:
        return _report(a, res, rows, copy_bw, rt)

    def qw(rows_, cols_, fmt, group=64):
        b, l = random_matrix_bytes(rows_, cols_, fmt, group, rng)
        from coli.gpu.cuda_weights import upload_stored
        return upload_stored(rt, b, l, (rows_, cols_), "bench")

    def dev_copy(w):
        """The same stored matrix at another device address (a device-to-device copy)."""
        buf = rt.alloc(w.nbytes)
        rt.copy(int(buf), w.ptr, w.nbytes)
        return QWeight(int(buf), w.layout, w.shape, buf)

    def arr_copies(x, n):
        """x and n - 1 device copies of it (DeviceArrays at other addresses)."""
        out = [x]
        for _ in range(n - 1):
            y = rt.empty(x.shape, x.dtype)
            rt.copy(y.ptr, x.ptr, x.nbytes)
            out.append(y)
        return out

    x1 = gb.upload(rng.standard_normal((1, H)).astype(F32))
    # the dense decode GEMVs, both versions (gemv_<fmt> v1, gemv2_<fmt> v2: cuda_backend.GEMV_KERNELS); each
    # matrix rotates over copies totalling > 120 MB so that L2 (60 MB) never holds the previous call's weights
    gemv_res = res["gemv"] = {}
    from coli.gpu.cuda_backend import gemv2_split
    for name, (r_, c_, fmt) in {} if a.attn_only else {"q_a_proj": (2048, H, "int4"), "kv_a_proj": (576, H, "int8"),
                                "q_b_proj": (16384, 2048, "int4"), "o_proj": (H, 16384, "int4"),
                                "shared gate (int4)": (2048, H, "int4"), "router (f32)": (256, H, "f32")}.items():
        w = qw(r_, c_, fmt)
        ncopy = max(2, -(-(120 << 20) // w.nbytes))
        ws_ = [w] + [dev_copy(w) for _ in range(ncopy - 1)]
        xin = gb.upload(rng.standard_normal((1, c_)).astype(F32))
        nb = w.nbytes + 4 * (c_ + r_)
        row = gemv_res[name] = {"bytes": nb, "ks": gemv2_split(r_, w.layout.row_data_bytes // 16, 2 * rt.sm_count)}
        for ver in ("v1", "v2"):
            gb.gemv_kernels = ver
            us = tm.per_call_us(lambda i: gb.linear(xin, ws_[i % ncopy]), a.iters)
            r = add(f"gemv {name} {r_}x{c_} {fmt} [{ver}]", us, nb)
            r["of_copy"] = f"{100 * r['GBps'] / copy_bw:.0f}%"
            row[ver] = {"us": r["us"], "frac": round(r["GBps"] / copy_bw, 3)}
        row["us_by_ks"] = ks_sweep(gb, tm, lambda i: gb.linear(xin, ws_[i % ncopy]), a.iters)
        gb.gemv_kernels = "v2"
        del ws_
    # the projections of a decode layer that read one input, int8 and int4 dense cores: each in its own gemv2 launch
    # (v2) against one gemv2x launch (v3), same run; the sets rotate over copies > 120 MB as above
    fused_res = res["gemv_fused"] = {}
    for fmt in () if a.attn_only else ("int8", "int4"):
        for name, cols, shapes in (("q_a|kv_a|wk", H, (2048, 576, 128)), ("q_b|wq_b", 2048, (16384, 4096))):
            ws0 = [qw(r_, cols, fmt) for r_ in shapes]
            nb = sum(w.nbytes for w in ws0) + 4 * (cols + sum(shapes))
            ncopy = max(2, -(-(120 << 20) // nb))
            sets = [ws0] + [[dev_copy(w) for w in ws0] for _ in range(ncopy - 1)]
            xin = gb.upload(rng.standard_normal((1, cols)).astype(F32))
            row = fused_res[f"{name} {fmt}"] = {"bytes": nb}
            for ver in ("v2", "v3"):
                gb.gemv_kernels = ver
                # spin 300 us per call: v2's three launches and allocations take the host ~60 us (the first run's
                # 50 us timed the host, 62 us for q_a | kv_a | wk)
                us = tm.per_call_us(lambda i: gb.linear_many(xin, sets[i % ncopy]), a.iters, spin_us=300)
                r = add(f"gemv {name} {fmt} ({len(shapes)} matrices) [{ver}]", us, nb)
                r["of_copy"] = f"{100 * r['GBps'] / copy_bw:.0f}%"
                row[ver] = {"us": r["us"], "frac": round(r["GBps"] / copy_bw, 3)}
            row["us_by_ks"] = ks_sweep(gb, tm, lambda i: gb.linear_many(xin, sets[i % ncopy]), a.iters)
            del sets
    # the whole dense part of a decode layer replayed as a CUDA graph, int8 and int4 dense cores, T = --layer-T
    layer_res = res["dense_layer"] = {}
    for fmt in () if a.attn_only else ("int8", "int4"):
        try:
            layer_res[fmt] = dense_layer_bench(gb, tm, fmt, a.layer_T, a.iters)
        except Exception as e:      # noqa: BLE001 -- report and keep what was measured
            import traceback
            traceback.print_exc()
            layer_res[fmt] = {"error": f"{type(e).__name__}: {e}"[:500]}
        print(f"dense layer {fmt}: {json.dumps({k: v for k, v in layer_res[fmt].items() if k != 'kernels'})}",
              flush=True)
    if a.dense_layer_only:
        return _report(a, res, rows, copy_bw, rt)
    if not (a.dense_only or a.attn_only):
        lm = qw(V, H, "int4")
        us = tm.per_call_us(lambda i: gb.linear(x1, lm), 5)
        add(f"lm_head gemv {V}x{H} int4", us, lm.nbytes)
        logits = gb.linear(x1, lm)
        us = tm.per_call_us(lambda i: gb.argmax(logits), 5)
        add("argmax over 154880 (incl. D2H of the index)", us)
        del lm
        sg, su, sd = qw(2048, H, "int4"), qw(2048, H, "int4"), qw(H, 2048, "int4")
        us = tm.per_call_us(lambda i: gb.swiglu(x1, sg, su, sd), a.iters)
        add("shared expert swiglu (fused, 2 launches)", us, sg.nbytes + su.nbytes + sd.nbytes)

    nh, dn, dr, dv, L = 64, 192, 64, 256, 512
    kvb = qw(nh * (dn + dv), L, "int8")
    w_kb, w_vb = HeadView(kvb, 0, dn + dv, dn, nh), HeadView(kvb, dn, dn + dv, dv, nh)
    attn = res["mla_attend"] = {}     # per case: every version's whole-op us, the parts, the chunk sweeps
    # kv_b and the cache rotate over copies (> 120 MB each) so that every call reads them from HBM, as a decode step
    # does after the other layers' weights went through L2
    NKV = 9
    kvbs = [kvb] + [dev_copy(kvb) for _ in range(NKV - 1)]
    heads = [(HeadView(k, 0, dn + dv, dn, nh), HeadView(k, dn, dn + dv, dv, nh)) for k in kvbs]
    for T in (2048, 16384):
        ncache = max(2, -(-(120 << 20) // (4 * T * (L + dr))))
        lats = arr_copies(gb.upload(rng.standard_normal((T, L)).astype(F32)), ncache)
        kpes = arr_copies(gb.upload(rng.standard_normal((T, dr)).astype(F32)), ncache)
        lat, kpe = lats[0], kpes[0]
        q = gb.upload(rng.standard_normal((1, nh, dn + dr)).astype(F32))
        ih, ihd = 32, 128
        iq = gb.upload(rng.standard_normal((1, ih, ihd)).astype(F32))
        kid = gb.upload(rng.standard_normal((T, ihd)).astype(F32))
        hw = gb.upload(rng.standard_normal((1, ih)).astype(F32))
        pos = np.array([T - 1])
        us = tm.per_call_us(lambda i: gb.indexer_select(iq, kid, hw, pos, 2048), a.iters)
        add(f"indexer scores + top-2048 decode T={T}", us, 4 * T * ihd)
        cases = {"dense": (DeviceMask(1, T, T - 1), T), "top-2048": (gb.indexer_select(iq, kid, hw, pos, 2048), 2048)}
        for cname, (mask, nkeys) in cases.items():
            if T == 16384 and cname == "dense" and not a.dense_16k:
                continue
            c = attn[f"T={T} {cname}"] = {}
            nb = kvb.nbytes + 4 * nkeys * (L + dr)
            for ver in ATTN_BENCH_VERSIONS:
                gb.attn_kernels = ver
                us = tm.per_call_us(lambda i: gb.mla_attend(q, lats[i % ncache], kpes[i % ncache], *heads[i % NKV],
                                                            mask, 1 / 16), a.iters, spin_us=400)
                add(f"mla_attend decode T={T} {cname} [{ver}]", us, nb)
                c[ver] = round(us, 2)
            # the context alone (part + combine) of every split version, and each one's result against split2's
            qa_in = gb.upload(rng.standard_normal((1, nh, L)).astype(F32) * 0.05)
            core_v, err_v = c["core_us_by_version"], c["ctx_rel_err_vs_split2"] = {}, {}
            ref = None
            for ver in ("split2",) + tuple(v for v in ATTN_BENCH_VERSIONS if v not in ("v1", "split2")):
                gb.attn_kernels = ver
                core_v[ver] = round(tm.per_call_us(lambda i: gb.attend_core(
                    qa_in, q, dn, lats[i % ncache], kpes[i % ncache], mask, 1 / 16), a.iters, spin_us=200), 2)
                got = gb.to_host(gb.attend_core(qa_in, q, dn, lat, kpe, mask, 1 / 16)).astype(np.float64)
                ref = got if ref is None else ref
                err_v[ver] = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
            c["core_split1_us"] = core_v["split1"]
            gb.attn_kernels = "auto"
            # the default op's three parts: q_abs (mla_qabs), the split context (tile2 + combine4), o (mla_o); and the
            # projections as split2 runs them (gemv_t, gemv over heads)
            q_abs, ctx, o = gb.empty((1, nh, L)), gb.empty((1, nh, L)), gb.empty((1, nh * dv))
            c["q_abs_us"] = round(tm.per_call_us(lambda i: gb._mla_qabs(
                kvbs[i % NKV], 0, dn + dv, dn, nh, q.ptr, dn + dr, q_abs.ptr, L), a.iters), 2)
            c["o_us"] = round(tm.per_call_us(lambda i: gb._mla_o(
                kvbs[i % NKV], dn, dn + dv, dv, nh, ctx.ptr, L, o.ptr, dv), a.iters), 2)
            c["q_abs_gemv_t_us"] = round(tm.per_call_us(lambda i: gb._gemv_t(
                kvbs[i % NKV], 0, dn + dv, dn, nh, q.ptr, dn + dr, q_abs.ptr, L), a.iters), 2)
            c["o_gemv_us"] = round(tm.per_call_us(lambda i: gb._gemv(
                kvbs[i % NKV], dn, dn + dv, dv, nh, ctx.ptr, L, o.ptr, dv), a.iters), 2)

            def core(i):
                gb.attend_core(q_abs, q, dn, lats[i % ncache], kpes[i % ncache], mask, 1 / 16)
            c["core_us"] = round(tm.per_call_us(core, a.iters, spin_us=200), 2)
            c["chunk"] = list(attention_split.split_chunks(nkeys, 1, nh, L, rt.sm_count))
            # each tile version's context, its two launches apart (part into fixed partials; the combine over them);
            # part_only_us / combine_only_us: the default's (tile3, what "auto" takes where it fits)
            parts = c["parts_by_version"] = {}
            for ver in ATTN_TILE_VERSIONS:
                gb.attn_kernels = ver
                try:
                    AS = attention_split
                    ch, nchk = c["chunk"]
                    fp, thr, smem, comb_name, cthr = gb._split_kernels(L, dr, 16)
                    pm_, pl_, pc_ = gb.empty((1, nh, nchk)), gb.empty((1, nh, nchk)), gb.empty((1, nh, nchk, L))
                    idx_ = mask.idx.ptr if mask.idx is not None else 0
                    cnt_ = mask.cnt.ptr if mask.cnt is not None else 0
                    pv = parts[ver] = {"smem": smem}     # tells the kernel taken (tile3 222,336 B, tile2 128,896 B)
                    pv["part_us"] = round(tm.per_call_us(lambda i: rt.launch(
                        fp, (nchk, AS.head_groups(nh), 1), thr, q_abs.ptr, q.ptr, dn + dr, dn, lats[i % ncache].ptr,
                        kpes[i % ncache].ptr, idx_, cnt_, mask.kmax, mask.start, 0, 1, nh, L, dr, F32(1 / 16), ch,
                        nchk, pm_.ptr, pl_.ptr, pc_.ptr, smem=smem), a.iters, spin_us=200), 2)
                    fc = gb._fn("attention", comb_name)
                    pv["combine"] = comb_name
                    pv["combine_us"] = round(tm.per_call_us(lambda i: rt.launch(
                        fc, AS.combine_grid(comb_name, L, nh, 1), cthr, pm_.ptr, pl_.ptr, pc_.ptr, idx_, cnt_, mask.start, 0, 1, nh, L, ch, nchk,
                        ctx.ptr), a.iters, spin_us=200), 2)
                except Exception as e:   # a diagnostic row: never the rest of the benchmark
                    parts.setdefault(ver, {})["error"] = repr(e)[:300]
            c["part_only_us"] = parts.get("tile3", {}).get("part_us")
            c["combine_only_us"] = parts.get("tile3", {}).get("combine_us")
            if "error" in parts.get("tile3", {}):
                c["parts_error"] = parts["tile3"]["error"]
            for ver in ATTN_TILE_VERSIONS:           # the chunk sweep of every tile kernel
                gb.attn_kernels = ver
                sweep = c["core_us_by_chunk" if ver == "tile2" else f"core_us_by_chunk_{ver}"] = {}
                for ch in (16, 32, 64, 128, 256, 512):
                    gb.attn_chunk = ch
                    sweep[ch] = round(tm.per_call_us(core, a.iters, spin_us=200), 2)
            gb.attn_chunk, gb.attn_kernels = None, "auto"
            print(f"mla_attend T={T} {cname}: {json.dumps(c)}", flush=True)
        gb.attn_kernels = "auto"
        del lat, kpe, kid, lats, kpes
    del kvbs, heads
    if not (a.dense_only or a.attn_only):
        rw = qw(256, H, "f32")
        bias = gb.upload(rng.standard_normal(256).astype(F32) * 0.01)
        t0 = time.perf_counter()
        for i in range(50):
            gb.route(x1, rw, bias, 1, 1, 8, True, 2.5)
        add("route (gemv + top-8 + D2H sync)", (time.perf_counter() - t0) / 50 * 1e6, None, "wall clock incl. sync")
        nw = gb.upload(np.ones(H, F32))
        us = tm.per_call_us(lambda i: gb.rms_norm(x1, nw, 1e-5), a.iters)
        add("rmsnorm 1 x 6144", us)
        qq = gb.upload(rng.standard_normal((1, nh, dn + dr)).astype(F32))
        cos, sin = cos_sin_table([100], dr, 1e6)
        us = tm.per_call_us(lambda i: gb.rope(qq, cos, sin, dn), a.iters)
        add("rope q 64 heads", us)
        prefill_bench(gb, tm, rng, res, add)
        indexer_bench(gb, tm, rng, res, add)

    return _report(a, res, rows, copy_bw, rt)


def _report(a, res, rows, copy_bw, rt) -> int:
    # ---- report ------------------------------------------------------------------------------------------------
    res["kernels"] = rows
    w = max(len(r["kernel"]) for r in rows)
    print(f"\nGPU kernels on {res['device']} (sm_{res['sm']}, {res['sms']} SMs)")
    print(f"{'kernel':<{w}}  {'us':>10}  {'GB/s':>8}  {'of copy':>7}  note")
    for r in rows:
        print(f"{r['kernel']:<{w}}  {r['us']:>10.2f}  {r.get('GBps', ''):>8}  {r.get('of_copy', ''):>7}  "
              f"{r.get('note', '')}")
    cmp_res = res.get("moe_compare", {})
    summary: list[str] = []          # the MoE lines, also kept in the JSON (gpu_suite.sh prints them)

    def say(text: str) -> None:
        summary.append(text.strip("\n"))
        print(text)

    if cmp_res:                      # (absent with --dense-only)
        say(f"\nfused MoE decode, 8 experts int4 g64 (GLM-5), every kernel version, same run "
            f"(child's copy {cmp_res.get('d2d_copy_GBps')} GB/s; target: layer >= 60% of the copy, <= ~63 us):")
        for ver in VERSIONS:
            v = cmp_res.get(ver, {})
            if v.get("layer_us"):
                say(f"  {ver}: gate/up {v['gateup_us']:.1f} us ({100 * v['gateup_frac']:.1f}%), down {v['down_us']:.1f} us "
                    f"({100 * v['down_frac']:.1f}%), layer {v['layer_us']:.1f} us ({100 * v['layer_frac']:.1f}%; "
                    f"repeat {v['layer_us_repeat']:.1f} us)  rel err h {v.get('gateup_rel_err', float('nan')):.1e} "
                    f"y {v.get('down_rel_err', float('nan')):.1e}  {'ok' if v.get('ok') else 'WRONG'}")
            else:
                say(f"  {ver}: FAILED {v.get('error', '')} {json.dumps(v)[:300]}")
        v1 = cmp_res.get("v1", {})
        for ver in VERSIONS[1:]:
            v = cmp_res.get(ver, {})
            if v1.get("layer_us") and v.get("layer_us"):
                say(f"  speed-up {ver}/v1: gate/up {v1['gateup_us'] / v['gateup_us']:.2f}x, down "
                    f"{v1['down_us'] / v['down_us']:.2f}x, layer {v1['layer_us'] / v['layer_us']:.2f}x")
        if "moe_layer_GBps" in res:
            say(f"fused MoE decode ({res['moe_kernels']}, gate/up + down): {res['moe_layer_GBps']} GB/s = "
                f"{100 * res['moe_layer_frac']:.1f}% of the {res['d2d_copy_GBps']} GB/s device copy (target >= 60%)")
    res["moe_summary"] = summary
    att = res.get("mla_attend", {})
    if att:
        print("\nmla_attend decode (64 heads, Lkv 512, rope 64, int8 kv_b; target <= 40 us), every version, same run:")
        for k, c in att.items():
            print(f"  {k}: " + " -> ".join(f"{v} {c[v]:.1f}" for v in ATTN_BENCH_VERSIONS)
                  + f" us ({c['v1'] / c['tile3']:.1f}x v1, {c['split2'] / c['tile3']:.2f}x split2; tile3 (the default) "
                  f"{'meets' if c['tile3'] <= 40 else 'misses'} 40 us); default's parts: q_abs "
                  f"{c['q_abs_us']:.1f} (gemv_t {c['q_abs_gemv_t_us']:.1f}), context {c['core_us']:.1f}, "
                  f"o {c['o_us']:.1f} (gemv {c['o_gemv_us']:.1f})")
            print(f"    context's launches apart: part {c.get('part_only_us')} us, combine "
                  f"{c.get('combine_only_us')} us{' ' + c['parts_error'] if 'parts_error' in c else ''}")
            print(f"    context by version {c['core_us_by_version']} (rel err vs split2 "
                  f"{ {v: f'{e:.1e}' for v, e in c['ctx_rel_err_vs_split2'].items()} }); by chunk: tile2 "
                  f"{c['core_us_by_chunk']}, tile1 {c['core_us_by_chunk_tile1']}, tile3 {c['core_us_by_chunk_tile3']}")
            for ver, pv in c.get("parts_by_version", {}).items():
                print(f"    {ver} context apart: part {pv.get('part_us')} us, combine "
                      f"{pv.get('combine_us')} us ({pv.get('combine')}; part smem {pv.get('smem')} B){' ' + pv['error'] if 'error' in pv else ''}")
    gv = res.get("gemv", {})
    if gv:
        print("dense decode GEMVs, fraction of the device copy (target >= 50%), v1 -> v2:")
        for k, g in gv.items():
            print(f"  {k}: {g['v1']['us']:.1f} us ({100 * g['v1']['frac']:.0f}%) -> {g['v2']['us']:.1f} us "
                  f"({100 * g['v2']['frac']:.0f}%), ks {g['ks']}; us by ks {g.get('us_by_ks')}")
    fz = res.get("gemv_fused", {})
    if fz:
        print("dense GEMVs that read one input, separate launches (v2) -> one gemv2x launch (v3), fraction of the copy:")
        for k, g in fz.items():
            print(f"  {k}: {g['v2']['us']:.1f} us ({100 * g['v2']['frac']:.0f}%) -> {g['v3']['us']:.1f} us "
                  f"({100 * g['v3']['frac']:.0f}%); us by ks {g.get('us_by_ks')}")
    dl = res.get("dense_layer", {})
    for fmt, d in dl.items():
        if "error" in d:
            print(f"dense layer {fmt}: FAILED {d['error']}")
            continue
        print(f"\ndense part of a decode layer, {fmt} core, T = {d['T']}, replayed as a CUDA graph ({d['layers']} layers "
              f"per graph), GPU time per layer (target <= 120 us); weights {d['weight_bytes_per_layer'] / 1e6:.1f} MB "
              f"= {d['weight_bytes_per_layer'] / copy_bw / 1e3:.1f} us at the copy rate:")
        for ver in ("v3", "v2", "v1"):
            v = d.get(ver)
            if v:
                print(f"  gemv {ver}: {v['us_per_layer']:.1f} us (repeat {v['us_per_layer_repeat']:.1f}), "
                      f"{v['graph_nodes']} nodes, replay == eager {v['replay_equals_eager']}, "
                      f"rel diff vs v1 {v.get('rel_diff_vs_v1', float('nan')):.1e}")
                p = v.get("pdl")
                if p:
                    print(f"    with PDL ({p['edges']} kernel->kernel edges programmatic): {p['us_per_layer']:.1f} us "
                          f"(repeat {p['us_per_layer_repeat']:.1f}), saves {p['saved_us_per_layer']:.1f} us per layer, "
                          f"replay == eager {p['replay_equals_eager']}")
        print(f"  its kernels one by one (v3, events between them; sum {d['kernels_us_sum_per_layer']:.1f} us per layer):")
        for k in d["kernels"]:
            bw = f"{k['bytes'] / k['us'] / 1e3 / copy_bw * 100:.0f}% of copy" if k["bytes"] and k["us"] > 0 else ""
            print(f"    {k['op']:<15} {k['kernel']:<24} grid {str(k['grid']):<16} {k['us']:7.2f} us  "
                  f"{k['bytes'] / 1e6:7.2f} MB  {bw}")
    line = json.dumps(res)
    if a.json_out:
        a.json_out.write_text(line + "\n")
    print(line)
    return 0


def prefill_bench(gb, tm, rng, res: dict, add, variants: bool = False) -> None:
    """The prefill rows, the fp32 tiled GEMMs (v1) against the tensor cores (mma) in the same run: the dense int4
    GEMM at GLM-5's q_a (2048 x 6144 g64) and o_proj (6144 x 16384 g128) shapes and the int8 one (pf_linear_int8) at
    q_a's, q_b's (16384 x 2048) and o_proj's for S = 512 and 2,048, and the
    grouped MoE prefill of a 2,048-token prompt over 256 GLM-5 experts (top-8: ~64 pairs per expert; ~1.24 TFLOP).
    Effective TFLOP/s counts 2 flops per weight x token (not the four int8 parts the tensor cores multiply).
    The MoE rows time the whole moe() op (host: sorting the pairs; the spin covers it, so the figure is GPU time)."""
    from coli.container.format import RecordLayout
    from coli.gpu.cuda_weights import DeviceRecord, upload_stored
    from tests.gpu_helpers import rel_err
    out = res.setdefault("prefill", {})
    saved = gb.prefill_kernels
    gb.prefill_int8 = True          # the int8 rows time pf_linear_int8 (the product's default; COLI_PREFILL_INT8=0 turns it off)
    add_row = add

    def add(*args, **kw):          # every row printed as it lands (a run cut short still shows what it measured)
        r = add_row(*args, **kw)
        print(f"  {r['kernel']}: {r['us']:.1f} us  {r.get('note', '')}", flush=True)
        return r
    # int4 (the int4 dense core) and int8 (pf_linear_int8: coli convert's default dense core; keys gemm8_...) at
    # q_a's, q_b's and o_proj's shapes
    for fmt, rows_, cols_, group in (("int4", 2048, H, 64), ("int4", H, 16384, 128), ("int8", 2048, H, 0),
                                     ("int8", 16384, 2048, 0), ("int8", H, 16384, 0)):
        b, lay_ = random_matrix_bytes(rows_, cols_, fmt, group, rng)
        w = upload_stored(gb.rt, b, lay_, (rows_, cols_), "bench")
        key, tag = ("gemm", f"int4 g{group}") if fmt == "int4" else ("gemm8", "int8")
        for S in (512, 2048):
            xs_ = gb.upload(rng.standard_normal((S, cols_)).astype(F32))
            got = {}
            for ver in ("v1", "mma"):
                gb.prefill_kernels = ver
                us = tm.per_call_us(lambda i: gb.linear(xs_, w), 3, spin_us=20000)
                tf = 2 * S * rows_ * cols_ / us / 1e6
                add(f"gemm prefill S={S} {rows_}x{cols_} {tag} [{ver}]", us, None, f"{tf:.2f} TFLOP/s")
                out[f"{key}_{rows_}x{cols_}_S{S}_{ver}_TFLOPs"] = round(tf, 2)
                got[ver] = gb.to_host(gb.linear(xs_, w))
            out[f"{key}_{rows_}x{cols_}_S{S}_rel_diff"] = float(rel_err(got["mma"], got["v1"]))
        del w
    # grouped MoE: 2,048 tokens, 256 experts (64 distinct records, 1.3 GB: L2 holds none of them between uses)
    lay = RecordLayout.make(H, IM, "int4", 64, 512)
    E, S = 256, 2048
    host_recs, pool, nrec = record_pool(gb.rt, lay, E, rng, n_distinct=8)
    recs = {e: DeviceRecord(int(pool) + e * lay.nbytes, lay) for e in range(E)}
    xs_ = gb.upload(rng.standard_normal((S, H)).astype(F32))
    ids = np.stack([rng.choice(E, K, replace=False) for _ in range(S)]).astype(np.int64)
    wp = rng.uniform(0.1, 0.5, (S, K)).astype(F32)
    flops = 2 * S * K * 3 * IM * H
    got = {}
    for ver in ("v1", "mma"):
        gb.prefill_kernels = ver
        us = tm.per_call_us(lambda i: gb.moe(xs_, ids, wp, ((e, recs[e]) for e in range(E))), 2, reps=3, warmup=1,
                            spin_us=150000)
        tf = flops / us / 1e6
        add(f"moe prefill S={S}, {E} experts top-{K} int4 g64 [{ver}]", us, None, f"{tf:.2f} TFLOP/s effective")
        out[f"moe_S{S}_E{E}_{ver}_TFLOPs"] = round(tf, 2)
        out[f"moe_S{S}_E{E}_{ver}_ms"] = round(us / 1e3, 2)
        got[ver] = gb.to_host(gb.moe(xs_, ids, wp, ((e, recs[e]) for e in range(E))))
    out["moe_rel_diff_mma_v1"] = float(rel_err(got["mma"], got["v1"]))
    if variants:
        prefill_variants(gb, tm, xs_, ids, wp, recs, flops, out, add)
    gb.prefill_kernels = saved
    print("prefill: " + json.dumps(out), flush=True)
    del pool


def indexer_bench(gb, tm, rng, res: dict, add, sizes=(8192, 2560)) -> None:
    """The prefill indexer's scores at GLM-5's shape (32 index heads x 128, top-2,048) after an empty cache, S = T =
    8,192 and 2,560 (an agent prompt's chunk): indexer_scores (v1: a warp per key) against indexer_scores_rows (4
    rows a block, register-tiled), one launch over every row, same run, and the whole indexer_select (scores + the
    top-k) under each setting. TFLOP/s counts 2 * ih * ihd flops per scored (row, key) pair (rows past topk, their
    visible keys: coli/gpu/indexer_rows.scored_pairs). The two kernels' scores are compared bit for bit."""
    from coli.gpu import indexer_rows
    out = res.setdefault("indexer", {})
    saved = gb.indexer_kernels
    ih, ihd, topk = 32, 128, 2048
    for S in sizes:
        T = S
        iq = gb.upload(rng.standard_normal((S, ih, ihd)).astype(F32)).reshape(S, ih, ihd)
        kid = gb.upload(rng.standard_normal((T, ihd)).astype(F32))
        hw = gb.upload(rng.standard_normal((S, ih)).astype(F32))
        flops = 2 * ih * ihd * indexer_rows.scored_pairs(S, 0, T, topk)
        sc = gb.empty((S, T))
        bits = {}
        for ver in ("v1", "rows"):
            gb.indexer_kernels = ver
            gb.rt.zero(sc.ptr, sc.nbytes)            # this version's bits below are its own writes
            name = gb._indexer_scores(iq.ptr, kid.ptr, hw.ptr, S, ih, ihd, 0, T, topk, sc.ptr)
            us = tm.per_call_us(lambda i: gb._indexer_scores(iq.ptr, kid.ptr, hw.ptr, S, ih, ihd, 0, T, topk, sc.ptr),
                                3, reps=3, warmup=1, spin_us=40000)
            tf = flops / us / 1e6
            r = add(f"indexer scores prefill S=T={S} {ih}x{ihd} [{ver}: {name}]", us, None, f"{tf:.2f} TFLOP/s")
            print(f"  {r['kernel']}: {us / 1e3:.2f} ms  {tf:.2f} TFLOP/s", flush=True)
            out[f"scores_S{S}_{ver}_ms"] = round(us / 1e3, 3)
            out[f"scores_S{S}_{ver}_TFLOPs"] = round(tf, 2)
            out[f"scores_S{S}_{ver}_kernel"] = name
            bits[ver] = gb.to_host(sc).view(np.uint32)[topk:].copy()      # rows past topk: every visible key written
            pos = np.arange(S)
            us = tm.per_call_us(lambda i: gb.indexer_select(iq, kid, hw, pos, topk), 2, reps=3, warmup=1,
                                spin_us=60000)
            add(f"indexer_select prefill S=T={S} (scores + top-{topk}) [{ver}]", us)
            out[f"select_S{S}_{ver}_ms"] = round(us / 1e3, 3)
        vis = np.arange(T)[None, :] <= np.arange(topk, S)[:, None]
        out[f"scores_S{S}_rows_equal_v1_bits"] = bool((bits["rows"][vis] == bits["v1"][vis]).all())
        if out[f"scores_S{S}_v1_ms"]:
            out[f"scores_S{S}_speedup"] = round(out[f"scores_S{S}_v1_ms"] / out[f"scores_S{S}_rows_ms"], 2)
        del iq, kid, hw, sc
    gb.indexer_kernels = saved
    print("indexer: " + json.dumps(out), flush=True)


def prefill_variants(gb, tm, xs_, ids, wp, recs, flops, out, add) -> None:
    """The tensor-core prefill rebuilt with other block shapes and register / pipeline settings (PF_ROWS x PF_TOKS,
    PF_MINB, PF_STAGES): the MoE row and the dense 2048 x 6144 GEMM at S = 2,048. scripts/pf_kernel_sweep.py sweeps
    more settings (the flush variants too) and checks each variant's bits against the default."""
    import coli.gpu.cuda_backend as cb
    from pycuda.compiler import SourceModule
    from coli.gpu.cuda_runtime import kernels_dir
    from coli.gpu.cuda_weights import upload_stored
    rt = gb.rt
    src = (kernels_dir() / "prefill_mma.cu").read_text()
    base = (cb.PF_ROWS, cb.PF_TOKS, cb.PF_STAGES, rt._modules.get("prefill_mma"))
    b, lay_ = random_matrix_bytes(2048, H, "int4", 64, np.random.default_rng(1))
    w = upload_stored(rt, b, lay_, (2048, H), "bench")
    xd = gb.upload(np.random.default_rng(2).standard_normal((2048, H)).astype(F32))
    gb.prefill_kernels = "mma"
    try:
        for rows_, toks, minb, stages in ((256, 32, 2, 3), (256, 32, 1, 3), (256, 32, 2, 4), (256, 32, 2, 2),
                                          (128, 64, 2, 3), (128, 64, 1, 3)):
            tag = f"rows{rows_}_toks{toks}_minb{minb}_stages{stages}"
            try:
                rt.use_module("prefill_mma", SourceModule(src, no_extern_c=True, include_dirs=[str(kernels_dir())],
                                                          options=["-std=c++17", f"-DPF_MINB={minb}",
                                                                   f"-DPF_STAGES={stages}", f"-DPF_ROWS={rows_}",
                                                                   f"-DPF_TOKS={toks}"]))
                cb.PF_ROWS, cb.PF_TOKS, cb.PF_STAGES = rows_, toks, stages
                us = tm.per_call_us(lambda i: gb.moe(xs_, ids, wp, ((e, recs[e]) for e in recs)), 2, reps=3,
                                    warmup=1, spin_us=150000)
                add(f"moe prefill S=2048 [mma {tag}]", us, None, f"{flops / us / 1e6:.2f} TFLOP/s")
                out[f"moe_variant_{tag}_TFLOPs"] = round(flops / us / 1e6, 2)
                us = tm.per_call_us(lambda i: gb.linear(xd, w), 3, spin_us=20000)
                add(f"gemm prefill S=2048 2048x6144 [mma {tag}]", us, None,
                    f"{2 * 2048 * 2048 * H / us / 1e6:.2f} TFLOP/s")
                out[f"gemm_variant_{tag}_TFLOPs"] = round(2 * 2048 * 2048 * H / us / 1e6, 2)
            except Exception as e:      # a variant that does not fit or build is a row, not the end of the run
                out[f"variant_{tag}_error"] = str(e)[:200]
                print(f"  variant {tag}: {str(e)[:200]}", flush=True)
    finally:
        cb.PF_ROWS, cb.PF_TOKS, cb.PF_STAGES = base[:3]
        rt.use_module("prefill_mma", base[3])


if __name__ == "__main__":
    sys.exit(main())
