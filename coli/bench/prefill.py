"""`coli bench stream --prefill 512,2048,8192`: time to first token of a prompt of S tokens on a scenario's engine,
extrapolated to GLM-5, beside the time to copy every GLM-5 expert once (docs/performance.md "Prefill (TTFT)").

A prefill is one `model.greedy(prompt, cache)` over a fresh cache: the whole prompt in ONE forward (what `coli run`
does, and the executor with a prefill chunk of S: docs/runtime.md), so each MoE layer asks the engine for the union
of the S rows' experts once; its rows route S consecutive trace tokens (TraceRouting from token 0; a trace shorter
than S wraps: its rows repeat the trace's routing, the union stays the layer's experts). Each S is timed once (an
untimed 64-token prefill, the run's first, compiles the kernels), between two synchronize() calls; the engine's caches are as
the previous S left them (cold-ram retains nothing; a budget engine's VRAM/RAM LRU carries over, as for a next
prompt).

Split and GLM-5 extrapolation, as a decoded token's (coli.bench.stream), the prompt in place of the token:
    moe_layer_s(S)   = (T(S) - T_nomoe(S)) / L           T_nomoe(S): the same prefill with every routed expert dropped
    dense_layer_s(S) = (T_nomoe(S) - head_s - fixed_s) / L
    TTFT_glm5(S)     = fixed_s + 75 x moe_layer_s(S) + 78 x dense_layer_s(S) + head_s_full
head_s / head_s_full / fixed_s are the run's one-row figures (the prefill's logits are its last row's); fixed_s is the
per-token time a replayed decode token pays once (stream.device_split), 0 where that split did not run.
Beside it, per S:
    copy_all_s        = 75 x 256 x record_bytes / the run's whole-buffer H2D peak: every GLM-5 expert once over PCIe
    ttft_over_copy    = TTFT_glm5 / copy_all_s            (issue 15: <= 1.3 at 2,048 tokens in cold-ram)
    copied bytes      = the engine's copy_bytes during the prefill (slice), x 75 / L for GLM-5
    moe_compute_s     = the warm engine's (every expert resident) moe_layer_s(S) x 75: the grouped MoE's arithmetic
                        alone, what the copies can hide under (null without the warm scenario)

`--prefill-ahead` (coli/gpu/layer_ahead.py, measured first): the cold-ram rows also run on engines that put the next
MoE layer's experts on the speculative lane as soon as a layer's step has asked for its own (rows "cold-ram+ahead",
the same slots; "cold-ram-2E" and "cold-ram-2E+ahead", two layers' worth of slots, what a card with room for the next
layer gives), each "+ahead" row set against its plain one (`ahead_figures`: the engine copies a forward's first MoE
layer from the step's start too, as the product does, so every MoE layer has a window before it: the slice's L, GLM-5's
75; a row without those first-layer copies, `ahead_first` 0, counts the last L - 1 and 74).
"""

from __future__ import annotations

import time
from typing import Any, Callable


from coli.bench.options import comma_parts, parse_int_list
from coli.errors import ColiError

PREFILL_SCENARIOS = ("cold-ram", "budget")   # the engines whose TTFT rows run; warm gives the compute reference
MAX_PREFILL = 8192         # a slice's 8,192-token prefill holds ~7 GB of activations (coli/gpu/prefill_budget.py)
COMPILE_TOKENS = 64        # the untimed first prefill on an engine
GLM5_EXPERTS = 256
TARGET = {"cold-ram": (2048, 1.3)}          # issue 15: TTFT at 2,048 tokens <= 1.3 x copy_all_s in cold-ram

EXTRAPOLATION_NOTE = (
    "prefill rows: one forward over S prompt tokens (fresh cache, rows on consecutive trace tokens) split as a token "
    "is, against the same prefill with every routed expert dropped: TTFT_glm5 = fixed_s + 75 x moe_layer_s(S) + 78 x "
    "dense_layer_s(S) + head_s_full; copy-all = 75 x 256 experts x record bytes at this run's H2D peak; MoE compute = "
    "the warm engine's moe_layer_s(S) x 75")


# ---- options (checked before the GPU) -------------------------------------------------------------------------
def parse_prefill(text: str) -> list[int]:
    """'512,2048,8192' -> [512, 2048, 8192]; '' or '0' -> [] (no prefill rows). A bad value names itself."""
    parts = comma_parts(text)
    if parts in ([], ["0"]):
        return []
    return parse_int_list(parts, "--prefill", "prompt lengths in tokens", "512,2048,8192", 1, MAX_PREFILL,
                          f"a prompt is 1..{MAX_PREFILL} tokens here (a longer one's activations outgrow what the "
                          f"bench bounds; the executor cuts prompts in --prefill-chunk steps)")


def check_prefill(sizes: list[int], scenarios: list[str]) -> None:
    """Refuse --prefill without an engine to run it on (cold-ram or budget)."""
    if sizes and not set(PREFILL_SCENARIOS) & set(scenarios):
        raise ColiError(f"--prefill {','.join(map(str, sizes))}: the TTFT rows run in the "
                        f"{' and '.join(PREFILL_SCENARIOS)} scenarios; --scenario asks for neither")


# ---- the arithmetic (pure) -----------------------------------------------------------------------------------
def copy_all_s(record_bytes: int, peak_GBps: float | None, moe_layers: int = 75, experts: int = GLM5_EXPERTS
               ) -> float | None:
    """Seconds to copy every GLM-5 expert once at `peak_GBps` (None without a peak)."""
    if not peak_GBps or not record_bytes:
        return None
    return moe_layers * experts * record_bytes / (peak_GBps * 1e9)


def ttft_split(prefill_s: float, nomoe_s: float, L: int, head_s: float, fixed_s: float = 0.0) -> tuple[float, float]:
    """(moe_layer_s, dense_layer_s) of a prefill of the slice's L layers (noise clamps to 0)."""
    if L < 1:
        raise ValueError("L must be >= 1")
    return max(prefill_s - nomoe_s, 0.0) / L, max(nomoe_s - head_s - fixed_s, 0.0) / L


def ttft_glm5(moe_layer_s: float, dense_layer_s: float, head_s_full: float, fixed_s: float = 0.0,
              moe_layers: int = 75, layers: int = 78) -> float:
    return fixed_s + moe_layers * moe_layer_s + layers * dense_layer_s + head_s_full


def prefill_figures(raw: dict, *, L: int, head_s: float, head_s_full: float, fixed_s: float, peak_GBps: float | None,
                    record_bytes: int, hidden: int, moe_inter: int, top_k: int,
                    warm: dict | None = None) -> dict:
    """One TTFT row's figures from its raw measurements (pure). raw: {"scenario", "tokens" S, "prefill_s",
    "nomoe_s", "counters" (the engine's, over the prefill; None on the warm engine)}; warm: the warm engine's raw
    row at the same S (its MoE is compute alone)."""
    S = raw["tokens"]
    moe, dense = ttft_split(raw["prefill_s"], raw["nomoe_s"], L, head_s, fixed_s)
    ttft = ttft_glm5(moe, dense, head_s_full, fixed_s)
    copy_all = copy_all_s(record_bytes, peak_GBps)
    out: dict[str, Any] = {"scenario": raw["scenario"], "tokens": S, "prefill_ms_slice": raw["prefill_s"] * 1e3,
                           "nomoe_ms_slice": raw["nomoe_s"] * 1e3, "moe_layer_ms": moe * 1e3,
                           "dense_layer_ms": dense * 1e3, "ttft_s_glm5": ttft, "copy_all_s_glm5": copy_all,
                           "peak_whole_GBps": peak_GBps,
                           "ttft_over_copy_all": ttft / copy_all if copy_all else None}
    c = raw.get("counters")
    if c is not None:
        cb = c.get("copy_bytes", 0) + (c.get("spec_bytes") or 0)     # demand + layer-ahead (speculative lane)
        out["copied_bytes_slice"] = cb
        out["copied_bytes_glm5"] = cb * 75 / L
        out["copies"] = c.get("copies", 0) + (c.get("spec_copies") or 0)
        out["ahead_bytes_slice"] = c.get("spec_bytes") or 0
        out["ahead_first"] = c.get("ahead_first") or 0       # forwards whose first MoE layer copied from the start
        out["copied_over_all_experts"] = cb / (L * GLM5_EXPERTS * record_bytes) if record_bytes else None
        cs = c.get("demand_copy_s")          # the demand lane's busy time: its own bytes over it (the ahead copies
        out["copy_busy_GBps"] = c.get("copy_bytes", 0) / cs / 1e9 if cs else None   # ran on the other lane)
        out["cpu_fallbacks"] = c.get("cpu_fallbacks")
    comp = None
    if warm is not None:
        comp, _ = ttft_split(warm["prefill_s"], warm["nomoe_s"], L, head_s, fixed_s)
        flop = 2 * 3 * hidden * moe_inter * S * top_k          # gate, up, down over S x K (token, expert) rows
        out["moe_compute_ms_per_layer"] = comp * 1e3
        out["moe_compute_s_glm5"] = comp * 75
        out["moe_tflops"] = flop / comp / 1e12 if comp else None
    else:
        out["moe_compute_ms_per_layer"] = out["moe_compute_s_glm5"] = out["moe_tflops"] = None
    # what hides under what, per MoE layer: the layer's time over max(its copies at the peak, its compute)
    copy_layer = copy_all / 75 if copy_all else None
    parts = [x for x in (copy_layer, comp) if x]
    out["overlap"] = moe / max(parts) if parts and moe else None
    goal = TARGET.get(raw["scenario"])
    if goal is not None and goal[0] == S and out["ttft_over_copy_all"] is not None:
        out["target"] = {"ttft_over_copy_all_max": goal[1], "met": out["ttft_over_copy_all"] <= goal[1]}
    return out


def ahead_figures(row: dict, plain: dict, L: int, moe_layers: int = 75) -> dict:
    """A layer-ahead row against the same engine without it, same S (pure). The time saved is per MoE layer that had
    a window to copy during: where the row's forwards copied their first MoE layer from the step's start
    (`ahead_first`, VramExperts.begin_step) every one of the slice's L and of GLM-5's 75 had one, the first's being
    the dense work before it (the slice: its attention; GLM-5: 3 dense layers and layer 3's attention); otherwise
    only the last L - 1 and 74, each during the layer before it. ttft_glm5 = the plain row's - (75 or 74) x saved."""
    first = bool(row.get("ahead_first"))
    n_slice, n_glm5 = (L, moe_layers) if first else (L - 1, moe_layers - 1)
    if n_slice < 1:
        return {"saved_ms_per_layer": None, "ttft_s_glm5": None, "note": "a 1-layer slice has no layer ahead"}
    saved = (plain["prefill_ms_slice"] - row["prefill_ms_slice"]) / 1e3 / n_slice
    t = plain["ttft_s_glm5"] - n_glm5 * saved
    copy_all = plain.get("copy_all_s_glm5")
    return {"base": plain["scenario"], "saved_ms_per_layer": saved * 1e3, "ttft_s_glm5": t,
            "ttft_over_copy_all": t / copy_all if copy_all else None, "layers_ahead_glm5": n_glm5}


def prefill_rows(raws: list[dict], **kw) -> list[dict]:
    """The TTFT rows of every raw row but the warm ones (which they use as the compute reference); a layer-ahead row
    (scenario "X+ahead") also gets `ahead` against X at the same S."""
    warm = {r["tokens"]: r for r in raws if r["scenario"] == "warm" and r.get("run") is not False}
    out = []
    for r in raws:
        if r["scenario"] == "warm":
            continue
        out.append(r if r.get("run") is False else prefill_figures(r, warm=warm.get(r["tokens"]), **kw))
    done = {(r["scenario"], r["tokens"]): r for r in out if r.get("run") is not False}
    for r in out:
        if r.get("run") is not False and r["scenario"].endswith("+ahead"):
            plain = done.get((r["scenario"][:-len("+ahead")], r["tokens"]))
            if plain is not None:
                r["ahead"] = ahead_figures(r, plain, kw["L"])
    return out


def forget_resident(vx) -> None:
    """Every copy landed, then no expert findable in the VRAM pool any more: the next prefill on a layer-ahead
    engine starts as cold as the plain one (its speculative copies stay resident once used; demand copies with
    retention off do not)."""
    vx.finish()
    for s in range(vx.n_slots):
        if vx.pool.is_mapped(s):
            vx.pool.unmap(s)


# ---- the measurement ------------------------------------------------------------------------------------------
class PrefillBench:
    """The TTFT rows of one run: per S the no-routed-expert prefill (measured once, shared by the scenarios), and per
    scenario the S-token prefill on the engine installed in model.experts."""

    def __init__(self, model, routing, sizes: list[int], sync: Callable[[], None] = lambda: None):
        self.model, self.routing, self.sizes, self.sync = model, routing, list(sizes), sync
        self.K = model.config.num_experts_per_tok
        self._nomoe: dict[int, float] = {}
        self._compiled = False
        self.raws: list[dict] = []

    def prefill_s(self, S: int, override=None) -> float:
        """One prefill of S tokens over a fresh cache, routed from trace token 0 -> seconds."""
        m = self.model
        saved = m.route_override
        if override is not None:
            m.route_override = override
        try:
            self.routing.reset(0)
            cache = m.new_cache(S + 8)
            ids = [1 + (i % 97) for i in range(S)]
            self.sync()
            t0 = time.perf_counter()
            m.greedy(ids, cache)
            self.sync()
            return time.perf_counter() - t0
        finally:
            m.route_override = saved
            self.routing.reset(0)

    def nomoe_s(self, S: int) -> float:
        if S not in self._nomoe:
            from coli.bench.batch_decode import DropAllExperts
            self._nomoe[S] = self.prefill_s(S, DropAllExperts(self.K))
        return self._nomoe[S]

    def run(self, scenario: str, snapshot: Callable[[], dict] | None = None,
            report: Callable[[str], None] = lambda s: None, between: Callable[[], None] | None = None) -> None:
        """Every S on the engine in model.experts -> raw rows in self.raws; an S that fails is a not-run row.
        between(): called before each timed prefill (forget_resident on a layer-ahead engine)."""
        from coli.bench.stream import delta
        if not self._compiled:      # the process's first prefill compiles the prefill kernels: untimed
            try:
                self.prefill_s(min(COMPILE_TOKENS, min(self.sizes)))
                self._compiled = True
            except Exception as e:   # noqa: BLE001 -- the scenario's other rows go on
                self.raws.append({"scenario": scenario, "tokens": None, "run": False,
                                  "reason": f"first prefill: {type(e).__name__}: {e}"})
                return
        for S in self.sizes:
            report(f"{scenario} prefill of {S} tokens ...")
            try:
                if between is not None:
                    between()
                before = snapshot() if snapshot is not None else None
                t = self.prefill_s(S)
                raw = {"scenario": scenario, "tokens": S, "prefill_s": t,
                       "counters": delta(snapshot(), before) if snapshot is not None else None}
                raw["nomoe_s"] = self.nomoe_s(S)
                self.raws.append(raw)
                report(f"{scenario} prefill of {S} tokens: {t:.3f} s on the slice")
            except Exception as e:   # noqa: BLE001 -- one size failing must not cost the others
                import traceback
                self.raws.append({"scenario": scenario, "tokens": S, "run": False,
                                  "reason": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]})
                report(f"{scenario} prefill of {S} failed: {type(e).__name__}: {e}")


# ---- the printed table ---------------------------------------------------------------------------------------
PREFILL_HEADERS = ["scenario", "S", "slice ms", "GLM-5 TTFT s*", "copy-all s", "TTFT / copy-all", "copied GB (GLM-5)",
                   "MoE ms/layer", "compute ms/layer", "MoE TFLOP/s", "overlap", "ahead: TTFT s* (saved ms/layer)"]


def _f(v, fmt="{:.2f}") -> str:
    return "-" if v is None else fmt.format(v)


def prefill_table_rows(rows: list[dict]) -> list[list[str]]:
    """The printed TTFT table's cells (pure: tested)."""
    out = []
    for r in rows:
        if r.get("run") is False:
            out.append([r["scenario"], str(r.get("tokens") or "-"), f"not run: {r.get('reason')}"]
                       + [""] * (len(PREFILL_HEADERS) - 3))
            continue
        ratio = _f(r.get("ttft_over_copy_all"))
        if r.get("target"):
            ratio += f" (<= {r['target']['ttft_over_copy_all_max']:g}: {'met' if r['target']['met'] else 'NOT met'})"
        gb = r.get("copied_bytes_glm5")
        out.append([r["scenario"], str(r["tokens"]), _f(r["prefill_ms_slice"], "{:.1f}"), _f(r["ttft_s_glm5"]),
                    _f(r.get("copy_all_s_glm5")), ratio, _f(None if gb is None else gb / 1e9, "{:.0f}"),
                    _f(r["moe_layer_ms"], "{:.1f}"), _f(r.get("moe_compute_ms_per_layer"), "{:.1f}"),
                    _f(r.get("moe_tflops"), "{:.1f}"), _f(r.get("overlap")),
                    "-" if not r.get("ahead") else
                    f"{_f(r['ahead']['ttft_s_glm5'])} ({_f(r['ahead']['saved_ms_per_layer'], '{:.1f}')})"])
    return out


def print_prefill_table(res: dict, report: Callable[[str], None] = print) -> None:
    p = res.get("prefill") or {}
    if not p.get("rows"):
        return
    from coli.bench.batch_decode import print_rows
    print_rows("Prefill: time to first token of S prompt tokens (one forward)", PREFILL_HEADERS,
               prefill_table_rows(p["rows"]), EXTRAPOLATION_NOTE, report)
