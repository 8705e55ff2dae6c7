"""`coli bench stream --verify 2,3,4`: MTP's verify step on a scenario's engine, against the plain one-token step
(docs/performance.md "MTP verify step", docs/mtp.md "When it pays").

A verify step of S = k + 1 positions is what SpeculativeDecoder's verify runs for k drafts: model.forward_hidden over
S tokens of ONE sequence after its cache, the argmax of all S logits rows to the host, the cache truncated back (here
to the context itself, as a round that keeps nothing: every timed step sees the same context). The context is the
plain decode row's middle one (WARMUP + N // 2 positions), filled greedily from token 1 with trace tokens 0.. as the
scenario's own row routes them. Timed step j of S routes trace tokens C + j*S .. C + j*S + S - 1 (`WindowRoutes`:
consecutive tokens, so a MoE layer's union is the real adjacent-token union). S = 1 is the plain step timed the same
way (eager, all logits), the reference of every ratio. With COLI_VERIFY_GRAPHS=1 every step (S = 1 too, and the
no-routed-expert steps) is replayed from a CUDA graph where the engine allows it (coli/gpu/verify_graphs.py: the
forward_rows form, as SpeculativeDecoder then runs it), else eager as above; each row says how many of its timed
steps were replayed, and the no-expert reference of the split is measured per scenario then (replayed on warm, eager
on a streaming engine).

Split and GLM-5 extrapolation, as the batched rows (coli.bench.batch_decode) split a step of B rows:
    moe_layer_s(S)   = (T_step(S) - T_nomoe(S)) / L          T_nomoe(S): the same S-position step, no routed expert
    dense_layer_s(S) = (T_nomoe(S) - head_s(S)) / L          head_s(S): the lm_head over S rows, timed on its own
    T_glm5(S)        = 75 x moe_layer_s(S) + 78 x dense_layer_s(S) + head_s(S) x 154880 / V_slice
(T_step and T_nomoe: medians of N steps.) The MTP draft step: the slice has no MTP layer; GLM-5's is one more MoE +
dense layer plus the lm_head and eh_proj [H, 2H] over one row, so T_mtp = moe_layer_s(1) + dense_layer_s(1) +
head_s_full(1) + head_s(1) x 2H / V_slice (eh_proj as a GEMV of 2H x H weights in the lm_head's format), from the same
scenario's S = 1 figures. A round of k drafts: T_verify(k+1) + k x T_mtp for E(a) = (1 - a^(k+1)) / (1 - a) tokens at
acceptance a. The slice's random weights cannot accept drafts: the acceptance is a parameter (0.6 / 0.8 / 0.9, and
`auto`'s at --mtp-acceptance, default 0.8, the figure to put there being the demo model's measured one).
"""

from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np

from coli.bench.options import comma_parts, parse_int_list
from coli.errors import ColiError

VERIFY_SCENARIOS = ("warm", "cold-ram")     # the scenarios whose engine also runs the verify steps (as --batch)
ACCEPTANCES = (0.6, 0.8, 0.9)               # issue 16 §5: tok/s at these acceptances
DEFAULT_AUTO_ACCEPTANCE = 0.8
TARGET = {"warm": 1.5}                      # issue 16: >= 1.5x tok/s at acceptance 0.8, warm (cold-ram: reported)
TARGET_ACCEPTANCE = 0.8

EXTRAPOLATION_NOTE = (
    "verify rows: a step of S = k+1 positions of one sequence (forward_hidden, all S logits' argmax, cache cut back) "
    "split as a token is, against the same S-position step with every routed expert dropped and the lm_head over S "
    "rows: T_glm5(S) = 75 x moe_layer_s(S) + 78 x dense_layer_s(S) + head_s_full(S); S = 1 is the plain step timed "
    "the same way. T_mtp (the slice has no MTP layer) = one more MoE + dense layer + lm_head + eh_proj over one row, "
    "from the same scenario's S = 1 figures. tok/s at acceptance a = E / (T_verify(k+1) + k x T_mtp), E = (1 - "
    "a^(k+1)) / (1 - a); the slice's random weights cannot accept drafts: the acceptance is a parameter")


# ---- options (checked before the GPU) -------------------------------------------------------------------------
def max_positions() -> int:
    from coli.model.mtp import MAX_DRAFTS
    return MAX_DRAFTS + 1


def parse_verify(text: str) -> list[int]:
    """'2,3,4' -> [1, 2, 3, 4]: verify-step sizes in positions, sorted, each once, 1 (the plain step) always in."""
    parts = comma_parts(text)
    if not parts:
        raise ColiError("--verify: name at least one verify-step size in positions (e.g. 2,3,4)")
    top = max_positions()
    return parse_int_list(parts, "--verify", "verify-step sizes in positions", "2,3,4", 1, top,
                          f"a verify step is 1..{top} positions (k = {top - 1} MTP drafts at most, plus the token "
                          f"they follow)", start={1})


def parse_acceptance(value) -> float:
    """--mtp-acceptance: the draft acceptance `auto`'s rule is evaluated at, a probability in [0, 1]."""
    try:
        a = float(value)
    except (TypeError, ValueError):
        raise ColiError(f"--mtp-acceptance {value!r}: not a number (a first-draft acceptance in 0..1, e.g. the "
                        f"demo model's measured 0.8)") from None
    if not 0.0 <= a <= 1.0 or a != a:
        raise ColiError(f"--mtp-acceptance {value}: an acceptance is a probability in 0..1")
    return a


def check_verify(sizes: list[int], scenarios: list[str], trace_tokens: int) -> None:
    """Refuse a --verify that cannot run: no warm/cold-ram scenario asked, or a step of more positions than the
    trace has tokens (its positions must route distinct trace tokens)."""
    from coli.bench.batch_decode import check_row_sizes
    check_row_sizes("--verify", sizes, scenarios, trace_tokens, "verify steps", ", fewer than the step's positions")


# ---- the arithmetic (pure) -----------------------------------------------------------------------------------
def tokens_per_round(a: float, k: int) -> float:
    """E[tokens a round of k drafts emits] at acceptance a (each draft kept with probability a while the ones before
    it were): 1 + a + ... + a^k."""
    return float(k + 1) if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)


def round_s(t_verify: float, t_mtp: float, k: int) -> float:
    """A round's time: one verify step of k+1 positions and k MTP draft steps."""
    return t_verify + k * t_mtp


def speedup(a: float, k: int, t1: float, t_verify: float, t_mtp: float) -> float:
    """tok/s with k drafts at acceptance a over plain decoding (one token per t1)."""
    return tokens_per_round(a, k) * t1 / round_s(t_verify, t_mtp, k)


def break_even(k: int, t1: float, t_verify: float, t_mtp: float) -> float | None:
    """The acceptance at which k drafts match plain decoding: 0.0 where a round costs no more than a plain step (it
    pays at any acceptance), None where it costs k+1 plain steps or more (it pays at none)."""
    need = round_s(t_verify, t_mtp, k) / t1         # tokens a round must yield to pay
    if need <= 1.0:
        return 0.0
    if need >= k + 1:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(60):                              # tokens_per_round rises monotonically in a
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if tokens_per_round(mid, k) < need else (lo, mid)
    return hi


def auto_choice(t1: float, t_round1: float, a: float) -> str:
    """What `--mtp auto` settles on given these costs: AutoChoice's own rule (coli.model.mtp) fed a plain round of
    1 token in t1 and a drafting round (k = 1) of 1 + a tokens in t_round1 -> "on" (k = 1) or "off"."""
    from coli.model.mtp import AutoChoice
    auto = AutoChoice()
    auto.record(0, t1, 1)
    auto.record(1, t_round1, tokens_per_round(a, 1))
    return "on" if auto.best() == 1 else "off"


def mtp_step_s(moe_layer_s: float, dense_layer_s: float, head_s: float, eh_s: float) -> float:
    """GLM-5's MTP draft step estimated from a step's per-layer figures: its decoder layer (one MoE + one dense
    layer), the shared lm_head and eh_proj, over one row (enorm / hnorm / shared_head.norm: negligible)."""
    return moe_layer_s + dense_layer_s + head_s + eh_s


# ---- the measurement ------------------------------------------------------------------------------------------
class WindowRoutes:
    """model.route_override for one sequence's steps: the S rows of the next forward call route trace tokens
    start .. start + S - 1 (wrapping), `start` set by at() before each call. Counts the distinct experts of every
    MoE layer of every call while `counting`."""

    def __init__(self, routing):
        self.idx, self.weights = routing.idx, routing.weights          # [T, L, K] int64 (-1: dropped), float32
        self._slot, self._first = routing._slot, routing._first
        self.T = int(self.idx.shape[0])
        self.start = 0
        self._rows: np.ndarray | None = None
        self.counting = False
        self.distinct: list[list[int]] = []        # per counted call: distinct experts per MoE layer

    def at(self, start: int) -> None:
        self.start, self._rows = int(start) % self.T, None

    def __call__(self, layer: int, n_rows: int) -> tuple[np.ndarray, np.ndarray]:
        slot = self._slot.get(int(layer))
        if slot is None:
            raise ColiError(f"the routing trace has no layer {layer}")
        if int(layer) == self._first or self._rows is None:
            self._rows = (self.start + np.arange(n_rows)) % self.T
            if self.counting:
                self.distinct.append([])
        elif n_rows != len(self._rows):
            raise ColiError(f"layer {layer} routes {n_rows} rows, the first MoE layer of this step routed "
                            f"{len(self._rows)}")
        idx = self.idx[self._rows, slot]                                # [S, K]
        if self.counting:
            self.distinct[-1].append(len(set(idx.ravel().tolist()) - {-1}))
        return idx, self.weights[self._rows, slot]


def verify_step(model, cache, ids: list[int]) -> np.ndarray:
    """One verify step: ids [S] after the cache's positions, every row's greedy token to the host (what
    SpeculativeDecoder's greedy accept reads), the cache cut back to where it was. -> argmax [S]."""
    P = cache.length
    _, logits = model.forward_hidden(ids, cache)                      # [S, H], [S, V] on the backend
    top = model.backend.argmax(logits)                                 # [S] host
    cache.truncate(P)
    return np.asarray(top, dtype=np.int64)


def one_by_one(model, cache, route: WindowRoutes, first: int, start: int, S: int) -> list[int]:
    """S greedy steps of one position each from `first`, position j routing trace token start + j (the positions a
    verify step at `start` routes): their S tokens; the cache cut back to where it was."""
    P, tok, out = cache.length, int(first), []
    for j in range(S):
        route.at(start + j)
        _, logits = model.forward_hidden([tok], cache)
        tok = int(model.backend.argmax(logits)[-1])
        out.append(tok)
    cache.truncate(P)
    return out


class VerifyBench:
    """The verify rows of one run: per S, the no-routed-expert step and the lm_head over S rows (measured once,
    shared by the scenarios), and per scenario the S-position steps on the engine installed in model.experts."""

    def __init__(self, model, routing, tokens: int, warmup: int, sync: Callable[[], None] = lambda: None,
                 replay: bool = False):
        self.model, self.routing, self.N, self.warmup, self.sync = model, routing, int(tokens), int(warmup), sync
        c = model.config
        # replay: the steps replayed from CUDA graphs (coli/gpu/verify_graphs.py) where the engine allows it (every
        # expert resident), as SpeculativeDecoder runs them with COLI_VERIFY_GRAPHS=1; the first two steps of each
        # shape (eager, then the capture) fall in the warm-up
        make = getattr(model.backend, "verify_graphs", None) if replay else None
        self.graphs = make(model, force=True) if make is not None else None
        self.L, self.K, self.V = len(c.moe_layers), c.num_experts_per_tok, c.vocab_size
        self.context = self.warmup + self.N // 2        # the plain decode row's middle context
        self._nomoe: dict[tuple, float] = {}     # (S, scenario or None) -> s
        self._head: dict[int, float] = {}

    def fill(self, route: WindowRoutes):
        """A cache of `context` positions, decoded greedily from token 1 with trace tokens 0.. (the scenario's own
        row's first steps) -> (cache, the token that follows it)."""
        m = self.model
        cache = m.new_cache(self.context + max_positions() + 8)
        tok = 1
        for i in range(self.context):
            route.at(i)
            _, logits = m.forward_hidden([tok], cache)
            tok = int(m.backend.argmax(logits)[-1])
        return cache, tok

    def _timed(self, cache, ids: list[int], starts: Callable[[int], int], route, before=None) -> tuple[list, bool]:
        """warmup + N verify steps (step j at window starts(j)), the last N timed between two sync() calls ->
        (seconds per timed step, whether the cache was back at its length after every step)."""
        saved = self.model.route_override
        self.model.route_override = route
        try:
            C, times, restored = cache.length, [], True
            for j in range(self.warmup + self.N):
                if isinstance(route, WindowRoutes):
                    route.at(starts(j))
                if j == self.warmup:
                    if isinstance(route, WindowRoutes):
                        route.counting = True
                    if before is not None:
                        before()
                self.sync()
                t0 = time.perf_counter()
                self._step(cache, ids)
                self.sync()
                if j >= self.warmup:
                    times.append(time.perf_counter() - t0)
                restored = restored and cache.length == C
            if isinstance(route, WindowRoutes):
                route.counting = False
            return times, restored
        finally:
            self.model.route_override = saved

    def _step(self, cache, ids: list[int]) -> np.ndarray:
        """One verify step (verify_step), replayed where self.graphs can: its argmax [S], the cache cut back."""
        if self.graphs is not None:
            P = cache.length
            got = self.graphs.greedy(cache, ids)
            if got is not None:
                cache.truncate(P)
                return np.asarray(got[0], dtype=np.int64)
        return verify_step(self.model, cache, ids)

    def nomoe_step_s(self, S: int, cache=None, ids: list[int] | None = None, scenario: str | None = None) -> float:
        """The S-position step with every routed expert dropped (median), on `cache` (at the context) or a fresh
        one; measured once per S, shared by the scenarios -- once per S and scenario where steps are replayed
        (self.graphs): a warm engine replays it, a streaming one runs it eagerly, and each step's split must be
        against its own kind."""
        key = (S, scenario if self.graphs is not None else None)
        if key not in self._nomoe:
            from coli.bench.batch_decode import DropAllExperts
            if cache is None:
                cache, tok = self._filled(WindowRoutes(self.routing))
                ids = [tok] * S
            times, _ = self._timed(cache, list(ids), lambda j: 0, DropAllExperts(self.K))
            self._nomoe[key] = float(np.median(times))
        return self._nomoe[key]

    def head_s(self, S: int) -> float:
        if S not in self._head:
            from coli.bench.batch_decode import time_head
            self._head[S] = time_head(self.model, S, self.sync)
        return self._head[S]

    def _filled(self, route: WindowRoutes):
        saved = self.model.route_override
        self.model.route_override = route
        try:
            return self.fill(route)
        finally:
            self.model.route_override = saved

    def run(self, scenario: str, sizes: list[int], snapshot: Callable[[], dict] | None = None,
            report: Callable[[str], None] = lambda s: None) -> list[dict]:
        """Every S of `sizes` on the engine in model.experts, over one filled context -> raw rows; an S that fails
        is a not-run row and the others still run. snapshot: the engine's counters (copy_bytes...), taken around
        the timed steps."""
        route = WindowRoutes(self.routing)
        cache, first = self._filled(route)
        C = self.context
        out = []
        for S in sorted(set(sizes) | {1}):
            report(f"{scenario} verify step of {S} ...")
            try:
                out.append(self._run_one(scenario, S, cache, first, route, snapshot))
            except Exception as e:   # noqa: BLE001 -- one step size failing must not cost the others
                import traceback
                out.append({"scenario": scenario, "positions": S, "run": False, "reason": f"{type(e).__name__}: {e}",
                            "traceback": traceback.format_exc()[-3000:]})
                report(f"{scenario} verify step of {S} failed: {type(e).__name__}: {e}")
                if cache.length != C:
                    cache.truncate(C)
        return out

    def _run_one(self, scenario, S, cache, first, route, snapshot) -> dict:
        C = self.context
        # the greedy continuation at the first window: the drafts a round that keeps them all would verify
        saved = self.model.route_override
        self.model.route_override = route
        try:
            alone = one_by_one(self.model, cache, route, first, C, S)
            ids = [first] + alone[:-1]
            route.at(C)
            together = verify_step(self.model, cache, ids).tolist()
        finally:
            self.model.route_override = saved
        marks: dict[str, Any] = {}
        g = self.graphs

        def before():                             # the timed steps start: counters and replays from here
            if snapshot is not None:
                marks["snap"] = snapshot()
            if g is not None:
                marks["replays"] = g.replays
        route.distinct = []
        times, restored = self._timed(cache, ids, lambda j: C + j * S, route, before)
        raw = {"scenario": scenario, "positions": S, "context": C, "step_s": times, "distinct": route.distinct,
               "ids": ids, "one_by_one": alone, "verify_tokens": together, "cache_restored": restored}
        if g is not None:                         # of the timed steps: how many replayed, why the last one not
            raw["replays"], raw["eager_reason"] = g.replays - marks["replays"], g.last_reason
        if snapshot is not None:
            from coli.bench.stream import delta
            after = snapshot()
            raw["counters"] = delta(after, marks["snap"])
            raw["vram_slots"] = after.get("vram_slots")
        if g is not None:                         # after the counters: an untimed step, its tokens checked
            saved = self.model.route_override
            self.model.route_override = route
            try:
                route.at(C)
                raw["replayed_tokens"] = self._step(cache, ids).tolist()   # against one_by_one, as verify_tokens
            finally:
                self.model.route_override = saved
        self.nomoe_step_s(S, cache, ids, scenario)   # on the same context, after the counted steps
        return raw

    def rows(self, scenario: str, sizes: list[int], snapshot=None, record_bytes: int = 0,
             report: Callable[[str], None] = lambda s: None) -> list[dict]:
        """-> the step rows (verify_figures) of every S, then ratios against S = 1 (add_step_ratios)."""
        out = []
        for raw in self.run(scenario, sizes, snapshot, report):
            if raw.get("run") is False:
                out.append(raw)
                continue
            S = raw["positions"]
            out.append(verify_figures(raw, L=self.L, nomoe_step_s=self.nomoe_step_s(S, scenario=scenario),
                                      head_s=self.head_s(S),
                                      vocab=self.V, record_bytes=record_bytes))
        add_step_ratios(out)
        return out


# ---- figures (pure) -------------------------------------------------------------------------------------------
def verify_figures(raw: dict, *, L: int, nomoe_step_s: float | None, head_s: float, vocab: int,
                   record_bytes: int) -> dict:
    """One verify-step row's reported figures from its raw measurements (pure)."""
    from coli.bench.stream import GLM5_MOE_LAYERS, GLM5_VOCAB, split_times, summarise
    S, N = raw["positions"], len(raw["step_s"])
    step = float(np.median(raw["step_s"]))
    out: dict[str, Any] = {"scenario": raw["scenario"], "positions": S, "drafts": S - 1, "tokens": N,
                           "context": raw.get("context"),
                           "step_ms": {k: (v * 1e3 if isinstance(v, float) else v)
                                       for k, v in summarise(raw["step_s"]).items()},
                           "step_s_slice": step, "head_ms": head_s * 1e3}
    head_full = head_s * GLM5_VOCAB / max(vocab, 1)
    if nomoe_step_s is not None:
        moe, dense = split_times(step, nomoe_step_s, L, head_s)
        out.update(moe_layer_ms=moe * 1e3, dense_layer_ms=dense * 1e3, nomoe_step_ms=nomoe_step_s * 1e3,
                   step_s_glm5=GLM5_MOE_LAYERS * moe + 78 * dense + head_full, head_s_full=head_full)
    else:
        out.update(moe_layer_ms=None, dense_layer_ms=None, step_s_glm5=None)
    d = np.asarray(raw["distinct"], dtype=np.float64)                  # [steps, MoE layers]
    per_layer = float(d.mean()) if d.size else None
    out["distinct_experts_per_layer_step"] = {"mean": per_layer, "max": int(d.max()) if d.size else None,
                                              "per_layer_mean": d.mean(axis=0).tolist() if d.size else []}
    if per_layer is not None and record_bytes:
        out["union_bytes_per_step"] = per_layer * L * record_bytes          # what a step's kernels read (slice)
        out["glm5_union_bytes_per_step"] = per_layer * GLM5_MOE_LAYERS * record_bytes
    c = raw.get("counters")
    if c is not None:                                                   # a streaming engine's counters
        out["copied_bytes_per_step"] = c.get("copy_bytes", 0) / N if N else None
        out["copies_per_step"] = c.get("copies", 0) / N if N else None
        out["union_copied_once"] = c.get("copies") == int(d.sum())     # retain off: each of the union crossed once
        out["cpu_fallbacks"] = c.get("cpu_fallbacks")
        out["vram_slots"] = raw.get("vram_slots")
    # the verify step's greedy tokens against the same positions run one at a time (on the GPU: a figure)
    v = raw.get("verify_tokens")
    out["verify_equals_one_by_one"] = None if v is None else (len(v) == S and v == raw.get("one_by_one"))
    out["cache_restored"] = raw.get("cache_restored")
    if "replays" in raw:                # replayed from graphs (VerifyBench(replay=True)): how many, and its tokens
        rt = raw.get("replayed_tokens")
        out["replays"], out["eager_reason"] = raw["replays"], raw.get("eager_reason")
        out["replayed_equals_one_by_one"] = None if rt is None else (len(rt) == S and rt == raw.get("one_by_one"))
    return out


def add_step_ratios(rows: list[dict]) -> None:
    """x S=1: each step row's time over the S = 1 row of its scenario (slice and GLM-5)."""
    ref = {r["scenario"]: r for r in rows if r.get("positions") == 1 and r.get("run") is not False}
    for r in rows:
        one = ref.get(r["scenario"]) or {}
        for key, name in (("step_s_slice", "x_s1_slice"), ("step_s_glm5", "x_s1_glm5")):
            a, b = r.get(key), one.get(key)
            r[name] = a / b if a is not None and b else None


def mtp_rows(steps: list[dict], hidden: int, vocab: int, auto_acceptance: float = DEFAULT_AUTO_ACCEPTANCE,
             acceptances=ACCEPTANCES) -> list[dict]:
    """Per scenario and k (its S = k+1 step measured): what MTP with k drafts would give, from the step rows (pure).
    T_mtp from the scenario's S = 1 row (mtp_step_s); figures on the slice and extrapolated to GLM-5."""
    from coli.bench.stream import GLM5_VOCAB
    out = []
    for scenario in dict.fromkeys(r["scenario"] for r in steps):
        mine = {r["positions"]: r for r in steps if r["scenario"] == scenario and r.get("run") is not False}
        one = mine.get(1)
        if one is None or one.get("moe_layer_ms") is None:
            continue
        moe1, dense1 = one["moe_layer_ms"] / 1e3, one["dense_layer_ms"] / 1e3
        head1 = one["head_ms"] / 1e3
        eh = head1 * 2 * hidden / max(vocab, 1)           # eh_proj [H, 2H] as a GEMV in the lm_head's [V, H] format
        t_mtp = {"slice": mtp_step_s(moe1, dense1, head1, eh),
                 "glm5": mtp_step_s(moe1, dense1, head1 * GLM5_VOCAB / max(vocab, 1), eh)}
        t1 = {"slice": one["step_s_slice"], "glm5": one["step_s_glm5"]}
        for S in sorted(mine):
            if S == 1:
                continue
            k, row = S - 1, mine[S]
            tv = {"slice": row["step_s_slice"], "glm5": row["step_s_glm5"]}
            r: dict[str, Any] = {"scenario": scenario, "drafts": k, "positions": S,
                                 "mtp_step_ms_glm5": t_mtp["glm5"] * 1e3, "mtp_step_ms_slice": t_mtp["slice"] * 1e3,
                                 "mtp_step_note": "estimated: no MTP layer in the slice; one more MoE + dense layer "
                                                  "+ lm_head + eh_proj over one row, from this scenario's S = 1 step",
                                 "verify_over_plain_glm5": tv["glm5"] / t1["glm5"],
                                 "verify_over_plain_slice": tv["slice"] / t1["slice"]}
            for where in ("glm5", "slice"):
                rs = round_s(tv[where], t_mtp[where], k)
                r[f"round_ms_{where}"] = rs * 1e3
                r[f"plain_tokens_per_s_{where}"] = 1.0 / t1[where]
                r[f"tokens_per_s_{where}"] = {str(a): tokens_per_round(a, k) / rs for a in acceptances}
                r[f"speedup_{where}"] = {str(a): speedup(a, k, t1[where], tv[where], t_mtp[where])
                                         for a in acceptances}
                r[f"break_even_acceptance_{where}"] = break_even(k, t1[where], tv[where], t_mtp[where])
            if k == 1:
                a = auto_acceptance
                r["auto"] = {"acceptance": a, "choice": auto_choice(t1["glm5"], r["round_ms_glm5"] / 1e3, a),
                             "speedup_k1_glm5": speedup(a, 1, t1["glm5"], tv["glm5"], t_mtp["glm5"])}
                r["auto"]["mtp_would_lose"] = r["auto"]["speedup_k1_glm5"] <= 1.0
            out.append(r)
    return out


def add_decode_ratios(mtp: list[dict], scenario_rows: list[dict], acceptance: float) -> None:
    """x decode: MTP's GLM-5 tok/s at `acceptance` over the scenario's own decode row (model.greedy: a replayed CUDA
    graph where graphs are on, which the eager S = 1 step is not)."""
    ref = {r.get("scenario"): r.get("tokens_per_s_glm5") for r in scenario_rows}
    for r in mtp:
        plain = ref.get(r["scenario"])
        k = r["drafts"]
        rs = r["round_ms_glm5"] / 1e3
        r["x_decode_row_glm5"] = {"acceptance": acceptance, "decode_row_tokens_per_s_glm5": plain,
                                  "x": tokens_per_round(acceptance, k) / rs / plain if plain else None}


def acceptance(mtp: list[dict], at: float = TARGET_ACCEPTANCE) -> dict:
    """Per scenario: the best k's GLM-5 speed-up at acceptance `at` against issue 16's target (warm >= 1.5x;
    cold-ram: reported), and what auto chooses."""
    out = {}
    for scenario in VERIFY_SCENARIOS:
        mine = [r for r in mtp if r["scenario"] == scenario]
        best = max(mine, key=lambda r: r["speedup_glm5"].get(str(at), 0.0), default=None)
        x = None if best is None else best["speedup_glm5"].get(str(at))
        target = TARGET.get(scenario)
        auto = next((r["auto"] for r in mine if "auto" in r), None)
        out[scenario] = {"acceptance": at, "best_drafts": None if best is None else best["drafts"], "speedup_glm5": x,
                         "target": target, "met": None if x is None or target is None else x >= target,
                         "auto": auto}
    return out


# ---- the printed table ---------------------------------------------------------------------------------------
VERIFY_HEADERS = ["scenario", "S", "ms/step", "xS1", "GLM-5 ms/step*", "experts /layer", "GLM-5 MB/step",
                  "copied MB/step", "=1 by 1", "T_mtp ms*", "a=0.6 tok/s (x)", "a=0.8 tok/s (x)", "a=0.9 tok/s (x)",
                  "break-even a", "x decode row"]


def _f(v, fmt="{:.2f}") -> str:
    return "-" if v is None else fmt.format(v)


def verify_table_rows(steps: list[dict], mtp: list[dict]) -> list[list[str]]:
    """The printed verify table's cells (pure: tested): a row per scenario and S, MTP's figures on the S = k+1 rows
    (GLM-5 extrapolated), the plain tok/s on S = 1."""
    by = {(r["scenario"], r["positions"]): r for r in mtp}
    out = []
    for r in steps:
        if r.get("run") is False:
            out.append([r["scenario"], str(r.get("positions", "-")), f"not run: {r.get('reason')}"]
                       + [""] * (len(VERIFY_HEADERS) - 3))
            continue
        mb = lambda v: None if v is None else v / 1e6     # noqa: E731
        cells = [r["scenario"], str(r["positions"]), _f(r["step_ms"]["p50"]), _f(r.get("x_s1_glm5")),
                 _f(None if r.get("step_s_glm5") is None else r["step_s_glm5"] * 1e3, "{:.1f}"),
                 _f(r["distinct_experts_per_layer_step"]["mean"], "{:.1f}"),
                 _f(mb(r.get("glm5_union_bytes_per_step")), "{:.0f}"),
                 _f(mb(r.get("copied_bytes_per_step")), "{:.1f}"),
                 "yes" if (r.get("verify_equals_one_by_one") and r.get("cache_restored")
                           and r.get("replayed_equals_one_by_one") is not False) else "NO"]
        m = by.get((r["scenario"], r["positions"]))
        if m is None:
            plain = None if not r.get("step_s_glm5") or r["positions"] != 1 else 1.0 / r["step_s_glm5"]
            cells += ["-"] + [f"{_f(plain)} (1.00)" if plain else "-"] * len(ACCEPTANCES) + ["-", "-"]
        else:
            tps, x = m["tokens_per_s_glm5"], m["speedup_glm5"]
            cells += [_f(m["mtp_step_ms_glm5"], "{:.1f}")]
            cells += [f"{_f(tps.get(str(a)))} ({_f(x.get(str(a)))})" for a in ACCEPTANCES]
            cells += [_f(m["break_even_acceptance_glm5"], "{:.3f}") if m["break_even_acceptance_glm5"] is not None
                      else "never", _f((m.get("x_decode_row_glm5") or {}).get("x"))]
        out.append(cells)
    return out


def print_verify_table(res: dict, report: Callable[[str], None] = print) -> None:
    v = res.get("verify") or {}
    if not v.get("steps"):
        return
    from coli.bench.batch_decode import print_rows
    print_rows(f"MTP verify step: S = k+1 positions of one sequence ({res['tokens']} steps, context {v['context']})",
               VERIFY_HEADERS, verify_table_rows(v["steps"], v.get("mtp") or []), EXTRAPOLATION_NOTE, report)
    for r in v["steps"]:
        if "replays" in r:                  # COLI_VERIFY_GRAPHS=1: how the timed steps ran
            how = (f"{r['replays']} replayed from a CUDA graph" if r["replays"] else
                   f"eager ({r.get('eager_reason') or 'not replayed'})")
            report(f"{r['scenario']} verify step of {r['positions']}: {how}")
    for name, a in (v.get("acceptance") or {}).items():
        if a["speedup_glm5"] is not None:
            goal = (f" (issue 16 target >= {a['target']:g}: {'met' if a['met'] else 'NOT met'})"
                    if a["target"] is not None else " (reported)")
            report(f"{name}: best k = {a['best_drafts']} gives {a['speedup_glm5']:.2f} x plain tok/s at acceptance "
                   f"{a['acceptance']:g}{goal}")
        au = a.get("auto")
        if au:
            report(f"{name}: --mtp auto at acceptance {au['acceptance']:g} (a parameter: --mtp-acceptance) -> "
                   f"{au['choice']} (k = 1: {au['speedup_k1_glm5']:.2f} x plain)")
