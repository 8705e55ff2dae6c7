"""`coli bench stream`: decode N tokens over a GLM-5-shaped slice in several streaming scenarios and extrapolate to
GLM-5 (docs/performance.md, "coli bench stream").

Scenarios (each decodes `tokens` tokens after 2 warm-up tokens, routing replayed from the slice's stored trace by
TraceRouting; every token timed with time.perf_counter between two `rt.synchronize()`):

    warm         every expert resident in VRAM (ResidentExperts): compute-bound
    cold-ram     every expert in pinned RAM (MemoryHostTier), VramExperts with retain=False: every step misses,
                 PCIe-bound
    mapped       (row mapped-ram) the same pinned RAM mapped into the device's address space and read by the MoE
                 kernels themselves over PCIe (coli/gpu/mapped_experts.py, "zero-copy"): no copy, no slot, no
                 host in the layer; the step replayed from one CUDA graph as in warm; its tokens checked against
                 warm's
    disk         ContainerHostTier with O_DIRECT reads, retain=False: NVMe-bound
    budget       VramExperts with the VRAM slots a 16 GB (--vram-gb) GPU would give each layer of the full model,
                 over a CachedHostTier (RAM LRU) with the RAM slots --ram-gb would give, misses read with O_DIRECT;
                 run with an ORACLE pilot (layer l+1's trace experts prefetched while layer l computes) and, as
                 `budget-nospec`, without
    sync         baseline (a): cold-ram with VramExperts(sync=True): whole-record copies, the host waits for each,
                 no FLUSH (copy everything, then compute)
    peer         baseline (b): coli.bench.peer_accelerate in a subprocess (its own dict, or "not run" and why)

Extrapolation (`split_times`, `extrapolate`): a token's time T over the slice's L MoE layers is split as
    T_nomoe  = the same decode with every routed expert dropped (route override: idx -1; attention, router,
               shared expert, head: "dense"), replayed as one CUDA graph whose device time D_nomoe two events give
    dense_layer_s = (D_nomoe - head_s_slice) / L           (a layer's share of the graph: `device_split`)
    fixed_token_s = T_nomoe - D_nomoe                      (paid once per token: graph launch, read-back, host)
    moe_layer_s   = (T - T_nomoe) / L                      (the routed experts' time per MoE layer, this scenario;
                                                            warm, replayed too: (D - D_nomoe) / L)
    GLM-5 tokens/s = 1 / (fixed_token_s + 75 x moe_layer_s + 78 x dense_layer_s + head_s_full)
(Before 2026-12-01 evening the whole T_nomoe was spread over the slice's L layers -- dense_layer_s = (T_nomoe -
head_s_slice) / L, still in the JSON as dense_layer_ms_spread and used when the no-expert token runs eagerly --
which charged the per-token host time to every layer, 39 times over in a 78-layer token.)
head_s_slice is the lm_head matmul measured on its own; head_s_full scales it by 154880 / the slice's vocabulary
(a memory-bound GEMV). In the warm scenario T - T_nomoe is the MoE compute time: the "dense-layer time measured in
the warm scenario as forward time minus MoE time" is T_nomoe's share by construction. GLM-5's 3 dense layers are
counted as ordinary dense_layer_s (their dense MLP is larger than a shared expert: an underestimate of ~3 x the
difference, stated in the output).

Capacity scaling (`scale_capacity`): the full model's VRAM slots are `size_pool` at --vram-gb with the full dense
core (the slice's per-layer dense bytes x 78 + its embed/lm_head scaled to the real vocabulary), the full KV cache
(kv_bytes at 4096 positions) and the workspace; per layer = slots / 75; the slice gets floor(per_layer x L), at
least 2 x top-k (one step's demand plus staging: stated when the floor applies). RAM: floor(--ram-gb / record
slot) / 75 per layer, likewise.
"""

from __future__ import annotations

import gc
import importlib
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from coli.errors import ColiError

GLM5_MOE_LAYERS = 75
GLM5_LAYERS = 78
GLM5_VOCAB = 154880
WARMUP_TOKENS = 2
SCENARIOS = ("warm", "cold-ram", "mapped", "disk", "budget", "spec", "sync", "peer")
ROW_ORDER = ("warm", "cold-ram", "mapped-ram", "disk", "budget", "budget-nospec", "spec-ram", "spec-ram-off", "sync",
             "peer")
GB = 1e9


# ---- pure functions (tests/bench/test_stream_math.py) ---------------------------------------------------------
def parse_scenarios(text: str) -> list[str]:
    """'all' or a comma list of SCENARIOS -> the list in run order (peer first: before this process owns the GPU)."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names:
        raise ColiError("--scenario: name at least one scenario (or all)")
    if "all" in names:
        return ["peer", *[s for s in SCENARIOS if s != "peer"]]
    bad = [n for n in names if n not in SCENARIOS]
    if bad:
        raise ColiError(f"--scenario {','.join(bad)}: not known (choose from {', '.join(SCENARIOS)} or all)")
    return [s for s in ("peer", *SCENARIOS[:-1]) if s in names]


def split_times(token_s: float, nomoe_token_s: float, n_layers: int, head_s: float) -> tuple[float, float]:
    """(moe_layer_s, dense_layer_s) from a token's time, the no-routed-expert token's time, the slice's MoE layer
    count and the head's time (negative differences, i.e. noise, clamp to 0)."""
    if n_layers < 1:
        raise ValueError("n_layers must be >= 1")
    moe = max(token_s - nomoe_token_s, 0.0) / n_layers
    dense = max(nomoe_token_s - head_s, 0.0) / n_layers
    return moe, dense


def extrapolate(moe_layer_s: float, dense_layer_s: float, head_s: float, moe_layers: int = GLM5_MOE_LAYERS,
                layers: int = GLM5_LAYERS, fixed_s: float = 0.0) -> float:
    """GLM-5 tokens/s = 1 / (per-token fixed time + 75 x MoE-layer time + 78 x dense-layer time + head time)."""
    t = fixed_s + moe_layers * moe_layer_s + layers * dense_layer_s + head_s
    return 1.0 / t if t > 0 else float("inf")


def device_split(nomoe_token_s: float, nomoe_device_s: float, n_layers: int, head_s: float) -> tuple[float, float]:
    """(dense_layer_s, fixed_s) of a no-routed-expert token replayed as ONE CUDA graph: inside the graph the layers
    run back to back on the device, so a layer's wall time is its share of the graph's device time (two events
    around the launch), (T_device - head_s) / L; what the token's wall time holds beyond the device time -- the
    launch, the read-back, the host's step -- is paid once per token whatever its depth. Noise clamps to 0."""
    if n_layers < 1:
        raise ValueError("n_layers must be >= 1")
    return max(nomoe_device_s - head_s, 0.0) / n_layers, max(nomoe_token_s - nomoe_device_s, 0.0)


def full_dense_bytes(slice_dense_bytes: int, head_bytes: int, slice_layers: int, slice_vocab: int,
                     layers: int = GLM5_LAYERS, vocab: int = GLM5_VOCAB) -> int:
    """The full model's dense core estimated from the slice's: per-layer dense x 78 + embed/lm_head scaled to the
    real vocabulary. `head_bytes` = the slice's embed + lm_head bytes (inside slice_dense_bytes)."""
    per_layer = max(slice_dense_bytes - head_bytes, 0) / max(slice_layers, 1)
    return int(per_layer * layers + head_bytes * vocab / max(slice_vocab, 1))


def scale_capacity(vram_gb: float, ram_gb: float, dense_bytes: int, kv_bytes: int, workspace_bytes: int,
                   slot_bytes: int, slice_layers: int, top_k: int, moe_layers: int = GLM5_MOE_LAYERS) -> dict:
    """Per-layer VRAM/RAM expert slots the full model would have at this budget, and the slice's share."""
    from coli.gpu.pool import size_pool
    plan = size_pool(int(vram_gb * GB), dense_bytes, kv_bytes, workspace_bytes, slot_bytes, min_slots=0)
    floor = 2 * top_k
    full_vram = int(plan["slots"])
    per_vram = full_vram / moe_layers
    full_ram = int(max(ram_gb, 0) * GB) // slot_bytes
    per_ram = full_ram / moe_layers
    sv, sr = int(per_vram * slice_layers), int(per_ram * slice_layers)
    notes = []
    if sv < floor:
        notes.append(f"VRAM: the full model gets {full_vram} slots at {vram_gb:g} GB ({per_vram:.2f} per layer); the "
                     f"slice's {sv} are raised to {floor} (2 x top-{top_k}: one step's demand plus staging)")
    if sr < floor:
        notes.append(f"RAM: {full_ram} slots at {ram_gb:g} GB ({per_ram:.2f} per layer); the slice's {sr} are raised "
                     f"to {floor}")
    return {"vram_gb": vram_gb, "ram_gb": ram_gb, "slot_bytes": slot_bytes, "full_dense_bytes": dense_bytes,
            "full_kv_bytes": kv_bytes, "workspace_bytes": workspace_bytes, "full_vram_slots": full_vram,
            "per_layer_vram_slots": round(per_vram, 3), "slice_vram_slots": max(sv, floor),
            "full_ram_slots": full_ram, "per_layer_ram_slots": round(per_ram, 3), "slice_ram_slots": max(sr, floor),
            "notes": notes}


def mapped_link(moe_layer_ms: float | None, layer_bytes: int, layers_run: int, ceil: dict | None) -> dict:
    """The mapped-ram row's link figures (pure): its MoE layer's bytes over its time, against the copy engine's
    whole-buffer peak and the mapped-read kernel's peak of the same run (coli.bench.ceilings.h2d_peak)."""
    whole = (ceil or {}).get("whole_GBps")
    mapped = ((ceil or {}).get("mapped_read") or {}).get("GBps")
    rate = layer_bytes / (moe_layer_ms / 1e3) / GB if moe_layer_ms else None
    return {"copy_bytes": layer_bytes * layers_run, "eff_busy_GBps": rate, "peak_whole_GBps": whole,
            "busy_over_peak": ratio(rate, whole), "mapped_read_GBps": mapped, "over_mapped_read": ratio(rate, mapped)}


def row_order(names: list[str]) -> list[str]:
    """Scenario rows in ROW_ORDER; a budget's rows (budget-16gb, budget-nospec-16gb, ...) where "budget" and
    "budget-nospec" stand, in the order they ran."""
    out = []
    for base in ROW_ORDER:
        if base in ("budget", "budget-nospec"):
            out += [n for n in names if n == base or (n.startswith(base + "-") and n.endswith("gb")
                                                      and n[len(base) + 1:-2].replace(".", "").isdigit())]
        elif base in names:
            out.append(base)
    return out


def _slice_dense_format(slice_dir: Path) -> tuple[str, int]:
    """The dense core's format and group as the slice's converter options recorded them (coli bench make-slice
    --dense-format)."""
    from coli.container.format import MANIFEST_NAME, parse_manifest
    m = parse_manifest(Path(slice_dir) / MANIFEST_NAME)
    return str(m.args.get("dense", "bf16")), int(m.args.get("group") or 64)


def summarise(values) -> dict:
    """n, mean, p50, p99, max of a list (None figures when empty)."""
    a = np.asarray(list(values), dtype=np.float64)
    if a.size == 0:
        return {"n": 0, "mean": None, "p50": None, "p99": None, "max": None}
    return {"n": int(a.size), "mean": float(a.mean()), "p50": float(np.percentile(a, 50)),
            "p99": float(np.percentile(a, 99)), "max": float(a.max())}


def demand_delays(copy_us, nbytes, peak_GBps: float | None, tile_us: float | None) -> dict:
    """Per demand copy: its measured device time minus its nominal time (nbytes / the whole-buffer H2D peak), in
    microseconds and in tile transfer times; summarised."""
    copy_us, nbytes = list(copy_us), list(nbytes)
    if len(copy_us) != len(nbytes):
        raise ValueError("copy_us and nbytes differ in length")
    if not peak_GBps:
        return {"us": None, "tiles": None, "note": "no H2D peak measured: nominal copy time unknown",
                "copy_us": summarise(copy_us)}
    d = [u - n / (peak_GBps * 1e3) for u, n in zip(copy_us, nbytes)]      # GB/s x 1e3 = bytes per us
    out = {"us": summarise(d), "copy_us": summarise(copy_us)}
    out["tiles"] = summarise([x / tile_us for x in d]) if tile_us else None
    return out


def overlap_efficiency(moe_layer_s: float, copy_layer_s: float | None, compute_layer_s: float | None) -> float | None:
    """MoE-layer time over max(copy time, compute time) per layer: 1.0 = copy and compute fully overlapped,
    2.0 = fully serial with equal halves."""
    parts = [x for x in (copy_layer_s, compute_layer_s) if x]
    if not parts:
        return None
    return moe_layer_s / max(parts)


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def delta(after: dict, before: dict) -> dict:
    """Numeric counters of `after` minus `before` (others as in after)."""
    out = {}
    for k, v in after.items():
        b = before.get(k)
        out[k] = v - b if isinstance(v, (int, float)) and isinstance(b, (int, float)) and not isinstance(v, bool) else v
    return out


# ---- GPU runner -----------------------------------------------------------------------------------------------
class OraclePilot:
    """ORACLE speculation (not a predictor): after layer l's demand stream is consumed, i.e. while its kernels
    run, prefetch exactly the experts the trace routes at layer l+1 (the last layer: the next token's layer 0)."""

    def __init__(self, vx, routing, n_layers: int):
        self.vx, self.routing, self.L = vx, routing, n_layers
        self.prefetched = 0

    def begin_step(self, tokens: int) -> None:
        self.vx.begin_step(tokens)             # the product's start of a step (a long prefill's first copies)

    def stream(self, layer: int, ids: list[int]):
        yield from self.vx.stream(layer, ids)
        r = self.routing
        if layer + 1 < self.L and r._rows is not None:
            nxt, rows = layer + 1, r._rows
        else:
            nxt, rows = 0, np.array([r.cursor])
        want = sorted({int(e) for e in r.idx[rows, r._slot[nxt]].ravel() if e >= 0})
        self.prefetched += len(want)
        self.vx.prefetch(nxt, want)


class _NoExperts:
    def stream(self, layer, ids):
        if ids:
            raise RuntimeError("no expert source installed")
        return iter(())


def _optional(module: str):
    try:
        return importlib.import_module(module), None
    except Exception as e:   # noqa: BLE001 -- a teammate's module may be missing or broken: say so, go on
        return None, f"{module} unavailable ({type(e).__name__}: {e})"


def run_peer(slice_dir: Path, vram_gb: float, tokens: int, timeout_s: int = 900) -> dict:
    """Baseline (b) in a subprocess (never in this process: it must not share it with PyCUDA)."""
    if importlib.util.find_spec("coli.bench.peer_accelerate") is None:
        return {"run": False, "reason": "coli/bench/peer_accelerate.py is missing"}
    with tempfile.TemporaryDirectory() as td:
        out = Path(td) / "peer.json"
        cmd = [sys.executable, "-m", "coli.bench.peer_accelerate", str(slice_dir), "--vram-gb", f"{vram_gb:g}",
               "--tokens", str(tokens), "--json", str(out)]
        t = time.perf_counter()
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return {"run": False, "reason": f"timed out after {timeout_s} s", "cmd": cmd}
        wall = time.perf_counter() - t
        if p.returncode != 0 or not out.is_file():
            tail = (p.stderr or p.stdout or "")[-2000:]
            res = {"run": False, "reason": f"exit status {p.returncode}", "stderr_tail": tail, "cmd": cmd}
            if out.is_file():          # the peer says why (stage + error) in its JSON
                try:
                    d = json.loads(out.read_text())
                    res["reason"] = f"{d.get('stage', '?')}: {d.get('error', 'exit status %d' % p.returncode)}"
                    res["result"] = d
                except ValueError:
                    pass
            return res
        try:
            d = json.loads(out.read_text())
        except ValueError as e:
            return {"run": False, "reason": f"its JSON does not parse: {e}", "cmd": cmd}
    return {"run": True, "wall_s": wall, "cmd": cmd, "result": d}


class _Runner:
    def __init__(self, slice_dir: Path, tokens: int, vram_gb: float, ram_gb: float, tile_kb: int,
                 report: Callable[[str], None]):
        from coli.gpu.cuda_runtime import CudaUnavailable
        try:
            from coli.gpu.cuda_backend import CudaBackend
            self.b = CudaBackend()
        except CudaUnavailable as e:
            raise ColiError(f"coli bench stream needs a CUDA GPU: {e}") from None
        from coli.bench.trace_router import TraceRouting
        from coli.container.reader import ContainerReader
        from coli.model.forward import GlmMoeDsaModel
        self.dir, self.N, self.report = Path(slice_dir), int(tokens), report
        self.vram_gb, self.ram_gb, self.tile_bytes = vram_gb, ram_gb, int(tile_kb) * 1024
        self.reader = ContainerReader(self.dir)
        self.cfg = c = self.reader.config
        if c.moe_layers != list(range(c.num_hidden_layers)):
            raise ColiError(f"{self.dir}: coli bench stream needs a slice whose every layer is MoE (coli bench "
                            f"make-slice); this one has MoE layers {c.moe_layers}")
        self.L, self.E, self.K = c.num_hidden_layers, c.n_routed_experts, c.num_experts_per_tok
        self.layout = self.reader.record_layout
        self.model = GlmMoeDsaModel(c, self.reader, self.b, experts=_NoExperts())
        self.b.rt.synchronize()
        self.dense_bytes = int(self.b.rt.pool.active_bytes)
        head = int(getattr(self.model.embed, "nbytes", 0))
        if self.model.lm_head is not self.model.embed:
            head += int(getattr(self.model.lm_head, "nbytes", 0))
        self.head_bytes = head
        self.routing = TraceRouting(self.dir)
        self.routing.install(self.model)
        self._mem = None

    # ---- decode ------------------------------------------------------------------------------------------
    def decode(self, override=None) -> list[float]:
        m, rt = self.model, self.b.rt
        saved = m.route_override
        if override is not None:
            m.route_override = override
        try:
            self.routing.reset(0)
            g0 = m.step_graphs
            counts0 = (g0.replays, g0.segment_steps, g0.captures) if g0 is not None else (0, 0, 0)
            cache = m.new_cache(WARMUP_TOKENS + self.N + 8)
            tok = 1
            for _ in range(WARMUP_TOKENS):
                tok = m.greedy([tok], cache)
            if self._before is not None:
                self._before()
            times, self.tokens = [], []
            if m.step_graphs is not None:        # the device time of each replayed step, beside its wall time
                m.step_graphs.time_gpu, m.step_graphs.gpu_s = True, []
            for _ in range(self.N):
                rt.synchronize()
                t = time.perf_counter()
                tok = m.greedy([tok], cache)
                rt.synchronize()
                times.append(time.perf_counter() - t)
                self.tokens.append(int(tok))
            g = m.step_graphs                 # the replayed decode step (coli.gpu.graphs), None with COLI_GRAPHS=0
            # this decode's own counts (the decoder's are cumulative over every scenario of the run)
            self.graphs = (None if g is None else
                           {"replays": g.replays - counts0[0], "segment_steps": g.segment_steps - counts0[1],
                            "captures": g.captures - counts0[2],
                            "eager_reason": g.last_reason,
                            "gpu_ms_mean": float(np.mean(g.gpu_s)) * 1e3 if g.gpu_s else None})
            if g is not None:
                g.time_gpu = False
            return times
        finally:
            m.route_override = saved

    _before: Callable[[], None] | None = None
    graphs: dict | None = None     # the last decode's replay counters (None: every step eager)
    tokens: list[int] | None = None    # the last decode's timed tokens

    def head_time(self, reps: int = 20) -> float:
        b, rt = self.b, self.b.rt
        x = b.upload(np.zeros((1, self.cfg.hidden_size), np.float32))
        b.linear(x, self.model.lm_head)
        rt.synchronize()
        t = time.perf_counter()
        for _ in range(reps):
            b.linear(x, self.model.lm_head)
        rt.synchronize()
        return (time.perf_counter() - t) / reps

    def memory_tier(self):
        if self._mem is None:
            from coli.gpu.host_records import MemoryHostTier
            t = time.perf_counter()
            self._mem = MemoryHostTier(self.reader, list(range(self.L)))
            self.report(f"MemoryHostTier: {len(self._mem.index)} records in pinned RAM in "
                        f"{time.perf_counter() - t:.1f} s")
        return self._mem

    def vram(self, host, n_slots: int, **kw):
        from coli.gpu.vram_experts import VramExperts
        return VramExperts(self.b, host, self.layout, self.L, self.E, self.K, n_slots, tile_bytes=self.tile_bytes,
                           **kw)

    def run_vx(self, name: str, vx, host, source=None, nvme=None, timeline: bool = False) -> dict:
        """Decode with `vx` (wrapped by `source` if given) as the expert source; its counters over the timed
        tokens only."""
        self.model.experts = source if source is not None else vx
        marks: dict[str, Any] = {}

        def before():
            vx.finish()
            if timeline:
                vx.start_timeline()
            marks["snap"] = vx.snapshot()
            marks["delays"] = len(vx.delays_us)
            marks["host"] = dict(getattr(host, "stats", {}) or {})
            marks["nvme"] = (nvme.bytes_read, nvme.read_s) if nvme is not None else None
        self._before = before
        try:
            times = self.decode()
        finally:
            self._before = None
        vx.finish()
        snap = delta(vx.snapshot(), marks["snap"])
        i = marks["delays"]
        row = {"scenario": name, "token_s": times, "counters": snap, "graphs": self.graphs,
               "delays_us": vx.delays_us[i:], "delay_nbytes": vx.delay_nbytes[i:],
               "host": delta(dict(getattr(host, "stats", {}) or {}), marks["host"]), "vram_slots": vx.n_slots}
        if timeline and vx.timeline:
            # the first three timed tokens, per lane (demand copies, speculative copies, compute spans)
            cut = 1e6 * sum(times[:3])
            row["timeline"] = [e for e in vx.timeline if e["t0_us"] <= cut]
            from coli.bench.layer_timeline import summarise_phases
            row["layer_phases"] = summarise_phases(vx.timeline)         # every timed token: where the layer goes
        if nvme is not None:
            b0, s0 = marks["nvme"]
            row["nvme_raw"] = {"bytes": nvme.bytes_read - b0, "read_s": nvme.read_s - s0,
                               "direct_files": nvme.direct_files, "buffered_fallback": list(nvme.fallback)}
        self.model.experts = _NoExperts()
        return row


def _row_figures(raw: dict, *, L: int, N: int, nomoe_s: float | None, head_slice: float, head_full: float,
                 dense_layer_s: float | None, warm_moe_layer_s: float | None, ceil: dict | None, tile_kb: int,
                 nvme_peak: float | None, fixed_s: float = 0.0, nomoe_device_s: float | None = None) -> dict:
    """The reported figures of one scenario from its raw measurements (pure)."""
    t = summarise(raw["token_s"])
    mean = t["mean"]
    out: dict[str, Any] = {"scenario": raw["scenario"], "label": raw.get("label", raw["scenario"]), "tokens": N,
                           "token_ms": {k: (v * 1e3 if isinstance(v, float) else v) for k, v in t.items()},
                           "tokens_per_s_slice": 1.0 / mean if mean else None}
    if nomoe_s is not None and dense_layer_s is not None:
        moe, _ = split_times(mean, nomoe_s, L, head_slice)
        dev = (raw.get("graphs") or {}).get("gpu_ms_mean")
        if nomoe_device_s is not None and dev is not None:
            # both tokens replayed as one graph each (warm): the MoE is the difference of their device times, free
            # of the host's jitter between two wall means
            moe = max(dev / 1e3 - nomoe_device_s, 0.0) / L
        out["moe_layer_ms"] = moe * 1e3
        out["tokens_per_s_glm5"] = extrapolate(moe, dense_layer_s, head_full, fixed_s=fixed_s)
    else:
        moe = None
        out["moe_layer_ms"] = None
        out["tokens_per_s_glm5"] = None
    c = raw.get("counters") or {}
    if c:
        wall = sum(raw["token_s"])
        cb, cs = c.get("copy_bytes", 0), c.get("demand_copy_s", 0.0)
        whole = (ceil or {}).get("whole_GBps")
        busy = cb / cs / GB if cs else None
        wallr = cb / wall / GB if wall else None
        out["h2d"] = {"copy_bytes": cb, "demand_copy_s": cs, "copies": c.get("copies"),
                      "spec_copies": c.get("spec_copies"), "spec_bytes": c.get("spec_bytes"),
                      "eff_busy_GBps": busy, "eff_wall_GBps": wallr, "peak_whole_GBps": whole,
                      "busy_over_peak": ratio(busy, whole), "wall_over_peak": ratio(wallr, whole)}
        copy_layer = cs / (N * L) if N else None
        out["overlap_efficiency"] = (overlap_efficiency(moe, copy_layer, warm_moe_layer_s)
                                     if moe is not None else None)
        out["copy_ms_per_layer"] = copy_layer * 1e3 if copy_layer is not None else None
        vh, vm = c.get("hits", 0), c.get("misses", 0)
        out["hit_rates"] = {"vram": vh / (vh + vm) if vh + vm else None}
        h = raw.get("host") or {}
        if "hits" in h:
            n = h["hits"] + h["misses"]
            out["hit_rates"]["ram"] = h["hits"] / n if n else None
        out["cpu_fallbacks"] = {k[len("fallback_"):]: v for k, v in c.items() if k.startswith("fallback_")}
        out["cpu_fallbacks_total"] = c.get("cpu_fallbacks")
        tiles = (ceil or {}).get("tiles") or {}
        tile = tiles.get(tile_kb) or tiles.get(str(tile_kb)) or {}
        out["demand_delay"] = demand_delays(raw.get("delays_us", []), raw.get("delay_nbytes", []), whole,
                                            tile.get("tile_us"))
        out["vram_slots"] = raw.get("vram_slots", c.get("vram_slots"))
        out["spec"] = {k: c.get(k) for k in ("spec_loads", "spec_copies", "spec_used", "spec_wasted",
                                             "spec_cancelled", "stale_copies", "spec_copy_s", "spec_handoffs",
                                             "spec_handoff_bytes")}
    if "nvme_raw" in raw:
        nv = raw["nvme_raw"]
        wall = sum(raw["token_s"])
        g_busy = nv["bytes"] / nv["read_s"] / GB if nv["read_s"] else None
        g_wall = nv["bytes"] / wall / GB if wall else None
        out["nvme"] = {**nv, "GBps_busy": g_busy, "GBps_wall": g_wall, "peak_GBps": nvme_peak,
                       "busy_over_peak": ratio(g_busy, nvme_peak), "wall_over_peak": ratio(g_wall, nvme_peak)}
    for k in ("notes", "ram_slots", "speculation", "oracle_prefetched", "vram_gb", "predicted", "tokens_equal_warm"):
        if k in raw:
            out[k] = raw[k]
    return out


def run_scenarios(slice_dir, scenarios, tokens: int = 16, vram_gb: float = 16.0, ram_gb: float = 64.0,
                  tile_kb: int = 1024, out_json=None, plots_dir=None, peer: bool = True,
                  report: Callable[[str], None] = print, batches: list[int] | None = None,
                  verify: list[int] | None = None, mtp_acceptance: float = 0.8,
                  prefill: list[int] | None = None, prefill_ahead: bool = False) -> dict:
    """Run the scenarios on the GPU; returns (and writes to out_json) the result dict (docs/performance.md).
    vram_gb: one budget or several ("16,24,32" or a list): the budget scenarios run once per budget (rows
    budget-16gb, ...), everything else at the first. batches (coli.bench.batch_decode): besides its row, warm
    and cold-ram run B sequences together on their engine for each B (res["batch"]); None or [1]: not run.
    verify (coli.bench.verify_step): warm and cold-ram also time verify steps of S positions of one sequence
    (res["verify"]) and what MTP would give, `auto` judged at mtp_acceptance; None or [1]: not run. prefill
    (coli.bench.prefill): cold-ram and each budget-nospec engine time a prefill of S prompt tokens for each S, warm
    the same as the compute reference (res["prefill"]); None or []: not run. prefill_ahead: the cold-ram prefills
    also with the next layer's experts copied ahead (coli/gpu/layer_ahead.py), on the same and on 2E slots."""
    from coli.bench.budget import parse_budgets
    budgets = parse_budgets(",".join(f"{v:g}" for v in vram_gb) if isinstance(vram_gb, (list, tuple)) else vram_gb)
    vram_gb = budgets[0]
    slice_dir = Path(slice_dir)
    names = parse_scenarios(scenarios) if isinstance(scenarios, str) else list(scenarios)
    if not peer:
        names = [n for n in names if n != "peer"]
    res: dict[str, Any] = {"slice": str(slice_dir), "tokens": tokens, "warmup_tokens": WARMUP_TOKENS,
                           "vram_gb": vram_gb, "vram_gb_budgets": budgets, "ram_gb": ram_gb, "tile_kb": tile_kb,
                           "scenarios_asked": names,
                           "rows": [], "notes": [], "extrapolation": (
                               "tokens/s extrapolated to GLM-5 (75 MoE + 3 dense layers): 1 / (fixed_token_s + 75 x "
                               "moe_layer_s + 78 x dense_layer_s + head_s_full); dense_layer_s is a layer's share "
                               "of the replayed no-routed-expert token's device time, fixed_token_s the rest of that "
                               "token's wall time, paid once whatever its depth; per-layer cache capacities scaled "
                               "to what the full model would have at the same --vram-gb/--ram-gb")}
    peer_row = None
    if "peer" in names:                 # first: before this process owns GPU memory
        report("peer: coli.bench.peer_accelerate in a subprocess ...")
        peer_row = run_peer(slice_dir, vram_gb, tokens)
        res["peer"] = peer_row
    r = _Runner(slice_dir, tokens, vram_gb, ram_gb, tile_kb, report)
    from coli.gpu.host_records import CachedHostTier, ContainerHostTier
    from coli.gpu.setup import WORKSPACE_BYTES, kv_bytes
    from coli.config import PRESETS
    res["slice_config"] = {"layers": r.L, "experts": r.E, "top_k": r.K, "vocab": r.cfg.vocab_size,
                           "record_bytes": r.layout.nbytes, "dense_bytes_resident": r.dense_bytes,
                           "head_bytes": r.head_bytes}
    # ceilings (teammate's coli.bench.ceilings)
    ceil, nvme_peak = None, None
    cmod, why = _optional("coli.bench.ceilings")
    if cmod is None:
        res["notes"].append(f"ceilings not measured: {why}; ratios over peak and delays in tile times are null")
    else:
        try:
            ceil = cmod.h2d_peak(r.layout.nbytes * r.K, [256, 512, 1024, 2048, 4096, tile_kb], 3)
            res["h2d_peak"] = ceil
        except Exception as e:   # noqa: BLE001
            res["notes"].append(f"h2d_peak failed: {type(e).__name__}: {e}")
        if "mapped" in names and ceil is not None:
            try:
                ceil["mapped_read"] = res["mapped_read_peak"] = cmod.mapped_read_peak(r.layout.nbytes * r.K, 3)
            except Exception as e:   # noqa: BLE001 -- the mapped row then has no ceiling of its own, nothing else lost
                res["notes"].append(f"mapped_read_peak failed: {type(e).__name__}: {e}")
        if not {"disk", "budget"} & set(names):    # only the disk-fed rows use it; the probe takes ~27 s
            res["notes"].append("O_DIRECT read peak not measured: no disk-fed scenario (disk, budget) asked for")
        else:
            try:
                od = cmod.odirect_read_peak(str(r.reader.expert_paths[0]))
                res["odirect_peak"] = od
                nvme_peak = od.get("best_GBps")
            except Exception as e:   # noqa: BLE001
                res["notes"].append(f"odirect_read_peak failed: {type(e).__name__}: {e}")
    # capacity scaling
    full = PRESETS["glm5"]
    fdense = full_dense_bytes(r.dense_bytes, r.head_bytes, r.L, r.cfg.vocab_size)
    scal = scale_capacity(vram_gb, ram_gb, fdense, kv_bytes(full, 4096), WORKSPACE_BYTES,
                          r.layout.nbytes + (-r.layout.nbytes) % 4096, r.L, r.K)
    res["scaling"] = scal
    for n in scal["notes"]:
        report(n)
    # dense / head times
    head_slice = r.head_time()
    head_full = head_slice * GLM5_VOCAB / r.cfg.vocab_size
    res["head_s_slice"], res["head_s_full"] = head_slice, head_full
    nomoe, dense_layer = None, None
    from coli.bench.batch_decode import DropAllExperts
    try:
        t = r.decode(override=DropAllExperts(r.K))
        nomoe = float(np.mean(t))
        _, dense_layer = split_times(nomoe, nomoe, r.L, head_slice)
        res["nomoe_token_ms"] = summarise([x * 1e3 for x in t])
        res["nomoe_graphs"] = r.graphs
        res["dense_layer_ms"] = dense_layer * 1e3
    except Exception as e:   # noqa: BLE001
        res["notes"].append(f"the no-routed-expert decode failed ({type(e).__name__}: {e}): no MoE/dense split, "
                            f"no GLM-5 extrapolation")
    fixed, nomoe_dev = 0.0, None
    if nomoe is not None:
        res["dense_layer_ms_spread"] = dense_layer * 1e3           # the old split: the whole token over L layers
        gpu = (res.get("nomoe_graphs") or {}).get("gpu_ms_mean")
        if gpu is not None:
            # the no-expert token was replayed as one graph: a layer is its share of the device time, the rest of
            # the wall time is paid once per token (docs/performance.md, "Extrapolation")
            nomoe_dev = gpu / 1e3
            dense_layer, fixed = device_split(nomoe, nomoe_dev, r.L, head_slice)
            res["split"] = "device"
            res["dense_layer_ms"] = dense_layer * 1e3
            res["fixed_token_ms"] = fixed * 1e3
        else:
            res["split"] = "spread"
            res["notes"].append("the no-routed-expert token ran eagerly (no device time): the whole token is spread "
                                "over the slice's layers, host time included")
    raws: dict[str, dict] = {}
    n_cold = max(scal["slice_vram_slots"], 2 * r.K)
    batched = _batched(r, res, batches, tokens)
    verified = _verified(r, res, verify, tokens)
    prefilled = _prefilled(r, res, prefill)
    if prefill_ahead and prefill:
        res["prefill"]["ahead"] = True

    def guarded(name, fn):
        report(f"{name} ...")
        try:
            raws[name] = fn()
        except ColiError:
            raise
        except Exception as e:   # noqa: BLE001 -- one scenario failing must not lose the others
            import traceback
            raws[name] = {"scenario": name, "error": f"{type(e).__name__}: {e}",
                          "traceback": traceback.format_exc()[-3000:]}
            report(f"{name} failed: {type(e).__name__}: {e}")
        gc.collect()

    if "warm" in names:
        def warm():
            from coli.gpu.cuda_weights import ResidentExperts
            res_x = ResidentExperts(r.b.rt, r.reader)
            r.model.experts = res_x
            try:
                t = r.decode()
                row = {"scenario": "warm", "label": "warm (every expert in VRAM)", "token_s": t, "graphs": r.graphs,
                       "tokens_out": r.tokens}
                batched("warm", None)
                verified("warm", None)
                prefilled("warm", None)
                return row
            finally:
                r.model.experts = _NoExperts()
                del res_x
        guarded("warm", warm)

    def cold(sync: bool):
        host = r.memory_tier()
        vx = r.vram(host, n_cold, retain=False, sync=sync)
        try:
            row = r.run_vx("sync" if sync else "cold-ram", vx, host, timeline=True)
            if not sync:
                vx.finish()
                vx.timeline = vx.busy.timeline = None     # the row's timeline is taken: the batched steps run without
                r.model.experts = vx
                try:
                    batched("cold-ram", lambda: (vx.finish(), vx.snapshot())[1])
                    verified("cold-ram", lambda: (vx.finish(), vx.snapshot())[1])
                    prefilled("cold-ram", lambda: (vx.finish(), vx.snapshot())[1])
                finally:
                    r.model.experts = _NoExperts()
        finally:
            vx.close()
        if not sync and prefill_ahead and prefill:
            try:
                _ahead_rows(r, prefilled, host, n_cold)
            except Exception as e:   # noqa: BLE001 -- the layer-ahead engines failing must not cost the cold-ram row
                res["prefill"]["raw"].append({"scenario": "cold-ram+ahead", "tokens": None, "run": False,
                                              "reason": f"{type(e).__name__}: {e}"})
                r.report(f"layer-ahead prefill rows failed: {type(e).__name__}: {e}")
        row["label"] = ("sync baseline (whole-record copy, host waits, then compute; RAM source, no retention)"
                        if sync else "cold-ram (all experts in RAM, VRAM retention off)")
        return row

    if "cold-ram" in names:
        guarded("cold-ram", lambda: cold(False))
    if "mapped" in names:
        def mapped():
            from coli.gpu.driver import get_driver
            from coli.gpu.mapped_experts import MappedHostExperts
            host = r.memory_tier()
            with MappedHostExperts(get_driver(), host, r.layout, range(r.L), r.E, sync=r.b.rt.synchronize) as mx:
                r.model.experts = mx
                try:
                    t = r.decode()
                finally:
                    r.model.experts = _NoExperts()
            row = {"scenario": "mapped-ram", "token_s": t, "graphs": r.graphs, "tokens_out": r.tokens,
                   "label": "mapped-ram (every expert in pinned RAM, read by the MoE kernels over PCIe: zero-copy)"}
            warm_tokens = (raws.get("warm") or {}).get("tokens_out")
            if warm_tokens is not None:
                row["tokens_equal_warm"] = r.tokens == warm_tokens
            return row
        guarded("mapped-ram", mapped)
    if "sync" in names:
        guarded("sync", lambda: cold(True))
    if "spec" in names:
        # What speculation does to demand copies when it does run: every expert in RAM (probe finds it), VRAM
        # retention on with room for one layer's demand plus the next layer's guesses, the ORACLE pilot on vs
        # off. The demand copies left with it on are the guesses that had not landed; their delay against the
        # same statistic with it off is what the speculative tiles ahead of them cost.
        for spec in (True, False):
            def spec_ram(spec=spec):
                host = r.memory_tier()
                vx = r.vram(host, 3 * r.K, speculate=spec)     # on here whatever COLI_SPEC_COPIES says
                pilot = OraclePilot(vx, r.routing, r.L) if spec else None
                name = "spec-ram" if spec else "spec-ram-off"
                try:
                    row = r.run_vx(name, vx, host, source=pilot, timeline=True)
                finally:
                    vx.close()
                row["label"] = (f"RAM-fed, {3 * r.K} VRAM slots, speculation "
                                f"{'on: ORACLE pilot (trace experts of layer l+1)' if spec else 'off'}")
                row["speculation"] = "oracle" if spec else "off"
                if pilot is not None:
                    row["oracle_prefetched"] = pilot.prefetched
                return row
            guarded("spec-ram" if spec else "spec-ram-off", spec_ram)
    if r._mem is not None:
        r._mem = None
        gc.collect()
    if "disk" in names:
        def disk():
            host = ContainerHostTier(r.reader, n_buffers=max(16, 2 * r.K), direct=True)
            vx = r.vram(host, n_cold, retain=False)
            try:
                row = r.run_vx("disk", vx, host, nvme=host.direct)
            finally:
                vx.close()
                host.close()
            row["label"] = "disk (O_DIRECT reads, no RAM cache, VRAM retention off)"
            return row
        guarded("disk", disk)
    if "budget" in names:
        from coli.bench.budget import budget_name, plan_bound, predict_hits
        several = len(budgets) > 1
        dense_fmt, group = _slice_dense_format(slice_dir)
        h2d = (ceil or {}).get("whole_GBps")
        for vb in budgets:
            sc = scal if vb == vram_gb else scale_capacity(vb, ram_gb, fdense, kv_bytes(full, 4096), WORKSPACE_BYTES,
                                                           r.layout.nbytes + (-r.layout.nbytes) % 4096, r.L, r.K)
            if vb != vram_gb:
                res.setdefault("scaling_by_budget", {})[f"{vb:g}"] = sc
            # what coli sim and coli plan say for the same case, computed before the run
            predicted: dict[str, Any] = {}
            try:
                predicted["sim"] = predict_hits(r.routing.idx, tokens=WARMUP_TOKENS + tokens, warmup=WARMUP_TOKENS,
                                                vram_slots=sc["slice_vram_slots"], ram_slots=sc["slice_ram_slots"])
                predicted["plan"] = plan_bound(vb, ram_gb, dense=dense_fmt, group=group, pcie_gbps=h2d,
                                               disk_gbps=nvme_peak)
            except Exception as e:   # noqa: BLE001 -- a prediction failing must not cost the measurement
                predicted["error"] = f"{type(e).__name__}: {e}"
            for spec in (True, False):
                rname = budget_name("budget" if spec else "budget-nospec", vb, several)

                def budget(spec=spec, sc=sc, vb=vb, rname=rname, predicted=predicted):
                    host = CachedHostTier(r.reader, sc["slice_ram_slots"], direct=True)
                    vx = r.vram(host, sc["slice_vram_slots"], speculate=spec)
                    pilot = OraclePilot(vx, r.routing, r.L) if spec else None
                    try:
                        row = r.run_vx(rname, vx, host, source=pilot, nvme=host.direct)
                        if not spec:        # the engine as `coli up` runs it (no oracle): its TTFT rows
                            r.model.experts = vx
                            try:
                                prefilled(rname, lambda: (vx.finish(), vx.snapshot())[1])
                            finally:
                                r.model.experts = _NoExperts()
                    finally:
                        vx.close()
                        host.close()
                    row["label"] = (f"budget {vb:g} GB VRAM / {ram_gb:g} GB RAM (scaled), speculation "
                                    f"{'on: ORACLE pilot (trace experts of layer l+1)' if spec else 'off'}")
                    row["speculation"] = "oracle" if spec else "off"
                    row["ram_slots"] = sc["slice_ram_slots"]
                    row["vram_gb"] = vb
                    row["predicted"] = predicted
                    if pilot is not None:
                        row["oracle_prefetched"] = pilot.prefetched
                    return row
                guarded(rname, budget)
    warm_moe = None
    if "warm" in raws and "token_s" in raws["warm"] and nomoe is not None:
        warm_moe, _ = split_times(float(np.mean(raws["warm"]["token_s"])), nomoe, r.L, head_slice)
        dev = (raws["warm"].get("graphs") or {}).get("gpu_ms_mean")
        if nomoe_dev is not None and dev is not None:          # as the warm row's own figure (_row_figures)
            warm_moe = max(dev / 1e3 - nomoe_dev, 0.0) / r.L
        res["warm_moe_layer_ms"] = warm_moe * 1e3
    for name in row_order(list(raws)):
        raw = raws.get(name)
        if raw is None:
            continue
        if "error" in raw:
            res["rows"].append({"scenario": name, "run": False, "reason": raw["error"], "traceback": raw["traceback"]})
            continue
        row = _row_figures(raw, L=r.L, N=tokens, nomoe_s=nomoe, head_slice=head_slice, head_full=head_full,
                           dense_layer_s=dense_layer, warm_moe_layer_s=warm_moe, ceil=ceil, tile_kb=tile_kb,
                           nvme_peak=nvme_peak, fixed_s=fixed, nomoe_device_s=nomoe_dev)
        row["token_s_raw"] = raw["token_s"]
        if name == "mapped-ram":
            row["h2d"] = mapped_link(row.get("moe_layer_ms"), r.K * r.layout.nbytes, tokens * r.L, ceil)
        if "graphs" in raw:
            row["graphs"] = raw["graphs"]
        if raw.get("timeline"):
            row["timeline"] = raw["timeline"]
        if raw.get("layer_phases"):
            row["layer_phases"] = raw["layer_phases"]
        res["rows"].append(row)
    _spec_delays(res, raws, ceil, tile_kb)
    if peer_row is not None:
        res["rows"].append({"scenario": "peer", "label": "peer: accelerate (subprocess)", **peer_row})
    res["notes"].append("GLM-5's 3 dense layers are counted at the slice's dense_layer time (attention + router + "
                        "shared expert); their larger dense MLP is not modelled")
    if "batch" in res:
        from coli.bench.batch_decode import acceptance
        res["batch"]["acceptance"] = acceptance(res["batch"]["rows"])
    if "verify" in res:
        finish_verify(res, r.cfg.hidden_size, r.cfg.vocab_size, mtp_acceptance)
    if "prefill" in res:
        from coli.bench.prefill import prefill_rows
        res["prefill"]["rows"] = prefill_rows(
            res["prefill"].pop("raw"), L=r.L, head_s=head_slice, head_s_full=head_full, fixed_s=fixed,
            peak_GBps=(ceil or {}).get("whole_GBps"), record_bytes=r.layout.nbytes, hidden=r.cfg.hidden_size,
            moe_inter=r.cfg.moe_intermediate_size, top_k=r.K)
    _plots(res, plots_dir, ceil, report)
    if out_json is not None:
        Path(out_json).parent.mkdir(parents=True, exist_ok=True)
        Path(out_json).write_text(json.dumps(res, indent=1, default=_json_default))
    print_table(res, report)
    if "batch" in res:
        from coli.bench.batch_decode import print_batch_table
        print_batch_table(res, report)
    if "verify" in res:
        from coli.bench.verify_step import print_verify_table
        print_verify_table(res, report)
    if "prefill" in res:
        from coli.bench.prefill import print_prefill_table
        print_prefill_table(res, report)
    return res


def _batched(r: "_Runner", res: dict, batches: list[int] | None, tokens: int):
    """fn(scenario, snapshot): the batched rows of that scenario on the engine now in r.model.experts, appended to
    res["batch"]["rows"]; a failure is a "not run" row (the scenario's own row is kept). A no-op without
    --batch beyond 1."""
    if not batches or list(batches) == [1]:
        return lambda name, snapshot: None
    from coli.bench.batch_decode import EXTRAPOLATION_NOTE, BatchBench, sequence_starts
    bb = BatchBench(r.model, r.routing, tokens, WARMUP_TOKENS, sync=r.b.rt.synchronize)
    T = r.routing.n_tokens
    res["batch"] = {"batches": sorted(set(batches) | {1}), "rows": [], "notes": [
        EXTRAPOLATION_NOTE,
        f"sequence b of B starts at trace token b x {T} // B (starts for B={max(batches)}: "
        f"{sequence_starts(max(batches), T)}) with first token 1 + b; sequence 0 routes what the scenario's own "
        f"row routes, so 'seq 0 = B=1' checks its tokens against the B=1 row's"]}
    if T // max(batches) < WARMUP_TOKENS + tokens:
        res["batch"]["notes"].append(
            f"at B={max(batches)} the sequences' trace stretches ({T} // B = {T // max(batches)} tokens apart, "
            f"{WARMUP_TOKENS + tokens} steps each) overlap: a sequence's last steps route what the next one routed "
            f"earlier, never in the same step (a longer trace: make-slice --tokens)")

    def run(name: str, snapshot) -> None:
        try:
            res["batch"]["rows"] += bb.rows(name, batches, snapshot=snapshot, record_bytes=r.layout.nbytes,
                                            report=r.report)
        except Exception as e:   # noqa: BLE001 -- the batched rows failing (ColiError too: --batch was checked
            # before the GPU, so one here is the step's) must not cost the scenario's row nor the other scenarios
            import traceback
            res["batch"]["rows"].append({"scenario": name, "run": False, "reason": f"{type(e).__name__}: {e}",
                                         "traceback": traceback.format_exc()[-3000:]})
            r.report(f"{name} batched rows failed: {type(e).__name__}: {e}")
    return run


def _verified(r: "_Runner", res: dict, sizes: list[int] | None, tokens: int):
    """fn(scenario, snapshot): the verify-step rows of that scenario on the engine now in r.model.experts, appended to
    res["verify"]["steps"]; a failure is a "not run" row (the scenario's own row is kept). A no-op without --verify
    beyond 1."""
    if not sizes or list(sizes) == [1]:
        return lambda name, snapshot: None
    from coli.bench.verify_step import EXTRAPOLATION_NOTE, VerifyBench
    from coli.gpu.verify_graphs import verify_graphs_enabled
    replay = verify_graphs_enabled()          # COLI_VERIFY_GRAPHS (default 1): the steps as SpeculativeDecoder runs them
    vb = VerifyBench(r.model, r.routing, tokens, WARMUP_TOKENS, sync=r.b.rt.synchronize, replay=replay)
    res["verify"] = {"positions": sorted(set(sizes) | {1}), "context": vb.context, "steps": [], "replay": replay,
                     "notes": [
        EXTRAPOLATION_NOTE,
        "COLI_VERIFY_GRAPHS=1: each step replayed from a CUDA graph (coli/gpu/verify_graphs.py) where the engine "
        "allows it (every expert resident; a row's replays and eager_reason say), its tokens checked against the "
        "positions one at a time" if replay else
        "each step eager (forward_hidden, COLI_VERIFY_GRAPHS=0); the default replays them from CUDA graphs where it can",
        f"context {vb.context} positions (the plain row's middle one: {WARMUP_TOKENS} warm-up + {tokens} // 2), "
        f"decoded from token 1 with trace tokens 0..{vb.context - 1}; timed step j of S routes trace tokens "
        f"{vb.context} + j x S .. + S - 1 (wrapping at {r.routing.n_tokens}); its ids are the greedy continuation "
        f"(drafts a round would keep), and '=1 by 1' checks its S greedy tokens against the S positions run one at "
        f"a time, and that the cache was cut back after every step"]}

    def run(name: str, snapshot) -> None:
        try:
            res["verify"]["steps"] += vb.rows(name, sizes, snapshot=snapshot, record_bytes=r.layout.nbytes,
                                              report=r.report)
        except Exception as e:   # noqa: BLE001 -- the verify rows failing must not cost the scenario's row
            import traceback
            res["verify"]["steps"].append({"scenario": name, "run": False, "reason": f"{type(e).__name__}: {e}",
                                           "traceback": traceback.format_exc()[-3000:]})
            r.report(f"{name} verify steps failed: {type(e).__name__}: {e}")
    return run


def _prefilled(r: "_Runner", res: dict, sizes: list[int] | None):
    """fn(scenario, snapshot): the TTFT prefills of that scenario on the engine now in r.model.experts, their raw rows
    in res["prefill"]["raw"] (figures once every scenario ran: the warm ones are the compute reference). A no-op
    without --prefill."""
    if not sizes:
        return lambda name, snapshot: None
    from coli.bench.prefill import EXTRAPOLATION_NOTE, PrefillBench
    pb = PrefillBench(r.model, r.routing, sizes, sync=r.b.rt.synchronize)
    T = r.routing.n_tokens
    res["prefill"] = {"sizes": list(sizes), "raw": pb.raws, "notes": [EXTRAPOLATION_NOTE]}
    if max(sizes) > T:
        res["prefill"]["notes"].append(
            f"the slice's trace has {T} tokens: a prefill of more rows wraps around it (rows repeat its routing; a "
            f"layer's expert union is the same, each expert's rows scale)")

    def run(name: str, snapshot, between=None) -> None:
        pb.run(name, snapshot, report=r.report, between=between)
    return run


def _ahead_rows(r: "_Runner", prefilled, host, n_cold: int) -> None:
    """--prefill-ahead: the cold-ram prefills again with the next layer's experts copied ahead (coli/gpu/layer_ahead.py:
    the product's copies, VramExperts' `ahead_layers`, made here whatever the slot count, the switch and COLI_SPEC_COPIES
    say), on n_cold slots and on two layers' worth (2E), with the 2E engine's plain rows beside them (no ahead copies,
    as the plain cold-ram rows). The forward announces its rows to the engine installed here as it does in the product
    (model.experts.begin_step), so each timed prefill also copies its first MoE layer from the step's start (the
    rows' `ahead_first`, counted in `ahead_bytes_slice`). The no-MoE reference prefills ran earlier, on the warm or
    plain cold-ram engine, so no ahead copy runs under them."""
    from coli.bench.prefill import forget_resident
    for name, slots, ahead in (("cold-ram+ahead", n_cold, True), ("cold-ram-2E", 2 * r.E, False),
                               ("cold-ram-2E+ahead", 2 * r.E, True)):
        r.report(f"{name} ({slots} VRAM slots) ...")
        vx = r.vram(host, slots, retain=False, speculate=False,
                    ahead_layers=list(r.cfg.moe_layers) if ahead else None)
        try:
            r.model.experts = vx
            prefilled(name, lambda vx=vx: (vx.finish(), vx.snapshot())[1], between=lambda vx=vx: forget_resident(vx))
        finally:
            r.model.experts = _NoExperts()
            vx.close()


def finish_verify(res: dict, hidden: int, vocab: int, mtp_acceptance: float) -> None:
    """The MTP rows from the verify-step rows, their ratio to each scenario's own decode row, the acceptance."""
    from coli.bench.verify_step import acceptance, add_decode_ratios, mtp_rows
    v = res["verify"]
    v["auto_acceptance"] = mtp_acceptance
    v["mtp"] = mtp_rows(v["steps"], hidden, vocab, mtp_acceptance)
    add_decode_ratios(v["mtp"], res.get("rows", []), mtp_acceptance)
    v["acceptance"] = acceptance(v["mtp"])


def added_delay(copy_us, nbytes, ref_us_per_byte: float, tile_us: float | None) -> dict:
    """Per demand copy: its device time minus what the same bytes take at `ref_us_per_byte` (the demand lane's
    median speed with speculation off, same run), in µs and in tile transfer times; summarised. Against the
    lane's own speed rather than the whole-buffer peak, so what remains is what sharing the bus with the
    speculative lane cost (plus the lane's own jitter, which the spec-off row measures the same way)."""
    d = [u - n * ref_us_per_byte for u, n in zip(copy_us, nbytes)]
    return {"us": summarise(d), "tiles": summarise([x / tile_us for x in d]) if tile_us else None,
            "ref_us_per_MB": ref_us_per_byte * 1e6}


def _spec_delays(res: dict, raws: dict, ceil: dict | None, tile_kb: int) -> None:
    """The delay speculation adds to demand copies: spec-ram's copies against spec-ram-off's median speed, and
    spec-ram-off's own copies the same way (the noise floor)."""
    on, off = raws.get("spec-ram"), raws.get("spec-ram-off")
    if not on or not off or "error" in on or "error" in off or not off.get("delays_us"):
        return
    per_byte = [u / n for u, n in zip(off["delays_us"], off["delay_nbytes"]) if n]
    if not per_byte:
        return
    ref = float(np.median(per_byte))
    tiles = (ceil or {}).get("tiles") or {}
    tile = tiles.get(tile_kb) or tiles.get(str(tile_kb)) or {}
    for row in res["rows"]:
        raw = on if row.get("scenario") == "spec-ram" else off if row.get("scenario") == "spec-ram-off" else None
        if raw is not None:
            row["demand_delay_vs_lane"] = added_delay(raw.get("delays_us", []), raw.get("delay_nbytes", []), ref,
                                                      tile.get("tile_us"))


def _json_default(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    return str(o)


def _plots(res: dict, plots_dir, ceil, report) -> None:
    if plots_dir is None:
        return
    mod, why = _optional("coli.bench.plots")
    if mod is None:
        res["notes"].append(f"no plots: {why}")
        report(f"no plots: {why}")
        return
    d = Path(plots_dir)
    d.mkdir(parents=True, exist_ok=True)
    res["plots"] = {}
    jobs = [("scenarios", lambda p: mod.plot_scenarios(_plot_rows(res, ceil), p))]
    if ceil is not None:
        jobs.append(("h2d_tiles", lambda p: mod.plot_h2d_tiles(ceil, p)))
    for row in res["rows"]:
        ev = row.get("timeline")
        if ev:      # per-lane device timeline of the first timed tokens (cold-ram, sync, spec-ram...)
            name = row["scenario"]
            jobs.append((f"timeline-{name}", lambda p, ev=ev, name=name: mod.plot_timeline(
                ev, p, title=f"{name}: demand / speculative copy lanes and compute, first 3 tokens")))
    for name, fn in jobs:
        p = d / f"{name}.png"
        try:
            fn(p)
            res["plots"][name] = str(p)
        except mod.PlotsUnavailable as e:   # said once, not once per plot
            res["notes"].append(f"no plots: {e}")
            report(f"no plots: {e}")
            return
        except Exception as e:   # noqa: BLE001
            res["notes"].append(f"plot {name} failed: {type(e).__name__}: {e}")


def _plot_rows(res: dict, ceil: dict | None) -> list[dict]:
    """Rows for plots.plot_scenarios: GLM-5 tokens/s per scenario; baselines hatched; for streaming rows the
    ceiling is the same extrapolation with the MoE layer at its bytes over the peak measured in this run
    (pinned H2D for RAM-fed rows, O_DIRECT reads for disk-fed rows)."""
    out = []
    dense = (res.get("dense_layer_ms") or 0.0) / 1e3
    head = (res.get("head_s_full") or 0.0) + (res.get("fixed_token_ms") or 0.0) / 1e3
    L = (res.get("slice_config") or {}).get("layers") or 2
    for r in res.get("rows", []):
        name = r.get("scenario", "?")
        row = {"name": name, "tokens_per_s": r.get("tokens_per_s_glm5"), "baseline": name in ("sync", "peer")}
        n = r.get("tokens") or 0
        h2d, nvme = r.get("h2d") or {}, r.get("nvme") or {}
        peak = None
        if nvme.get("bytes") and nvme.get("peak_GBps"):
            per_layer, peak = nvme["bytes"] / max(1, n * L), nvme["peak_GBps"] * 1e9
        elif h2d.get("copy_bytes") and h2d.get("peak_whole_GBps"):
            per_layer, peak = h2d["copy_bytes"] / max(1, n * L), h2d["peak_whole_GBps"] * 1e9
        if peak and n:
            row["ceiling_tokens_per_s"] = 1.0 / (75 * per_layer / peak + 78 * dense + head)
        out.append(row)
    return out


def _f(v, fmt="{:.2f}") -> str:
    return "-" if v is None else fmt.format(v)


def table_rows(res: dict) -> list[list[str]]:
    """The printed table's cells (pure: tested)."""
    out = []
    for row in res["rows"]:
        if row.get("run") is False:
            out.append([row["scenario"], f"not run: {row.get('reason')}"] + [""] * 9)
            continue
        if row["scenario"] == "peer":
            d = row.get("result") or {}
            out.append(["peer", _f(d.get("tokens_per_s")), "-", "-", "-", "-", "-", "-", "-", "-", "-"])
            continue
        h, nv = row.get("h2d") or {}, row.get("nvme") or {}
        hr = row.get("hit_rates") or {}
        dd = ((row.get("demand_delay") or {}).get("us") or {})
        tps, vh, rh = _f(row.get("tokens_per_s_glm5")), _f(hr.get("vram"), "{:.0%}"), _f(hr.get("ram"), "{:.0%}")
        pr = row.get("predicted")
        if pr:                           # budget rows: coli plan's bound and coli sim's hit rates beside them
            tps += f" (plan {_f((pr.get('plan') or {}).get('tokens_per_s'))})"
            vh += f" (sim {_f((pr.get('sim') or {}).get('vram'), '{:.0%}')})"
            rh += f" (sim {_f((pr.get('sim') or {}).get('ram'), '{:.0%}')})"
        out.append([row["scenario"], tps, _f(row["token_ms"]["mean"]),
                    _f(row.get("moe_layer_ms")),
                    f"{_f(h.get('eff_busy_GBps'))} ({_f(h.get('busy_over_peak'), '{:.0%}')})" if h else "-",
                    f"{_f(nv.get('GBps_wall'))} ({_f(nv.get('wall_over_peak'), '{:.0%}')})" if nv else "-",
                    _f(row.get("overlap_efficiency")), vh, rh,
                    str(row.get("cpu_fallbacks_total", "-")), _f(dd.get("p99"), "{:.0f}")])
    return out


HEADERS = ["scenario", "GLM-5 tok/s*", "ms/token (slice)", "MoE ms/layer", "H2D GB/s busy (/peak)",
           "NVMe GB/s wall (/peak)", "overlap", "VRAM hit", "RAM hit", "CPU fb", "delay p99 us"]


def print_table(res: dict, report: Callable[[str], None] = print) -> None:
    from rich.console import Console
    from rich.table import Table
    t = Table(title=f"coli bench stream: {res['slice']} ({res['tokens']} tokens)")
    for h in HEADERS:
        t.add_column(h)
    for cells in table_rows(res):
        t.add_row(*cells)
    Console(stderr=False).print(t)
    report("* " + res["extrapolation"])
    for row in res["rows"]:
        lp = row.get("layer_phases") or {}
        if lp.get("layers"):
            us = lambda k: _f((lp.get(k) or {}).get("mean"), "{:.0f}")   # noqa: E731
            report(f"{row['scenario']}: per MoE layer (device timeline, {lp['layers']} layers, mean us): router -> "
                   f"first copy {us('route_to_copy_us')}, gaps {us('gaps_us')}, copies {us('copy_us')}, tail "
                   f"{us('tail_us')}: overhead {_f(lp.get('overhead_over_copy'), '{:.1%}')} of the copies; demand "
                   f"lane busy {_f(lp.get('demand_busy_of_wall'), '{:.0%}')} of the wall; host between tokens "
                   f"{us('token_gap_us')}")
        if row.get("scenario") == "mapped-ram" and row.get("h2d"):
            h = row["h2d"]
            report(f"mapped-ram: the MoE kernels read {_f(h.get('eff_busy_GBps'))} GB/s over PCIe, "
                   f"{_f(h.get('busy_over_peak'), '{:.0%}')} of the copy engine's peak, "
                   f"{_f(h.get('over_mapped_read'), '{:.0%}')} of the mapped-read kernel's "
                   f"({_f(h.get('mapped_read_GBps'))} GB/s); tokens equal warm's: {row.get('tokens_equal_warm', '-')}")
    for n in res.get("notes", []) + (res.get("scaling") or {}).get("notes", []):
        report(f"note: {n}")
