"""A greedy MTP verify step of S = k + 1 positions (1..MAX_ROWS; SpeculativeDecoder asks for 2..4, the benchmark
also for its S = 1 reference) replayed from one CUDA graph (issue 16: the verify step at the replayed step's pace, so
k drafts can pay on GLM-5, where the MTP layer is one of 79 and the verify step is what a round costs).

    vg = backend.verify_graphs(model)                    # head.verify (coli.model.mtp.MtpHead), or None
    toks, hn = vg.greedy(cache, [last, d1, .., dk])      # None: run it eagerly (last_reason says why)

The step is coli.model.batch.forward_rows: the S positions as S one-position rows of the one cache (each row's
attention its own decode step's: row j sees the keys of rows < j, written just before it), every weight read once
for the S rows, then the device argmax of every row. Nothing in it depends on what is accepted, so it is captured
once per shape and replayed: one launch and S int32 read back; the caller accepts on the host and cuts the cache.
The rows' final-normed hidden states come back too (a device copy of the graph's own buffer, which the next replay
overwrites): the MTP layer's next catch-up reads them. In the graph each row's MoE runs the fused decode kernels of a
one-token step (the batched steps' `moe_step`), where the eager forward_rows of S > 1 rows takes the grouped
prefill GEMM: the two agree in tokens, not in bits (as coli/gpu/batch_graphs.py's replayed steps and their eager
ones).

What varies per step lives in device memory, written by the graph's first node from a pinned block laid out as a
batched step's (coli/gpu/batch_graphs.py BatchStepLayout, B = S): the rows' tokens, positions, cache lengths, RoPE
angles and, with a route override (the benchmarks' trace replay, coli/bench/verify_step.py), every MoE layer's
forced [S, K] routing. A graph bakes the cache's buffers and capacity, the routing mode and the rows' attention
spans: that is its key. The first step of a key runs eagerly (it compiles and sizes what the capture needs), the
second is captured, later ones replay. Where a step cannot be replayed (streaming experts, hooks, fault injection,
a routing that drops some slots, COLI_GRAPHS=0) the caller runs it eagerly with the same tokens (with a route
override it runs here, as forward_rows with the routes already drawn).

This is the verify half of coli/gpu/mtp_graphs.py's one-draft round, for any S <= MAX_ROWS and without the MTP layer
(which, for more than one draft, chains on the accepted row's output: the host's to know first).
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np

from coli.gpu.batch_graphs import BatchStepInputs, BatchStepLayout, draw_routes, row_angles
from coli.gpu.graphs import (ReplayedShapes, bound_to_single_step, capture_step, drop_graphs, load_modules, step_key,
                             why_not_graphable)

MAX_ROWS = 4        # k <= 3 drafts (coli.model.mtp.MAX_DRAFTS) + the last verified token


def verify_graphs_enabled(env: dict | None = None) -> bool:
    """COLI_VERIFY_GRAPHS: "1" (default) greedy verify steps of 2-4 positions replayed from CUDA graphs, "0" eager
    (the reference). On by default since 2026-12-02, when its GPU tests (tests/gpu/test_gpu_verify_graphs.py,
    test_gpu_verify_bench.py) passed on the H200 and the replayed steps ran 3x faster than the eager ones against
    the replayed decode step (docs/mtp.md)."""
    from coli.gpu.graphs import env_switch
    return env_switch("COLI_VERIFY_GRAPHS", "1", "greedy verify steps replayed from CUDA graphs, the default",
                      "eager verify steps", env)


class VerifyGraphs(ReplayedShapes):
    """A model's greedy verify steps of S positions replayed from CUDA graphs (see the module docstring)."""

    def __init__(self, model, backend):
        super().__init__(backend)
        self._model = weakref.ref(model)        # the model holds this object: no cycle keeping its weights alive
        self.inputs: dict[int, BatchStepInputs] = {}         # per S
        self.hidden: dict[int, Any] = {}                     # per S: the graph's [S, H] final-normed hidden states
        self._bound = None                      # the one-sequence decoder's step whose slot table we use
        self.eager = 0

    @property
    def model(self):
        return self._model()

    def greedy(self, cache, ids: list[int]) -> tuple[list[int], Any] | None:
        """(every row's greedy token [S], the rows' final-normed hidden states [S, H] on the device) of
        forward_rows(model, cache, ids), the cache advanced by S; None where it is not replayed (nothing ran, the
        caller runs the step eagerly; last_reason says why)."""
        m = self.model
        c, b = m.config, self.b
        S = len(ids)
        reason = self._why_not(cache, ids)
        if reason is not None:
            return self._eager(reason)
        routes, mode, why = draw_routes(m, S)
        if why is not None:
            return self._eager_routed(why, cache, ids, routes)
        single = m.step_graphs
        cache.reserve(S)
        P = cache.length
        spans = [single._attn_span(P + j + 1) for j in range(S)]
        key = ("verify", S, mode, step_key(cache, "router", b.moe_kernels), tuple(spans))
        if key in self.failed:
            return self._eager_routed(self.failed[key], cache, ids, routes)
        g = self.graphs.get(key)
        if g is None and key not in self.seen:
            self.seen[key] = True
            return self._eager_routed("first verify step of this shape (eager: compiles and sizes what the capture "
                                      "needs)", cache, ids, routes)
        st = self._inputs(S)
        positions = [P + j for j in range(S)]
        st.layout.pack(st.pinned_in, [int(t) for t in ids], positions, *row_angles(c, positions),
                       routes if mode == "forced" else None)
        if g is None:
            st.positions, st.capacities, st.spans = positions, [cache.capacity] * S, spans
            st.mode = mode
            g = self._capture(key, cache, ids, st)
            if g is None:
                return self._eager_routed(self.failed[key], cache, ids, routes)
        self.graphs.move_to_end(key)
        rt = b.rt
        g.launch(rt)
        hn = b.empty((S, c.hidden_size))          # [S, H]: a copy, as the next replay overwrites the graph's own
        b.place_rows(hn, 0, self.hidden[S])
        rt.synchronize()
        cache.length = P + S
        self.replays += 1
        self.last_reason = None
        return [int(t) for t in st.pinned_out[:S]], hn

    def reset(self) -> None:
        drop_graphs(self)
        self.inputs.clear()
        self.hidden.clear()
        self._bound = None

    # ---- inside ----------------------------------------------------------------------------------------------
    def _eager(self, reason: str) -> None:
        self.last_reason = reason
        self.eager += 1
        return None

    def _eager_routed(self, reason: str, cache, ids, routes):
        """The step eagerly here, with the routes already drawn from the override (None: nothing was drawn -- the
        caller runs it)."""
        from coli.gpu.graphs import replaying_routes
        from coli.model.batch import forward_rows
        self._eager(reason)
        if routes is None:
            return None
        with replaying_routes(self.model, routes):
            hn, logits = forward_rows(self.model, cache, ids)               # [S, H], [S, V]
        return [int(t) for t in self.b.argmax(logits)], hn

    def _why_not(self, cache, ids) -> str | None:
        m = self.model
        S = len(ids)
        if not 1 <= S <= MAX_ROWS:
            return f"a verify step of {S} positions (1..{MAX_ROWS} are replayed)"
        why = why_not_graphable(m, [0])
        if why is not None:
            return why
        if cache.backend is not self.b or m.backend is not self.b:
            return "the model or the cache lives on another backend"
        if not all(0 <= int(t) < m.config.vocab_size for t in ids):
            return "a token outside the vocabulary (the eager step raises the one-line error)"
        return bound_to_single_step(self, m)

    def _inputs(self, S: int) -> BatchStepInputs:
        st = self.inputs.get(S)
        if st is None:
            c, one, rt = self.model.config, self._bound, self.b.rt
            layout = BatchStepLayout(S, c.qk_rope_head_dim // 2, tuple(c.moe_layers), c.num_experts_per_tok)
            st = self.inputs[S] = BatchStepInputs(rt, layout, one.slots, c.n_routed_experts, one.rec_layout)
            self.hidden[S] = rt.empty((S, c.hidden_size), np.float32)
        return st

    def _capture(self, key: tuple, cache, ids, st: BatchStepInputs):
        from coli.gpu.cuda_runtime import MODULES
        from coli.model.batch import forward_rows
        b, rt = self.b, self.b.rt
        P = cache.length
        hidden = self.hidden[len(ids)]
        st.keep = []

        def body():
            rt.drv.memcpy_htod_async(st.dyn.ptr, st.pinned_in, rt.stream)
            b.step = st
            st.select(None)
            hn, logits = forward_rows(self.model, cache, list(ids))        # [S, H], [S, V]
            b.place_rows(hidden, 0, hn)
            b.argmax_into(logits, st.out_d.ptr)
            rt.drv.memcpy_dtoh_async(st.pinned_out, st.out_d.ptr, rt.stream)

        def restore():
            st.select(None)
            cache.length = P             # the capture ran no kernel: the replay advances the cache

        return capture_step(self, key, b, "MTP verify step", lambda: load_modules(rt, MODULES), body, restore,
                            lambda: st.keep)
