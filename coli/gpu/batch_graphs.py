"""A batched decode step replayed from a CUDA graph: B sequences, one new token each, every routed expert resident.

    greedy_batch(model, rows)     # coli.model.batch asks the backend's BatchGraphDecoder first (COLI_BATCH_GRAPHS=1)

What is captured: coli.model.batch.step_logits over the B rows (the backend in step mode, `CudaBackend.step` is a
BatchStepInputs), the greedy argmax of each row and the copy of the B tokens to pinned host memory. Batch-wide ops
(embed, rope, every linear, the router) read the step's B-row inputs; while row r's attention runs (the batch step
calls `select(r)`) the cache write, the indexer and the split attention read row r's position, cache length and
attention span -- all in device memory, written by the graph's first node from one pinned block:

    tokens [B]               int32   embed
    (position, T) [B]        int32   kv_put, indexer_scores_dyn / topk_select_dyn of row r (pos_ptr)
    cos [B, half], sin [B, half]  fp32   rope (cos_sin_table of each row's position, as the eager step)
    forced routing [MoE layer][B, K]   int32 + fp32   only with a route override (benchmarks replay a trace)

The MoE runs each row's own fused decode of its K experts (CudaBackend.moe_step over B rows) through the slot table
of the one-sequence GraphDecoder (coli/gpu/graphs.py), so a row's routed sum is computed by the kernels of its decode
step alone; the linears run once over the B rows (GEMM). The eager batched step differs only there (its MoE is the
grouped GEMM over the union): tokens are compared, not bits (tests/gpu/test_gpu_batch.py).

A graph bakes addresses: each row's cache buffers and capacity, its attention span (attn_span: the split attention's
chunk size for its length), the batch size. Its key is all of them, so a row joining or leaving, or a cache growing,
is a new key: its first step runs eagerly, the second is captured, later ones replay (MAX_GRAPHS kept). Off by
default (COLI_BATCH_GRAPHS=1 turns it on) until measured on the H200; COLI_GRAPHS=0 turns it off too.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from coli.gpu.graphs import (ReplayedShapes, bound_to_single_step, capture_step, drop_graphs, env_switch, load_modules,
                             step_key, why_not_graphable)
from coli.model.backend import cos_sin_table


def batch_graphs_enabled(env: dict | None = None) -> bool:
    """COLI_BATCH_GRAPHS: "1" replays batched decode steps from CUDA graphs, "0" (default) runs them eagerly."""
    return env_switch("COLI_BATCH_GRAPHS", "0", "batched decode steps replayed from CUDA graphs", "eager, the default",
                      env)


def _align16(n: int) -> int:
    return -(-n // 16) * 16


@dataclass(frozen=True)
class BatchStepLayout:
    """Byte layout of a batched step's inputs (one pinned host block, copied to the device by the graph):

        0          int32 tokens [B]
        pos_at     int32 (position, T = position + 1) per row, 8 bytes a row
        angles_at  fp32 cos [B, half], then fp32 sin [B, half]       (half = qk_rope_head_dim / 2)
        then       per MoE layer j (in moe_layers order): int32 idx [B, K], fp32 weights [B, K]  (forced routing)
    """

    B: int
    half: int
    moe_layers: tuple[int, ...] = ()
    K: int = 0

    @property
    def pos_at(self) -> int:
        return _align16(4 * self.B)

    def pos_offset(self, row: int) -> int:
        if not 0 <= row < self.B:
            raise ValueError(f"row {row} of a step of {self.B}")
        return self.pos_at + 8 * row

    @property
    def angles_at(self) -> int:
        return _align16(self.pos_at + 8 * self.B)

    def route_offset(self, layer: int) -> int:
        """Offset of layer's forced idx [B, K] int32; its weights [B, K] fp32 follow."""
        j = self.moe_layers.index(layer)
        return self.angles_at + 8 * self.B * self.half + j * 8 * self.B * self.K

    @property
    def nbytes(self) -> int:
        return self.angles_at + 8 * self.B * self.half + len(self.moe_layers) * 8 * self.B * self.K

    def pack(self, buf: np.ndarray, tokens: Sequence[int], positions: Sequence[int], cos: np.ndarray,
             sin: np.ndarray, forced: dict[int, tuple[np.ndarray, np.ndarray]] | None = None) -> None:
        """Write one step's inputs into buf (uint8 [nbytes]). cos/sin [B, half]; forced: layer -> (idx, w) [B, K]."""
        B, h, K = self.B, self.half, self.K
        if buf.dtype != np.uint8 or buf.nbytes < self.nbytes:
            raise ValueError(f"step inputs need a uint8 buffer of {self.nbytes} bytes, got {buf.dtype} {buf.nbytes}")
        if len(tokens) != B or len(positions) != B or np.shape(cos) != (B, h) or np.shape(sin) != (B, h):
            raise ValueError(f"a step of {B} rows got {len(tokens)} tokens, {len(positions)} positions, "
                             f"angles {np.shape(cos)} / {np.shape(sin)}")
        buf[:4 * B].view(np.int32)[:] = np.asarray(tokens, np.int64)
        pt = buf[self.pos_at:self.pos_at + 8 * B].view(np.int32).reshape(B, 2)
        pos = np.asarray(positions, np.int64)
        pt[:, 0], pt[:, 1] = pos, pos + 1
        a = buf[self.angles_at:self.angles_at + 8 * B * h].view(np.float32)
        a[:B * h] = np.asarray(cos, np.float32).reshape(-1)
        a[B * h:] = np.asarray(sin, np.float32).reshape(-1)
        for layer, (idx, w) in (forced or {}).items():
            if np.shape(idx) != (B, K) or np.shape(w) != (B, K):
                raise ValueError(f"a forced routing of shape {np.shape(idx)} at layer {layer} in a step of {B}x{K}")
            o = self.route_offset(layer)
            buf[o:o + 4 * B * K].view(np.int32)[:] = np.asarray(idx, np.int64).reshape(-1)
            buf[o + 4 * B * K:o + 8 * B * K].view(np.float32)[:] = np.asarray(w, np.float32).reshape(-1)


def all_dropped(routes: dict, B: int, K: int) -> bool:
    """Whether a forced routing drops every slot of every row of every MoE layer (the no-routed-expert step)."""
    return bool(routes) and all(r is not None and np.shape(r[0]) == (B, K) and (np.asarray(r[0]) < 0).all()
                                for r in routes.values())


def row_angles(c, positions: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [B, half] of each row's position, as each row's eager step computes them (cos_sin_table of one)."""
    tables = [cos_sin_table([p], c.qk_rope_head_dim, c.rope_theta) for p in positions]
    return np.concatenate([t[0] for t in tables]), np.concatenate([t[1] for t in tables])


def draw_routes(model, B: int) -> tuple[dict | None, str, str | None]:
    """A B-row step's routing from the model's route override, drawn once per MoE layer before the step (a replay
    reads it from its inputs; an eager fallback replays these draws) -> (routes, mode, why): (None, "router", None)
    without an override; mode "dropped" where every slot of every layer is dropped (the benchmarks' no-expert step:
    the routed sums are zeros, as the eager step's), else "forced"; why: the reason it cannot be replayed."""
    c = model.config
    if model.route_override is None:
        return None, "router", None
    routes = {i: model.route_override(i, B) for i in c.moe_layers}
    if all_dropped(routes, B, c.num_experts_per_tok):
        return routes, "dropped", None
    return routes, "forced", batch_route_mode(routes, B, c.num_experts_per_tok, c.n_routed_experts)


def batch_route_mode(routes: dict, B: int, K: int, E: int) -> str | None:
    """Why a forced routing of a B-row step cannot be replayed (None: it can): every MoE layer must force all B x K
    slots to experts 0..E-1 (a dropped slot, -1, or a layer keeping the router's choice runs the step eagerly)."""
    for i, r in routes.items():
        if r is None:
            return f"the route override keeps the router's choice at layer {i}"
        idx = np.asarray(r[0])
        if idx.shape != (B, K) or np.shape(r[1]) != (B, K):
            return f"a forced routing of shape {idx.shape} at layer {i} in a step of {B} rows"
        if (idx < 0).any() or (idx >= E).any():
            return f"a forced routing with dropped slots or expert ids outside 0..{E - 1} at layer {i}"
    return None


class BatchStepInputs:
    """What CudaBackend reads while a batched decode step is captured (backend.step): the device copy of the step's
    inputs, and which row's attention is running (select)."""

    def __init__(self, rt, layout: BatchStepLayout, slots, E: int, rec_layout):
        self.rt, self.layout, self.E, self.rec_layout, self.slots = rt, layout, E, rec_layout, slots
        self.pinned_in = rt.drv.pagelocked_empty(layout.nbytes, np.uint8)
        self.pinned_in[:] = 0
        self.pinned_out = rt.drv.pagelocked_empty(layout.B, np.int32)
        self.dyn = rt.empty((layout.nbytes,), np.uint8)
        self.out_d = rt.empty((layout.B,), np.int32)
        self.mode = "router"
        self.keep: list = []
        self.row: int | None = None
        # each row's host values at the capture (the graph bakes them): position, cache capacity, attention span
        self.positions: list[int] = []
        self.capacities: list[int] = []
        self.spans: list[int] = []

    def select(self, row: int | None) -> None:
        self.row = row

    def _fail(self, what: str):
        from coli.gpu.cuda_runtime import CudaError
        raise CudaError(what)

    def _row(self, what: str) -> int:
        if self.row is None:
            self._fail(f"{what} outside a row's attention in a captured batched step")
        return self.row

    def check_rows(self, S: int, what: str) -> "BatchStepInputs":
        want = self.layout.B if self.row is None else 1
        if S != want:
            where = "the batch" if self.row is None else f"row {self.row}'s attention"
            self._fail(f"{what} of {S} rows in {where} of a captured batched step ({want} expected)")
        return self

    @property
    def token_ptr(self) -> int:
        if self.row is not None:
            self._fail("embed inside a row's attention")
        return self.dyn.ptr

    @property
    def pos_ptr(self) -> int:          # int32 (position, T) of the selected row
        return self.dyn.ptr + self.layout.pos_offset(self._row("a position"))

    @property
    def pos(self) -> int:
        return self.positions[self._row("a position")]

    @property
    def capacity(self) -> int:
        return self.capacities[self._row("a cache capacity")]

    @property
    def attn_n_max(self) -> int:
        return self.spans[self._row("an attention span")]

    def check_start(self, start: int) -> None:
        if start != self.pos:
            self._fail(f"a row write at {start} in row {self.row}'s step of position {self.pos}: not a cache write")

    def angles(self, half: int):
        from coli.gpu.cuda_runtime import DeviceArray
        if half != self.layout.half or self.row is not None:
            self._fail(f"rope with {half} angles (row {self.row}) in a batched step laid out for {self.layout.half}")
        B, base = self.layout.B, self.dyn.ptr + self.layout.angles_at
        return (DeviceArray(base, (B, half), np.float32, self.dyn.owner),
                DeviceArray(base + 4 * B * half, (B, half), np.float32, self.dyn.owner))

    def route_ptrs(self, layer: int, route) -> tuple[int, int]:
        """Row 0 of layer's [B, K] choice (the router's, or the step's forced routing); row r is 4 K r bytes on."""
        if route.K != self.layout.K:
            self._fail(f"a router of top-{route.K} in a batched step laid out for top-{self.layout.K}")
        if self.mode == "router":
            return route.idx.ptr, route.weights.ptr
        o = self.dyn.ptr + self.layout.route_offset(layer)
        return o, o + 4 * self.layout.B * self.layout.K

    def slots_row(self, layer: int) -> int:
        return self.slots.ptr + layer * self.E * 8


class BatchGraphDecoder(ReplayedShapes):
    """Greedy batched decode steps of one model replayed from CUDA graphs (see the module docstring)."""

    def __init__(self, model, backend):
        super().__init__(backend)
        # weak: coli.model.batch keeps this decoder in a WeakKeyDictionary keyed by the model, which a strong
        # reference back would keep alive (and with it every weight on the device)
        self._model = weakref.ref(model)
        self.inputs: dict[int, BatchStepInputs] = {}        # per batch size
        self._bound = None                                  # the one-sequence decoder's step whose slot table we use

    @property
    def model(self):
        return self._model()

    def greedy(self, rows, ids: list[np.ndarray]) -> list[int] | None:
        """Each row's greedy next token from a replayed graph; None: run the step eagerly (last_reason says why)."""
        reason = self._why_not(rows, ids)
        if reason is not None:
            self.last_reason = reason
            return None
        m, c, b = self.model, self.model.config, self.b
        single = m.step_graphs
        B = len(rows)
        routes, mode, why = draw_routes(m, B)
        if why is not None:
            return self._eager(rows, routes, why)
        for r in rows:
            r.cache.reserve(1)
        spans = [single._attn_span(r.cache.length + 1) for r in rows]
        key = ("batch", B, mode, b.moe_kernels) + tuple(
            step_key(r.cache, "router", b.moe_kernels) + (("attn", sp),) for r, sp in zip(rows, spans))
        if key in self.failed:
            return self._eager(rows, routes, self.failed[key])
        g = self.graphs.get(key)
        if g is None and key not in self.seen:
            self.seen[key] = True
            return self._eager(rows, routes, "first step of this batch (eager: compiles and sizes what the capture "
                                             "needs)")
        st = self._inputs(B)
        positions = [r.cache.length for r in rows]
        st.layout.pack(st.pinned_in, [int(x[0]) for x in ids], positions, *row_angles(c, positions),
                       routes if mode == "forced" else None)
        if g is None:
            st.positions, st.capacities, st.spans = positions, [r.cache.capacity for r in rows], spans
            st.mode = mode
            g = self._capture(key, rows, st)
            if g is None:
                return self._eager(rows, routes, self.failed[key])
        self.graphs.move_to_end(key)
        rt = b.rt
        g.launch(rt)
        rt.synchronize()
        for r, p in zip(rows, positions):
            r.cache.length = p + 1
        self.replays += 1
        self.last_reason = None
        return [int(t) for t in st.pinned_out[:B]]

    def reset(self) -> None:
        drop_graphs(self)
        self.inputs.clear()
        self._bound = None

    # ---- inside ----------------------------------------------------------------------------------------------
    def _eager(self, rows, routes, reason: str) -> list[int] | None:
        """Say why, and run the step eagerly: here with the routes already drawn from the override (None: the
        caller runs it, nothing was drawn)."""
        from coli.gpu.graphs import replaying_routes
        from coli.model.batch import step_logits
        self.last_reason = reason
        if routes is None:
            return None
        with replaying_routes(self.model, routes):
            logits, _ = step_logits(self.model, rows, all_positions=False)
            return [int(t) for t in self.b.argmax(logits)]

    def _why_not(self, rows, ids) -> str | None:
        m = self.model
        if any(len(x) != 1 for x in ids):
            return "prefill rows (more than one new position)"
        why = why_not_graphable(m, [0])
        if why is not None:
            return why
        if any(r.cache.backend is not self.b for r in rows) or m.backend is not self.b:
            return "the model or a cache lives on another backend"
        if not all(0 <= int(x[0]) < m.config.vocab_size for x in ids):
            return "a token outside the vocabulary (the eager step raises the one-line error)"
        return bound_to_single_step(self, m)

    def _inputs(self, B: int) -> BatchStepInputs:
        st = self.inputs.get(B)
        if st is None:
            c, one = self.model.config, self._bound
            layout = BatchStepLayout(B, c.qk_rope_head_dim // 2, tuple(c.moe_layers), c.num_experts_per_tok)
            st = self.inputs[B] = BatchStepInputs(self.b.rt, layout, one.slots, c.n_routed_experts, one.rec_layout)
        return st

    def _capture(self, key: tuple, rows, st: BatchStepInputs):
        from coli.gpu.cuda_runtime import MODULES
        from coli.model.batch import step_logits
        b, rt = self.b, self.b.rt
        lengths = [r.cache.length for r in rows]
        st.keep = []

        def body():
            b.step = st
            st.select(None)
            rt.drv.memcpy_htod_async(st.dyn.ptr, st.pinned_in, rt.stream)
            logits, _ = step_logits(self.model, rows, all_positions=False)     # [B, V]
            b.argmax_into(logits, st.out_d.ptr)
            rt.drv.memcpy_dtoh_async(st.pinned_out, st.out_d.ptr, rt.stream)

        def restore():
            st.select(None)
            for r, n in zip(rows, lengths):    # the capture ran no kernel: the replay advances the caches
                r.cache.length = n

        # modules loaded before: the eager first step ran the grouped MoE, not the decode kernels
        return capture_step(self, key, b, "batched decode step", lambda: load_modules(rt, MODULES), body, restore,
                            lambda: st.keep)
