"""`coli bench stream --batch 1,4,8,16`: B sequences decoding together on a scenario's engine (docs/performance.md,
"Batched decode").

Each sequence b of a batch of B starts from its own token (1 + b) and replays its own stretch of the slice's
routing trace: trace token starts[b] + t at its t-th step (starts[b] = b x (T // B), T the trace's tokens, so
sequence 0 of every B routes what the single-sequence scenario routes). A step is one greedy_batch over the B rows:
each MoE layer asks the engine for the union of the rows' experts once. `SequenceRoutes` is that routing (a
model.route_override); it counts the distinct experts of every MoE layer of every step.

GLM-5 extrapolation of a step of B rows, the single-token split applied to the step:
    moe_layer_s(B)   = (T_step(B) - T_nomoe(B)) / L      T_nomoe(B): the same B-row step, every routed expert dropped
    dense_layer_s(B) = (T_nomoe(B) - head_s(B)) / L      head_s(B): the lm_head over B rows, timed on its own
    GLM-5 aggregate tokens/s = B / (75 x moe_layer_s(B) + 78 x dense_layer_s(B) + head_s(B) x 154880 / V_slice)
"""

from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np

from coli.bench.options import comma_parts, parse_int_list
from coli.errors import ColiError

BATCH_SCENARIOS = ("warm", "cold-ram")     # the scenarios whose engine also runs the batched rows
MAX_BATCH = 256                            # the union saturates at a layer's experts long before this

EXTRAPOLATION_NOTE = (
    "batched rows: a step of B rows is timed as one forward over the B sequences; it splits as a token does, against "
    "the same B-row step with every routed expert dropped and the lm_head over B rows: GLM-5 aggregate tokens/s = B / "
    "(75 x moe_layer_s(B) + 78 x dense_layer_s(B) + head_s_full(B)); per-sequence tokens/s = aggregate / B; "
    "x B=1 = the aggregate over the same scenario's B=1 aggregate, same run")


def parse_batches(text: str) -> list[int]:
    """'1,4,8,16' -> [1, 4, 8, 16] (sorted, each once). A bad value is a ColiError naming it."""
    parts = comma_parts(text)
    if not parts:
        raise ColiError("--batch: name at least one batch size (e.g. 1,4,8,16)")
    return parse_int_list(parts, "--batch", "batch sizes", "1,4,8,16", 1, MAX_BATCH,
                          f"batch sizes are 1..{MAX_BATCH} concurrent sequences")


def check_batches(batches: list[int], scenarios: list[str], trace_tokens: int) -> None:
    """Refuse a --batch that cannot run: no warm/cold-ram scenario asked, or more sequences than the trace has
    tokens (each sequence needs its own start in it)."""
    check_row_sizes("--batch", batches, scenarios, trace_tokens, "batched rows",
                    " and each sequence needs its own start in it")


def check_row_sizes(option: str, sizes: list[int], scenarios: list[str], trace_tokens: int, rows: str,
                    why_more: str) -> None:
    """The checks --batch and --verify share: their rows run on the warm and cold-ram engines (BATCH_SCENARIOS), and
    a size above the trace's tokens cannot route distinct trace tokens; `rows` names what the option runs, `why_more`
    says (after the trace's token count) why a larger size cannot. A size list of just 1 asks nothing."""
    if sizes == [1]:
        return
    if not set(BATCH_SCENARIOS) & set(scenarios):
        listed = ",".join(map(str, sizes))
        raise ColiError(f"{option} {listed}: {rows} run in the {' and '.join(BATCH_SCENARIOS)} scenarios; "
                        f"--scenario asks for neither")
    if max(sizes) > trace_tokens:
        raise ColiError(f"{option} {max(sizes)}: the slice's routing trace has {trace_tokens} tokens{why_more} "
                        f"(make the slice with --tokens {max(sizes)} or more)")


def sequence_starts(B: int, trace_tokens: int) -> list[int]:
    """Trace token each of B sequences starts at: evenly spread, sequence 0 at 0."""
    stride = max(trace_tokens // B, 1)
    return [(b * stride) % trace_tokens for b in range(B)]


def first_tokens(B: int, vocab: int) -> list[int]:
    """Each sequence's first input token (sequence 0: 1, as the single-sequence scenario decodes)."""
    return [(1 + b) % vocab for b in range(B)]


class SequenceRoutes:
    """model.route_override replaying a trace per sequence: row r of a call routes trace token cursors[r], each
    cursor advancing by one per call (a decode step: one row per sequence). Counts the distinct experts of every
    MoE layer of every call while `counting`."""

    def __init__(self, routing, starts: list[int]):
        self.idx, self.weights = routing.idx, routing.weights          # [T, L, K] int64 (-1: dropped), float32
        self._slot, self._first = routing._slot, routing._first
        self.T = int(self.idx.shape[0])
        self.cursors = [int(s) % self.T for s in starts]
        self._rows: np.ndarray | None = None
        self.counting = False
        self.distinct: list[list[int]] = []        # per counted call: distinct experts per MoE layer

    def __call__(self, layer: int, n_rows: int) -> tuple[np.ndarray, np.ndarray]:
        slot = self._slot.get(int(layer))
        if slot is None:
            raise ColiError(f"the routing trace has no layer {layer}")
        if n_rows != len(self.cursors):
            raise ColiError(f"layer {layer} routes {n_rows} rows; a batched decode step has one row per sequence "
                            f"({len(self.cursors)})")
        if int(layer) == self._first or self._rows is None:
            self._rows = np.array(self.cursors)
            self.cursors = [(c + 1) % self.T for c in self.cursors]
            if self.counting:
                self.distinct.append([])
        idx = self.idx[self._rows, slot]                                # [B, K]
        if self.counting:
            self.distinct[-1].append(len(set(idx.ravel().tolist()) - {-1}))
        return idx, self.weights[self._rows, slot]


def decode_batch(model, route, firsts: list[int], tokens: int, warmup: int,
                 sync: Callable[[], None] = lambda: None, before: Callable[[], None] | None = None) -> dict:
    """len(firsts) sequences decoding together with `route` as the model's routing: `warmup` untimed steps, then
    `tokens` steps each timed between two sync() calls. -> {"step_s": [...], "tokens": per sequence, every token}."""
    from coli.model.batch import BatchRow, greedy_batch
    saved = model.route_override
    model.route_override = route
    try:
        B = len(firsts)
        caches = [model.new_cache(warmup + tokens + 8) for _ in range(B)]
        last = list(firsts)
        seqs: list[list[int]] = [[] for _ in range(B)]

        def step():
            nonlocal last
            last = greedy_batch(model, [BatchRow(c, [t]) for c, t in zip(caches, last)])
            for s, t in zip(seqs, last):
                s.append(int(t))
        for _ in range(warmup):
            step()
        if isinstance(route, SequenceRoutes):
            route.counting = True
        if before is not None:
            before()
        times = []
        for _ in range(tokens):
            sync()
            t0 = time.perf_counter()
            step()
            sync()
            times.append(time.perf_counter() - t0)
        if isinstance(route, SequenceRoutes):
            route.counting = False
        return {"step_s": times, "tokens": seqs}
    finally:
        model.route_override = saved


class DropAllExperts:
    """Route override with every routed slot dropped (idx -1): the step without its routed experts (the batched
    and the streaming benchmarks' no-routed-expert decode)."""

    def __init__(self, k: int):
        self.k = k

    def __call__(self, layer: int, n: int):
        return np.full((n, self.k), -1, np.int64), np.zeros((n, self.k), np.float32)


def time_head(model, rows: int, sync: Callable[[], None] = lambda: None, reps: int = 20) -> float:
    """Seconds of the lm_head over `rows` rows on the model's backend (mean of `reps`, after one untimed): the head
    share of a step of that many rows (a memory-bound GEMV that the extrapolation scales to GLM-5's vocabulary)."""
    b = model.backend
    x = b.upload(np.zeros((rows, model.config.hidden_size), np.float32))      # [rows, H]
    b.linear(x, model.lm_head)
    sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        b.linear(x, model.lm_head)
    sync()
    return (time.perf_counter() - t0) / reps


class BatchBench:
    """The batched rows of one run: per B, the no-routed-expert step and the lm_head over B rows (measured once,
    shared by the scenarios), and per scenario the B-sequence decode on the engine installed in model.experts."""

    def __init__(self, model, routing, tokens: int, warmup: int, sync: Callable[[], None] = lambda: None):
        self.model, self.routing, self.N, self.warmup, self.sync = model, routing, int(tokens), int(warmup), sync
        c = model.config
        self.L, self.K, self.V = len(c.moe_layers), c.num_experts_per_tok, c.vocab_size
        self._nomoe: dict[int, float] = {}
        self._head: dict[int, float] = {}

    def nomoe_step_s(self, B: int) -> float:
        if B not in self._nomoe:
            d = decode_batch(self.model, DropAllExperts(self.K), first_tokens(B, self.V), self.N, self.warmup, self.sync)
            self._nomoe[B] = float(np.mean(d["step_s"]))
        return self._nomoe[B]

    def head_s(self, B: int) -> float:
        if B not in self._head:
            self._head[B] = time_head(self.model, B, self.sync)
        return self._head[B]

    def run(self, scenario: str, B: int, snapshot: Callable[[], dict] | None = None) -> dict:
        """B sequences on the engine in model.experts. snapshot: the engine's counters (copy_bytes...), taken
        around the timed steps."""
        routes = SequenceRoutes(self.routing, sequence_starts(B, self.routing.n_tokens))
        marks: dict[str, Any] = {}

        def before():
            marks["graphs"] = graph_counters(self.model)
            if snapshot is not None:
                marks["snap"] = snapshot()
        d = decode_batch(self.model, routes, first_tokens(B, self.V), self.N, self.warmup, self.sync, before)
        raw = {"scenario": scenario, "batch": B, "step_s": d["step_s"], "tokens": d["tokens"],
               "distinct": routes.distinct, "starts": sequence_starts(B, self.routing.n_tokens),
               "graphs": graph_counters(self.model, since=marks["graphs"])}
        if snapshot is not None:
            from coli.bench.stream import delta
            after = snapshot()
            raw["counters"] = delta(after, marks["snap"])
            raw["vram_slots"] = after.get("vram_slots")         # a size, not a counter
        return raw

    def rows(self, scenario: str, batches: list[int], snapshot=None, record_bytes: int = 0,
             report: Callable[[str], None] = lambda s: None) -> list[dict]:
        """Every B of `batches` (1 first: the reference) on the current engine -> figure rows (batch_figures); a B
        that fails is a not-run row and the others still run (a B = 16 out of memory keeps B = 1..8)."""
        want = sorted(set(batches) | {1})
        raws = []
        for B in want:
            report(f"{scenario} batch {B} ...")
            try:
                raws.append(self.run(scenario, B, snapshot))
            except Exception as e:   # noqa: BLE001 -- one batch size failing must not cost the others
                import traceback
                raws.append({"scenario": scenario, "batch": B, "run": False, "reason": f"{type(e).__name__}: {e}",
                             "traceback": traceback.format_exc()[-3000:]})
                report(f"{scenario} batch {B} failed: {type(e).__name__}: {e}")
        ref = raws[0]["tokens"][0] if raws[0].get("run") is not False else None
        out = []
        for raw in raws:
            if raw.get("run") is False:
                out.append(raw)
                continue
            B = raw["batch"]
            out.append(batch_figures(raw, L=self.L, nomoe_step_s=self.nomoe_step_s(B), head_s=self.head_s(B),
                                     vocab=self.V, record_bytes=record_bytes, ref_tokens=ref))
        add_ratios(out)
        return out


def graph_counters(model, since: dict | None = None) -> dict:
    """Replayed steps so far (since `since`): the single-sequence decode graphs (B = 1 takes model.greedy) and
    the batched ones (COLI_BATCH_GRAPHS=1), with why the last step ran eagerly; None where the backend has none."""
    from coli.model.batch import batch_graphs
    out: dict[str, Any] = {}
    for name, g in (("step", model.step_graphs), ("batch", batch_graphs(model))):
        if g is None:
            out[f"{name}_replays"] = out[f"{name}_eager_reason"] = None
            continue
        out[f"{name}_replays"] = g.replays - ((since or {}).get(f"{name}_replays") or 0)
        out[f"{name}_eager_reason"] = g.last_reason
    return out


def batch_figures(raw: dict, *, L: int, nomoe_step_s: float | None, head_s: float, vocab: int, record_bytes: int,
                  ref_tokens: list[int] | None = None) -> dict:
    """One batched row's reported figures from its raw measurements (pure). ref_tokens: sequence 0's tokens in
    the B=1 row (the same first token and trace stretch): whether this row's sequence 0 got them."""
    from coli.bench.stream import GLM5_MOE_LAYERS, GLM5_VOCAB, extrapolate, split_times, summarise
    B, N = raw["batch"], len(raw["step_s"])
    step = float(np.mean(raw["step_s"]))
    agg = B / step if step else None
    out: dict[str, Any] = {"scenario": raw["scenario"], "batch": B, "tokens": N,
                           "step_ms": {k: (v * 1e3 if isinstance(v, float) else v)
                                       for k, v in summarise(raw["step_s"]).items()},
                           "agg_tokens_per_s_slice": agg,
                           "seq_tokens_per_s_slice": agg / B if agg else None}
    head_full = head_s * GLM5_VOCAB / max(vocab, 1)
    if nomoe_step_s is not None:
        moe, dense = split_times(step, nomoe_step_s, L, head_s)
        g = B * extrapolate(moe, dense, head_full)
        out.update(moe_layer_ms=moe * 1e3, dense_layer_ms=dense * 1e3, nomoe_step_ms=nomoe_step_s * 1e3,
                   head_ms=head_s * 1e3, agg_tokens_per_s_glm5=g, seq_tokens_per_s_glm5=g / B)
    else:
        out.update(moe_layer_ms=None, agg_tokens_per_s_glm5=None, seq_tokens_per_s_glm5=None)
    d = np.asarray(raw["distinct"], dtype=np.float64)                  # [steps, MoE layers]
    per_layer = float(d.mean()) if d.size else None
    out["distinct_experts_per_layer_step"] = {"mean": per_layer, "max": int(d.max()) if d.size else None,
                                              "per_layer_mean": d.mean(axis=0).tolist() if d.size else []}
    if per_layer is not None and record_bytes:
        out["expert_bytes_per_token"] = per_layer * L * record_bytes / B      # what a step's kernels read, per token
        out["glm5_expert_bytes_per_token"] = per_layer * GLM5_MOE_LAYERS * record_bytes / B
    c = raw.get("counters")
    if c is not None:                                                   # a streaming engine's counters
        out["copied_bytes_per_token"] = c.get("copy_bytes", 0) / (B * N) if N else None
        out["copies_per_step"] = c.get("copies", 0) / N if N else None
        # retain off: every expert of a step's union crosses once, none twice, none skipped (a CPU fallback, a hit)
        out["union_copied_once"] = c.get("copies") == int(d.sum())
        out["cpu_fallbacks"] = c.get("cpu_fallbacks")
        out["vram_slots"] = raw.get("vram_slots")
    out["row0_tokens_equal_b1"] = raw["tokens"][0] == ref_tokens if ref_tokens is not None else None
    if "graphs" in raw:
        out["graphs"] = raw["graphs"]
    return out


def add_ratios(rows: list[dict]) -> None:
    """x B=1 of the aggregate tokens/s (slice and GLM-5), each row against the B=1 row of its scenario."""
    ref = {r["scenario"]: r for r in rows if r.get("batch") == 1 and r.get("run") is not False}
    for r in rows:
        b1 = ref.get(r["scenario"])
        for key, name in (("agg_tokens_per_s_slice", "x_b1_slice"), ("agg_tokens_per_s_glm5", "x_b1_glm5")):
            a, b = r.get(key), (b1 or {}).get(key)
            r[name] = a / b if a and b else None


ACCEPTANCE = {"warm": 5.0, "cold-ram": 2.0}     # issue 15: aggregate decode at 8 sequences over one sequence


def acceptance(rows: list[dict], at: int = 8) -> dict:
    """Per scenario: the GLM-5 aggregate at B = `at` over B = 1, against issue 15's target (None: not run)."""
    out = {}
    for name, target in ACCEPTANCE.items():
        r = next((r for r in rows if r.get("scenario") == name and r.get("batch") == at), None)
        x = None if r is None else r.get("x_b1_glm5")
        out[name] = {"batch": at, "x_b1_glm5": x, "target": target, "met": None if x is None else x >= target}
    return out


def _f(v, fmt="{:.2f}") -> str:
    return "-" if v is None else fmt.format(v)


BATCH_HEADERS = ["scenario", "B", "GLM-5 tok/s*", "xB1", "GLM-5 /seq", "slice tok/s", "xB1 slice", "ms/step",
                 "experts /layer", "GLM-5 MB/tok", "copied MB/tok", "seq0 =B1"]


def batch_table_rows(rows: list[dict]) -> list[list[str]]:
    """The printed batched table's cells (pure: tested)."""
    out = []
    for r in rows:
        if r.get("run") is False:
            out.append([r["scenario"], str(r.get("batch", "-")), f"not run: {r.get('reason')}"] + [""] * 9)
            continue
        mb = lambda v: None if v is None else v / 1e6     # noqa: E731
        out.append([r["scenario"], str(r["batch"]), _f(r.get("agg_tokens_per_s_glm5")), _f(r.get("x_b1_glm5")),
                    _f(r.get("seq_tokens_per_s_glm5")), _f(r.get("agg_tokens_per_s_slice")),
                    _f(r.get("x_b1_slice")), _f(r["step_ms"]["mean"]),
                    _f(r["distinct_experts_per_layer_step"]["mean"], "{:.1f}"),
                    _f(mb(r.get("glm5_expert_bytes_per_token")), "{:.0f}"),
                    _f(mb(r.get("copied_bytes_per_token")), "{:.1f}"),
                    "yes" if r.get("row0_tokens_equal_b1") else "NO"])
    return out


def print_rows(title: str, headers: list[str], cells: list[list[str]], footnote: str,
               report: Callable[[str], None] = print) -> None:
    """A bench table on stdout (rich), then its footnote through `report` (the batched and the verify-step rows)."""
    from rich.console import Console
    from rich.table import Table
    t = Table(title=title)
    for h in headers:
        t.add_column(h)
    for row in cells:
        t.add_row(*row)
    Console(stderr=False).print(t)
    report("* " + footnote)


def print_batch_table(res: dict, report: Callable[[str], None] = print) -> None:
    rows = (res.get("batch") or {}).get("rows") or []
    if not rows:
        return
    print_rows(f"batched decode: B sequences per step ({res['tokens']} steps)", BATCH_HEADERS, batch_table_rows(rows),
               EXTRAPOLATION_NOTE, report)
    for name, a in acceptance(rows).items():
        if a["x_b1_glm5"] is not None:
            report(f"{name}: aggregate at B={a['batch']} is {a['x_b1_glm5']:.2f} x B=1 (issue 15 target >= "
                   f"{a['target']:g}: {'met' if a['met'] else 'NOT met'})")
