"""Greedy MTP rounds of one draft replayed from one CUDA graph each (issue 16: decode with MTP faster than without).

    va, ma = head.rounds.round(last, d1, cache, mtp_cache)     # SpeculativeDecoder._row_round asks it

A round is coli.model.mtp.row_round: the verify step [last, d1] at positions P, P+1 as two one-position rows of
the main cache (coli.model.batch.forward_rows), the device argmax of both rows, then the MTP layer over both
verified rows (their final-normed hidden states and those argmax tokens) at P, P+1 of the MTP cache, and its
argmax. Nothing in it depends on what is accepted, so it is captured once per shape and replayed; the host reads
four int32 (va [2], ma [2]) and decides: a = va[0] == d1, emit va[0] or (d1, va[1]), next d1 = ma[a], both caches
cut to P + a + 1. Against the eager round (a verify step, host acceptance, a catch-up call, ~90 launches from
Python) it is one launch and one read-back, the same as a plain replayed decode step (coli/gpu/graphs.py).

What varies per round lives in device memory, written by the graph's first nodes from two pinned blocks laid out
as a batched step's (coli/gpu/batch_graphs.py BatchStepLayout, B = 2): the verify rows' tokens, positions, cache
lengths and RoPE angles; the MTP rows' positions and angles -- their tokens are written on the device by the
verify argmax. Each row's attention reads its own (position, T) while it runs (BatchStepInputs.select), so row 1
sees row 0's key, written just before: one sequence's two positions, exactly as two decode steps. The MoE of both
layers' kinds runs each row's fused decode through a slot table: the main model's (the one-sequence decoder's) and
one for the MTP layer's resident experts.

A graph bakes both caches' buffers and capacities and the rows' attention spans: that is its key. The first round
of a key runs eagerly (row_round: it compiles and sizes what the capture needs), the second is captured, later
ones replay. Where a round cannot be replayed (streaming experts, hooks, fault injection, a route override,
COLI_GRAPHS=0) it runs eagerly with the same results; `last_reason` says why.
"""

from __future__ import annotations

import weakref

from coli.gpu.batch_graphs import BatchStepInputs, BatchStepLayout, row_angles
from coli.gpu.graphs import (ReplayedShapes, bound_to_single_step, capture_step, drop_graphs, load_modules, step_key,
                             why_not_graphable)


def mtp_graphs_enabled(env: dict | None = None) -> bool:
    """COLI_MTP_GRAPHS: "1" (default) greedy one-draft MTP rounds replayed from CUDA graphs, "0" eager rounds."""
    from coli.gpu.graphs import env_switch
    return env_switch("COLI_MTP_GRAPHS", "1", "greedy one-draft MTP rounds replayed from CUDA graphs, the default",
                      "MTP rounds eager", env)

ROWS = 2          # [last, d1]: a round of one draft


class MtpRoundGraphs(ReplayedShapes):
    """A head's greedy rounds of one draft replayed from CUDA graphs (see the module docstring)."""

    def __init__(self, head, backend):
        super().__init__(backend)
        self._head = weakref.ref(head)          # the head holds this object: no cycle keeping its weights alive
        self._bound = None                      # the one-sequence decoder's step whose slot table we use
        self._verify_in: BatchStepInputs | None = None
        self._mtp_in: BatchStepInputs | None = None
        self.eager = 0

    @property
    def head(self):
        return self._head()

    def round(self, last: int, d1: int, cache, mtp_cache) -> tuple[list[int], list[int]]:
        """(va [2], ma [2]) of coli.model.mtp.row_round, replayed where it can be; both caches advanced by 2."""
        head = self.head
        reason = self._why_not(last, d1, cache, mtp_cache)
        if reason is not None:
            return self._eager(reason, last, d1, cache, mtp_cache)
        single = head.model.step_graphs
        cache.reserve(ROWS)
        mtp_cache.reserve(ROWS)
        P = cache.length
        spans = [single._attn_span(P + j + 1) for j in range(ROWS)]
        kern = self.b.moe_kernels
        key = ("mtp", step_key(cache, "router", kern), step_key(mtp_cache, "router", kern), tuple(spans))
        if key in self.failed:
            return self._eager(self.failed[key], last, d1, cache, mtp_cache)
        g = self.graphs.get(key)
        if g is None and key not in self.seen:
            self.seen[key] = True
            return self._eager("first round of this shape (eager: compiles and sizes what the capture needs)",
                               last, d1, cache, mtp_cache)
        vin, min_ = self._inputs()
        c = head.model.config
        positions = [P + j for j in range(ROWS)]
        cos, sin = row_angles(c, positions)
        vin.layout.pack(vin.pinned_in, [last, d1], positions, cos, sin)
        min_.layout.pack(min_.pinned_in, [0] * ROWS, positions, cos, sin)   # tokens: the verify argmax, on device
        if g is None:
            for st, cc in ((vin, cache), (min_, mtp_cache)):
                st.positions, st.capacities, st.spans = positions, [cc.capacity] * ROWS, spans
                st.mode = "router"
            g = self._capture(key, last, d1, cache, mtp_cache)
            if g is None:
                return self._eager(self.failed[key], last, d1, cache, mtp_cache)
        self.graphs.move_to_end(key)
        rt = self.b.rt
        g.launch(rt)
        rt.synchronize()
        cache.length = mtp_cache.length = P + ROWS
        self.replays += 1
        self.last_reason = None
        va = [int(t) for t in vin.pinned_out[:ROWS]]
        ma = [int(t) for t in min_.pinned_out[:ROWS]]
        return va, ma

    def reset(self) -> None:
        drop_graphs(self)
        self._verify_in = self._mtp_in = None
        self._bound = None

    # ---- inside ----------------------------------------------------------------------------------------------
    def _eager(self, reason: str, last, d1, cache, mtp_cache):
        from coli.model.mtp import row_round
        self.last_reason = reason
        self.eager += 1
        return row_round(self.head, last, d1, cache, mtp_cache)

    def _why_not(self, last, d1, cache, mtp_cache) -> str | None:
        head = self.head
        m = head.model
        why = why_not_graphable(m, [0])
        if why is not None:
            return why
        if m.route_override is not None:
            return "a route override (benchmarks) routes on the host"
        if any(x.backend is not self.b for x in (cache, mtp_cache)) or m.backend is not self.b:
            return "the model or a cache lives on another backend"
        V = m.config.vocab_size
        if not (0 <= int(last) < V and 0 <= int(d1) < V):
            return "a token outside the vocabulary (the eager round raises the one-line error)"
        if mtp_cache.length != cache.length:
            return "the MTP cache is not in step with the model's"
        streams = (None if hasattr(head.experts, "slot_table")
                   else f"the MTP layer's experts stream ({type(head.experts).__name__})")
        return bound_to_single_step(self, m, extra=streams)

    def _inputs(self) -> tuple[BatchStepInputs, BatchStepInputs]:
        if self._verify_in is None:
            head, one = self.head, self._bound
            c, rt = head.model.config, self.b.rt
            half, K, E = c.qk_rope_head_dim // 2, c.num_experts_per_tok, c.n_routed_experts
            self._verify_in = BatchStepInputs(rt, BatchStepLayout(ROWS, half, (), K), one.slots, E, one.rec_layout)
            L = head.layer_index
            mtp_slots = rt.to_device(head.experts.slot_table(L + 1))          # [L + 1, E] uint64: row L filled
            self._mtp_in = BatchStepInputs(rt, BatchStepLayout(ROWS, half, (), K), mtp_slots, E,
                                           head.experts.layout)
        return self._verify_in, self._mtp_in

    def _capture(self, key: tuple, last: int, d1: int, cache, mtp_cache):
        from coli.gpu.cuda_runtime import MODULES
        from coli.model.batch import forward_rows
        head, b = self.head, self.b
        rt = b.rt
        vin, min_ = self._verify_in, self._mtp_in
        P = cache.length
        vin.keep, min_.keep = [], []

        def body():
            rt.drv.memcpy_htod_async(vin.dyn.ptr, vin.pinned_in, rt.stream)
            rt.drv.memcpy_htod_async(min_.dyn.ptr, min_.pinned_in, rt.stream)
            b.step = vin
            vin.select(None)
            hn, logits = forward_rows(head.model, cache, [last, d1])          # [2, H], [2, V]
            b.argmax_into(logits, min_.dyn.ptr)           # va -> the MTP rows' tokens (their block's offset 0)
            rt.drv.memcpy_dtoh_async(vin.pinned_out, min_.dyn.ptr, rt.stream)
            b.step = min_
            min_.select(None)
            _, ml = head.step_rows([0] * ROWS, hn, mtp_cache)                 # [2, V]
            b.argmax_into(ml, min_.out_d.ptr)
            rt.drv.memcpy_dtoh_async(min_.pinned_out, min_.out_d.ptr, rt.stream)

        def restore():
            vin.select(None)
            min_.select(None)
            cache.length = mtp_cache.length = P        # the capture ran no kernel: the replay advances the caches

        return capture_step(self, key, b, "MTP round", lambda: load_modules(rt, MODULES), body, restore,
                            lambda: vin.keep + min_.keep)
