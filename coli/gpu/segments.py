"""A streaming decode step as CUDA graph segments (issue 14 §1, the streaming case): when routed experts stream
through the VRAM cache (`VramExperts`), the step cannot be one graph -- which experts a layer needs is known only
once its router ran, and their copies, hits and CPU fallbacks are the host's business. So the step is cut at every
router: one graph per segment, one launch and one host wake-up per MoE layer.

    segment 0      the inputs' copy, embed, layer 0 up to its router (route_topk, its top-k copied to pinned memory)
    MoE of layer 0 eager, as today (`CudaBackend.moe`: VRAM hits, lane copies, FLUSH batches, CPU fallbacks),
                   its sum copied into a buffer the next segment reads
    side 0         layer 0's shared expert (computed between the router and the MoE, `shared_first`): launched
                   before the MoE issues its copies, so it runs while the host issues them and they land,
                   instead of inside the next segment while the copy lanes idle
    segment 1      layer 0's residual adds, layer 1 up to its router
    ...
    last segment   the last adds, the final norm, the head, the argmax and its copy to pinned memory

The forward (coli/model/forward.py) still runs in Python for every token, through `SegmentProxy`, a stand-in for the
backend: on the first (capturing) token every op inside a segment runs in the backend's step mode (its per-token
values from device memory, as in coli/gpu/graphs.py) while the stream is captured, and its result is recorded on a
tape; on a replayed token the same op returns its recorded result without launching anything (the segment's graph
will compute it), `route` waits for the segment's graph and reads its top-k, and `moe` runs eagerly. A replayed
segment's graph is launched as soon as its inputs are queued -- at the step's start for segment 0, right after the
previous MoE's sum for the others -- so the Python walk through its recorded ops overlaps the GPU's work. The
sequence of ops of a step is fixed by the model, so the tape lines up; a mismatch (it should not happen) raises
and the token runs again eagerly. Results are identical to the eager step: the same kernels on the same values.
"""

from __future__ import annotations

from typing import Any

import numpy as np

RECORDED = frozenset({"embed", "add", "rms_norm", "layer_norm", "linear", "linear_many", "split_cols", "last_row", "rope",
                      "mla_attend", "indexer_select", "swiglu", "silu_mul", "write_rows",
                      "add_rms_norm", "norm_many", "rope_many", "write_rows_many"})


class TapeMismatch(RuntimeError):
    """A replayed step called the backend in another order than the captured one."""


class CaptureFailed(RuntimeError):
    """A segment could not be captured (the step runs eagerly, that shape stays eager)."""


class SegmentTape:
    """One captured step: the ops' results in call order, the segments' graphs, the MoE sums' fixed buffers."""

    def __init__(self):
        self.results: list[tuple[str, Any]] = []
        self.graphs: list = []          # CudaGraph per segment
        self.kinds: list[str] = []      # per segment: "main" (ends at a router or the argmax) or "side" (see moe)
        self.keep: list = []

    def close(self) -> None:
        for g in self.graphs:
            g.close()
        self.graphs, self.results, self.keep, self.kinds = [], [], [], []


class SegmentProxy:
    """The backend as the forward sees it during one segmented step (see the module docstring)."""

    shared_first = True     # the forward computes a MoE layer's shared expert between its router and its MoE

    def __init__(self, inner, step, tape: SegmentTape, capture: bool):
        self.inner, self.rt, self.st, self.tape = inner, inner.rt, step, tape
        self.capture = capture
        self.j = 0                      # next op of the tape
        self.k = 0                      # next segment
        self.launched = 0               # segments launched so far (a replay launches one ahead, see _launch_ahead)
        self._after_route = False       # capture: the last segment ended at a router, no MoE since
        self.busy = inner.busy          # marks go on the stream at the launches, none inside a capture
        self.name = inner.name
        self._launch_ahead()            # replay: segment 0's inputs are packed already

    # ---- everything the forward calls ------------------------------------------------------------------------
    def __getattr__(self, name: str):
        attr = getattr(self.inner, name)
        if name in RECORDED:
            return lambda *a, **kw: self._op(name, attr, *a, **kw)
        return attr                     # views (rows), storage, properties: pass through

    def _op(self, name, fn, *args, **kw):
        if not self.capture:
            return self._next(name)
        self._begin_segment()
        res = fn(*args, **kw)
        self.tape.results.append((name, res))
        self.j += 1
        return res

    def route(self, x, gate_w, bias, n_group, topk_group, top_k, norm_topk_prob, scaling, topp=None):
        st, rt, b = self.st, self.rt, self.inner
        if self.capture:
            self._begin_segment()
            r, _ = b.route(x, gate_w, bias, n_group, topk_group, top_k, norm_topk_prob, scaling)   # DeviceRoute
            K = r.K
            rt.drv.memcpy_dtoh_async(st.route_idx[:K], r.idx.ptr, rt.stream)
            rt.drv.memcpy_dtoh_async(st.route_w[:K], r.weights.ptr, rt.stream)
            self.tape.results.append(("route", r))
            self.j += 1
            g = self._end_segment()
            self.k += 1
            self._launch(g, "route")
            self._after_route = True
        else:
            r = self._next("route")
            K = r.K
            self._await_segment()
        idx = st.route_idx[:K].astype(np.int64).reshape(1, K)          # [1, K]
        w = st.route_w[:K].copy().reshape(1, K)                         # [1, K] float32
        b._route = (idx, r.idx, r.weights)       # moe() takes the weights from the device when all K are in a batch
        return idx, w

    def moe(self, x, idx, weights, experts):
        if self.capture and self.rt.capturing:
            # what ran between the router and here (the shared expert) is a side segment: launched now, before the
            # MoE issues its copies, it runs on the GPU while the host issues them and the copies land
            if not self._after_route:
                raise CaptureFailed("a MoE call inside a segment (after something other than a router)")
            g = self._end_segment("side")
            self.k += 1
            g.launch(self.rt)
        elif self.capture is False and self.k < len(self.tape.graphs) and self.tape.kinds[self.k] == "side":
            self.tape.graphs[self.k].launch(self.rt)
            self.k += 1
            self.launched += 1
        self._after_route = False
        out = self.inner.moe(x, idx, weights, experts)                  # eager: the streaming machinery
        if self.capture:
            fixed = self.inner.empty(out.shape)                        # [S, H], read by the next segment's graph
            self.tape.results.append(("moe", fixed))
            self.j += 1
        else:
            fixed = self._next("moe")
        self.rt.copy(fixed.ptr, out.ptr, out.nbytes)
        self._launch_ahead()            # the next segment's inputs are all queued: its graph can go now
        return fixed

    def argmax(self, x):
        st, rt, b = self.st, self.rt, self.inner
        if self.capture:
            self._begin_segment()
            b.argmax_into(x, st.out_d.ptr)
            rt.drv.memcpy_dtoh_async(st.pinned_out, st.out_d.ptr, rt.stream)
            self.tape.results.append(("argmax", None))
            self.j += 1
            g = self._end_segment()
            self.k += 1
            self._launch(g, "end")
        else:
            self._next("argmax")
            self._await_segment()
        return np.array([int(st.pinned_out[0])], np.int64)

    # ---- inside ------------------------------------------------------------------------------------------------
    def _next(self, name: str):
        if self.j >= len(self.tape.results):
            raise TapeMismatch(f"op {self.j} ({name}) past the end of the captured step")
        got, res = self.tape.results[self.j]
        if got != name:
            raise TapeMismatch(f"op {self.j}: {name} where the captured step called {got}")
        self.j += 1
        return res

    def _begin_segment(self) -> None:
        if self.rt.capturing:
            return
        try:
            self.rt.begin_capture()
        except Exception as e:  # noqa: BLE001
            raise CaptureFailed(str(e)) from None
        self.inner.step, self.inner.busy = self.st, None
        if self.k == 0:                 # the step's per-token inputs, copied in by the first segment
            self.rt.drv.memcpy_htod_async(self.st.dyn.ptr, self.st.pinned_in, self.rt.stream)

    def _end_segment(self, kind: str = "main"):
        self.inner.step, self.inner.busy = None, self.busy
        try:
            g = self.rt.end_capture()
        except Exception as e:  # noqa: BLE001
            raise CaptureFailed(str(e)) from None
        self.tape.graphs.append(g)
        self.tape.kinds.append(kind)
        return g

    def _launch_ahead(self) -> None:
        """Replay: launch the next segment's graph as soon as everything it reads is queued (the step's inputs, the
        previous MoE's sum), before the forward's Python walks through the segment's recorded ops, so that walk
        runs while the GPU computes. Inside a step the MoE's copies keep the GPU busy for milliseconds anyway; at a
        step's start the walk through segment 0 was on the path from the last token's end to the first graph."""
        if (self.capture or self.launched != self.k or self.k >= len(self.tape.graphs)
                or self.tape.kinds[self.k] != "main"):
            return
        last = self.k == len(self.tape.graphs) - 1
        if self.busy is not None and self.k == 0:
            self.busy.mark("start")
        self.tape.graphs[self.k].launch(self.rt)
        if self.busy is not None:
            self.busy.mark("end" if last else "route")
        self.launched += 1

    def _await_segment(self) -> None:
        """Replay: the segment whose end the forward reached is launched (ahead, or now) and finished: its top-k
        (or token) is in pinned memory."""
        if self.k >= len(self.tape.graphs) or self.tape.kinds[self.k] != "main":
            raise TapeMismatch(f"segment {self.k} is not a router's or the head's in the captured step's "
                               f"{len(self.tape.graphs)}")
        self._launch_ahead()
        self.k += 1
        self._host_wait()
        self.rt.synchronize()           # the one host wake-up of the segment

    def _launch(self, g, mark: str) -> None:
        if self.busy is not None and self.k == 1:
            self.busy.mark("start")
        g.launch(self.rt)
        if self.busy is not None:
            self.busy.mark(mark)
        self._host_wait()
        self.rt.synchronize()            # the one host wake-up of the segment: its top-k (or token) is in pinned memory

    def _host_wait(self) -> None:
        """The host is about to block until the segment's graph is done: the expert source's bookkeeping of the copies
        that land before it (the previous MoE layer's) runs now, while the GPU computes, instead of on the path from
        this router to the next layer's first copy (CudaBackend.before_host_wait)."""
        hook = getattr(self.inner, "before_host_wait", None)
        if hook is not None:
            hook()

    def finish(self) -> None:
        """After the forward: the whole tape was used (a replay that stopped short would leave work undone)."""
        if self.j != len(self.tape.results) or self.k != len(self.tape.graphs):
            raise TapeMismatch(f"the step used {self.j} of {len(self.tape.results)} ops and {self.k} of "
                               f"{len(self.tape.graphs)} segments")

    def abort(self) -> None:
        """Leave a capture half-way: the stream goes back to eager use, the backend leaves step mode."""
        self.inner.step, self.inner.busy = None, self.busy
        self.rt.abort_capture()
