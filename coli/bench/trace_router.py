"""The routing a benchmark slice replays: how `coli bench make-slice` builds it, and `TraceRouting`, which makes
a model route by it.

A slice has random weights, so its router's choices mean nothing; what a streaming benchmark needs is routing
with GLM-5's statistics (or a recorded run's). The slice therefore stores a routing trace in its directory,
`bench_trace.trace`, in the ordinary routing trace format of `coli.trace` (docs/traces.md: so `coli sim --trace
DIR/bench_trace.trace` and `read_trace` read it), with one MoE layer per slice layer (`moe_layers` = 0..L-1)
and a header `meta` saying where it came from:

    {"bench_slice": 1, "trace": "glm52" | "uniform" | "recorded", "seed": s, "tokens": T,
     "source_file": "...", "source_moe_layers": [...], "source_layers": [slot of the source per slice layer]}

`TraceRouting(dir or trace file).install(model)` sets `model.route_override`: each MoE layer still runs its
router (its cost is paid and timed), then uses the trace's experts and weights for the rows' tokens instead.
A forward call of S rows takes the next S trace tokens (a prefill's rows are consecutive tokens, a decode step
one token); the cursor wraps around at the end of the trace.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from coli.errors import ColiError
from coli.trace import Trace, TraceFormatError, read_trace, write_trace
from coli.traces_synth import GENERATORS, generate

TRACE_NAME = "bench_trace.trace"   # in the slice's directory, listed (with its xxh64) in the manifest's 'copied'
MAX_LAYERS = 255                   # the trace format's limit on MoE layers


class SliceTraceError(ColiError):
    """A --trace value that names neither a generator nor a usable trace file (names the culprit)."""


def source_layer_map(n_source: int, layers: int) -> list[int]:
    """Which MoE layer slot of a source trace feeds each of `layers` slice layers.

    L <= Ls: evenly spaced over the source's depth, first layer first (slot floor(j * Ls / L)), so a 2-layer slice
    of a 75-layer trace replays source slots 0 and 37. L > Ls: the source's layers in turn (j mod Ls)."""
    if layers <= n_source:
        return [j * n_source // layers for j in range(layers)]
    return [j % n_source for j in range(layers)]


def build_slice_trace(trace: str, layers: int, n_experts: int, top_k: int, tokens: int | None, seed: int
                      ) -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
    """The slice's routing: idx [T, L, K] int32 (-1 = dropped slot), weights [T, L, K] float32, header meta.

    `trace` is a generator name (coli.traces_synth: 'uniform', 'glm52'; `tokens` defaults to 256) or a recorded
    trace file (coli.trace format), mapped onto the slice's layers by `source_layer_map`; `tokens` then keeps
    its first tokens (default: all of them)."""
    if not 1 <= layers <= MAX_LAYERS:
        raise SliceTraceError(f"--layers {layers}: a slice has 1..{MAX_LAYERS} MoE layers")
    if tokens is not None and tokens < 1:
        raise SliceTraceError(f"--tokens {tokens}: the trace needs at least one token")
    if trace in GENERATORS:
        T = 256 if tokens is None else tokens
        idx, w = generate(trace, T, layers, n_experts, top_k, seed)
        return idx, w, {"bench_slice": 1, "trace": trace, "seed": seed, "tokens": T}
    path = Path(trace)
    if not path.is_file():
        raise SliceTraceError(f"--trace {trace!r}: not a generator ({' | '.join(GENERATORS)}) and no such file")
    try:
        tr = read_trace(path)
    except (TraceFormatError, OSError) as e:
        raise SliceTraceError(f"--trace {trace!r}: cannot read it as a routing trace: {e}") from None
    h = tr.header
    if tr.n_tokens == 0:
        raise SliceTraceError(f"--trace {trace!r}: holds no complete token")
    if h.top_k != top_k:
        raise SliceTraceError(f"--trace {trace!r}: routes top-{h.top_k}, the slice routes top-{top_k} (record the "
                              f"trace with a model of the slice's top-k)")
    used = int(tr.idx.max()) + 1
    if used > n_experts:
        raise SliceTraceError(f"--trace {trace!r}: uses expert ids up to {used - 1}, the slice has {n_experts} experts "
                              f"per layer (raise --experts to at least {used})")
    slots = source_layer_map(h.n_layers, layers)
    T = tr.n_tokens if tokens is None else min(tokens, tr.n_tokens)
    idx = np.ascontiguousarray(tr.idx[:T][:, slots])
    w = np.ascontiguousarray(tr.weights[:T][:, slots])
    meta = {"bench_slice": 1, "trace": "recorded", "seed": seed, "tokens": T, "source_file": path.name,
            "source_tokens": tr.n_tokens, "source_moe_layers": list(h.moe_layers), "source_layers": slots,
            "source_meta": h.meta}
    return idx, w, meta


def write_slice_trace(path: Path, idx: np.ndarray, weights: np.ndarray, n_experts: int, meta: dict) -> None:
    write_trace(path, idx, weights, n_experts, moe_layers=list(range(idx.shape[1])), meta=meta)


class TraceRouting:
    """Replays a routing trace in a model: `routing.install(model)` (sets `model.route_override`).

        routing = TraceRouting(slice_dir)          # or a trace file (coli.trace format)
        routing.install(model)
        model.forward(prompt, cache)               # rows take trace tokens 0..S-1, the next call S.., wrapping

    Called as routing(layer, n_rows) -> (idx [S, K] int64, weights [S, K] float32). A forward call starts when
    the model's first MoE layer routes: that call takes the next n_rows trace tokens and every later MoE layer of
    the call uses the same tokens (each through its own layer of the trace). Not thread-safe: one model, one
    cursor."""

    def __init__(self, source: str | Path, start: int = 0):
        p = Path(source)
        self.path = p / TRACE_NAME if p.is_dir() else p
        if not self.path.is_file():
            raise ColiError(f"{self.path}: no routing trace here (a slice written by coli bench make-slice has "
                            f"{TRACE_NAME})")
        tr: Trace = read_trace(self.path)
        if tr.n_tokens == 0:
            raise ColiError(f"{self.path}: the trace holds no complete token")
        self.header = tr.header
        self.idx = tr.idx.astype(np.int64)          # [T, L, K], -1 = dropped slot
        self.weights = tr.weights.astype(np.float32)  # [T, L, K]
        self._slot = {int(layer): s for s, layer in enumerate(tr.header.moe_layers)}
        self._first = int(tr.header.moe_layers[0])
        self.cursor = start % self.n_tokens         # the trace token the next forward call starts at
        self._rows: np.ndarray | None = None          # trace tokens of the current forward call
        self.tokens_used = 0                          # rows replayed so far (wrap-arounds included)

    @property
    def n_tokens(self) -> int:
        return int(self.idx.shape[0])

    @property
    def top_k(self) -> int:
        return int(self.idx.shape[2])

    def reset(self, start: int = 0) -> None:
        self.cursor, self._rows, self.tokens_used = start % self.n_tokens, None, 0

    def install(self, model) -> "TraceRouting":
        """Check the trace fits the model (top-k, experts, MoE layers) and make the model route by it."""
        c = model.config
        missing = [layer for layer in c.moe_layers if layer not in self._slot]
        if missing:
            raise ColiError(f"{self.path}: no routing for MoE layer(s) {missing[:4]} of the model (the trace has "
                            f"layers {list(self.header.moe_layers)})")
        if self.top_k != c.num_experts_per_tok:
            raise ColiError(f"{self.path}: routes top-{self.top_k}, the model top-{c.num_experts_per_tok}")
        if int(self.idx.max()) >= c.n_routed_experts:
            raise ColiError(f"{self.path}: uses expert {int(self.idx.max())}, the model has {c.n_routed_experts}")
        self._first = int(c.moe_layers[0])
        model.route_override = self
        return self

    def __call__(self, layer: int, n_rows: int) -> tuple[np.ndarray, np.ndarray]:
        slot = self._slot.get(int(layer))
        if slot is None:
            raise ColiError(f"{self.path}: no routing for layer {layer}")
        if int(layer) == self._first or self._rows is None:
            self._rows = (self.cursor + np.arange(n_rows)) % self.n_tokens
            self.cursor = int((self.cursor + n_rows) % self.n_tokens)
            self.tokens_used += n_rows
        elif n_rows != len(self._rows):
            raise ColiError(f"layer {layer} routes {n_rows} rows, the first MoE layer of this call routed "
                            f"{len(self._rows)}")
        return self.idx[self._rows, slot], self.weights[self._rows, slot]
