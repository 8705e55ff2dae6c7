"""The decode step replayed from a CUDA graph (issue 14 §1): with every routed expert resident, one greedy token is
one graph launch plus one 4-byte read-back, instead of ~30 launches per layer issued from Python and a blocking
router read-back per MoE layer.

    model.greedy([tok], cache)      # GlmMoeDsaModel asks its backend's GraphDecoder first (COLI_GRAPHS=0: never)

What is captured: the whole forward of one token (coli/model/forward.py, unchanged: the backend is put in "step
mode", `CudaBackend.step`), the greedy argmax and the copy of the token to pinned host memory. What varies per
token lives in device memory, written by the graph's first node from one pinned host block (StepLayout):

    token, position, cache length T    int32   embed reads the token; kv_put writes the new cache row at the
                                               position; indexer_scores_dyn / topk_select_dyn read (start, T)
    cos, sin of this position [dr/2]   fp32    the rope kernels (computed on the host exactly as the eager step)
    forced routing [MoE layer][K]      int32 + fp32   only with a route override (benchmarks replay a trace)

The router's top-k stays on the device (`DeviceRoute`); `expert_table` turns it into the K record pointers through
the slot table [layer, expert] -> record address (for resident experts a full table, built once by
`build_slot_table`), and the fused MoE kernels read that table as in the eager step. Results are identical to the
eager step: the same kernels in the same order on the same values (tests/gpu/test_gpu_graphs.py).

A graph bakes addresses: the cache's buffers (so its key is the cache's capacity and buffer addresses), the slot
table, the intermediate buffers (every allocation made during the capture is kept by the graph). The first step of
a key runs eagerly (it compiles the modules and sizes the MoE scratch), the second is captured, every later one
replays. A step that cannot be graphed (prefill, streaming experts, hooks, fault injection, a forced routing with
dropped slots) runs eagerly: `GraphDecoder.last_reason` says why.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from coli.errors import ColiError
from coli.model.backend import cos_sin_table

log = logging.getLogger("coli.cuda")

MAX_GRAPHS = 4       # instantiated graphs kept per decoder (a cache that grows or a second cache adds keys)


def segments_enabled(env: dict | None = None) -> bool:
    """COLI_GRAPHS_STREAM: "1" (default) a streaming decode step runs as graph segments (coli/gpu/segments.py),
    "0" eagerly. Only with COLI_GRAPHS=1."""
    v = (os.environ if env is None else env).get("COLI_GRAPHS_STREAM", "1").strip()
    if v not in ("0", "1"):
        raise ColiError(f"COLI_GRAPHS_STREAM={v!r}: use 1 (streaming steps as CUDA graph segments, the default) or 0")
    return v == "1"



def env_switch(name: str, default: str, on: str, off: str, env: dict | None = None) -> bool:
    """A 0/1 environment switch: "1" -> True, "0" -> False, unset -> `default`; anything else is a one-line error
    naming the variable and what each value does (`on` / `off`)."""
    v = (os.environ if env is None else env).get(name, default).strip()
    if v not in ("0", "1"):
        raise ColiError(f"{name}={v!r}: use 1 ({on}) or 0 ({off})")
    return v == "1"


def graph_branches_enabled(env: dict | None = None) -> bool:
    """COLI_GRAPH_BRANCHES: "1" (default) a captured decode step runs independent work on a second branch of the
    graph (CudaBackend.side): a MoE layer's shared expert beside the router and the routed experts, a projection
    outside linear_many's gemv2x groups beside the group, attention's absorbed queries beside the cache write and
    the indexer; "0" one chain of nodes. On since the H200 run of 2026-12-02 (docs/perf-notes.md "Graph branches"):
    the dense layer -10.5 us int8, warm +5 %, the same tokens and cache bits."""
    return env_switch("COLI_GRAPH_BRANCHES", "1", "independent work on a second graph branch, the default",
                      "one chain of nodes", env)


def graphs_enabled(env: dict | None = None) -> bool:
    """COLI_GRAPHS: "1" (default) replays the decode step from CUDA graphs, "0" runs every step eagerly."""
    return env_switch("COLI_GRAPHS", "1", "decode steps replayed from CUDA graphs, the default", "every step eager", env)


# ---- pure parts ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StepLayout:
    """Byte layout of a step's per-token inputs (one pinned host block, copied to the device by the graph):

        0          int32 token, int32 position (= the cache length before the step), int32 T = position + 1, pad
        16         fp32 cos [half], then fp32 sin [half]          (half = qk_rope_head_dim / 2)
        then       per MoE layer j (in moe_layers order): int32 idx [K], fp32 weights [K]   (forced routing)
    """

    half: int
    moe_layers: tuple[int, ...]
    K: int

    HEAD = 16

    @property
    def angles_offset(self) -> int:
        return self.HEAD

    def route_offset(self, layer: int) -> int:
        """Offset of layer's forced idx [K] int32; its weights [K] fp32 follow."""
        j = self.moe_layers.index(layer)
        return self.HEAD + 8 * self.half + j * 8 * self.K

    @property
    def nbytes(self) -> int:
        return self.HEAD + 8 * self.half + len(self.moe_layers) * 8 * self.K

    def pack(self, buf: np.ndarray, token: int, pos: int, cos: np.ndarray, sin: np.ndarray,
             forced: dict[int, tuple[np.ndarray, np.ndarray]] | None = None) -> None:
        """Write one step's inputs into buf (uint8 [nbytes], the pinned block). cos/sin [1, half] or [half]."""
        if buf.dtype != np.uint8 or buf.nbytes < self.nbytes:
            raise ValueError(f"step inputs need a uint8 buffer of {self.nbytes} bytes, got {buf.dtype} {buf.nbytes}")
        head = buf[:self.HEAD].view(np.int32)
        head[:] = (int(token), int(pos), int(pos) + 1, 0)
        a = buf[self.HEAD:self.HEAD + 8 * self.half].view(np.float32)
        a[:self.half] = np.asarray(cos, np.float32).reshape(-1)
        a[self.half:] = np.asarray(sin, np.float32).reshape(-1)
        for layer, (idx, w) in (forced or {}).items():
            o = self.route_offset(layer)
            buf[o:o + 4 * self.K].view(np.int32)[:] = np.asarray(idx).reshape(-1)
            buf[o + 4 * self.K:o + 8 * self.K].view(np.float32)[:] = np.asarray(w, np.float32).reshape(-1)


def build_slot_table(n_layers: int, n_experts: int, layers: Sequence[int],
                     record_ptr: Callable[[int, int], int]) -> np.ndarray:
    """The slot table [n_layers, n_experts] uint64: record address of expert e of MoE layer l (layers given),
    0 elsewhere (layers without resident experts). Raises on a null record address of a listed layer."""
    t = np.zeros((n_layers, n_experts), np.uint64)
    for layer in layers:
        if not 0 <= layer < n_layers:
            raise ValueError(f"slot table: layer {layer} outside 0..{n_layers - 1}")
        for e in range(n_experts):
            p = int(record_ptr(layer, e))
            if p <= 0:
                raise ValueError(f"slot table: layer {layer} expert {e} has no record address")
            t[layer, e] = p
    return t


@functools.lru_cache(maxsize=4096)    # called once per decode step: ~100-400 us of Python at T < ~300, same answer
def attn_span(T: int, topk: int, nh: int, Lkv: int, sm_count: int, chunk: int | None = None) -> int:
    """The row length a captured step sizes its split attention for (attend_core's n_max), so that it cuts the keys
    into the same chunks as the eager step at cache length T -- and so sums in the same order: the eager step sizes
    by T itself while T <= topk (a dense mask) and by topk after (the indexer's top-k). Returns the largest length
    that gives T's chunk size (its blocks past T return at once), so one graph serves every T of that range."""
    from coli.gpu.attention_split import TILE_KEYS, split_chunks
    if T > topk:
        return int(topk)
    want = split_chunks(T, 1, nh, Lkv, sm_count, chunk)[0]
    hi = T
    for n in range(-(-T // TILE_KEYS) * TILE_KEYS, topk + 1, TILE_KEYS):   # tile boundaries past T, up to topk
        if split_chunks(n, 1, nh, Lkv, sm_count, chunk)[0] != want:
            break
        hi = n
    if hi < topk and split_chunks(topk, 1, nh, Lkv, sm_count, chunk)[0] == want:
        hi = topk
    return int(hi)


def buffer_address(a: Any) -> int:
    """Device address of a backend array (DeviceArray.ptr), or a numpy array's data address."""
    return int(a.ptr) if hasattr(a, "ptr") else int(a.ctypes.data)


def step_key(cache, mode: str, kernels: str) -> tuple:
    """What a captured step bakes in besides the weights: the cache's capacity and buffer addresses, where the
    routing comes from (mode: "router", "forced" from the step's inputs, "dropped"), the MoE kernel version. The same key for every token of a cache until
    it grows (reallocates)."""
    ptrs = []
    for lc in cache.layers:
        ptrs += [buffer_address(lc.lat), buffer_address(lc.k_pe)]
        ptrs.append(buffer_address(lc.k_idx) if lc.k_idx is not None else 0)
    return (int(cache.capacity), tuple(ptrs), str(mode), str(kernels))


def route_mode(routes: dict, K: int, E: int) -> tuple[str, str | None]:
    """A forced routing's mode: ("forced", None) every slot an expert, ("dropped", None) every slot of every layer
    dropped (the benchmarks' no-expert decode), or ("", why it cannot be replayed): a mix of dropped and kept
    slots, a layer that keeps the router's choice, a shape other than [1, K], an expert id out of range."""
    dropped = 0
    for i, r in routes.items():
        if r is None:
            return "", f"the route override keeps the router's choice at layer {i}"
        idx = np.asarray(r[0])
        if idx.shape != (1, K) or np.asarray(r[1]).shape != (1, K):
            return "", f"a forced routing of shape {idx.shape} at layer {i}"
        if (idx < 0).all():
            dropped += 1
        elif (idx < 0).any() or (idx >= E).any():
            return "", f"a forced routing with dropped slots or expert ids outside 0..{E - 1} at layer {i}"
    if routes and dropped == len(routes):
        return "dropped", None
    if dropped:
        return "", "a forced routing that drops every expert of some layers only"
    return "forced", None


def why_not_graphable(model, ids: Sequence[int]) -> str | None:
    """Why this greedy call cannot be a replayed step (None: it can). Checks the model side only."""
    if len(ids) != 1:
        return "prefill (more than one new position)"
    if model.routing_hook is not None:
        return "a routing hook (routing traces) needs the choices on the host"
    if model.pilot_hook is not None:
        return "the pilot's lookahead hook runs on the host"
    if model.topp is not None:
        return "expert top-p pruning runs on the host"
    if getattr(model.backend, "faults", None) is not None:
        return "fault injection (tests, drills)"
    return None


def bound_to_single_step(owner, model, extra: str | None = None) -> str | None:
    """The last checks of the decoders that replay steps of several rows on the one-sequence decoder's slot table
    (BatchGraphDecoder, VerifyGraphs, MtpRoundGraphs): that decoder exists (COLI_GRAPHS) and holds every routed
    expert; `extra`: the caller's own reason not to replay, checked after it. When its step changed (a new expert
    source: a new slot table) the owner's graphs are stale: reset, and bound to the new one. None: replayable."""
    single = model.step_graphs
    if single is None:
        return "COLI_GRAPHS=0"
    why = single._bind_experts()            # the slot table of every resident expert (None: all resident)
    if why is not None:
        return why
    if extra is not None:
        return extra
    if single._step is not owner._bound:
        owner.reset()
        owner._bound = single._step
    return None


# ---- capturing ------------------------------------------------------------------------------------------------
def capture_step(owner, key: tuple, b, what: str, prepare: Callable[[], None], body: Callable[[], None],
                 restore: Callable[[], None], keep: Callable[[], list]):
    """The capture the replayed-step decoders share (GraphDecoder, BatchGraphDecoder, MtpRoundGraphs): prepare()
    (module loads: no stream work), then body() -- the step's work on the compute stream, which sets b.step itself --
    captured into a graph, kept in owner.graphs[key] with keep()'s buffers (what its kernels use for as long as it
    lives; the oldest of more than MAX_GRAPHS closed) and counted in owner.captures. A failure is remembered in
    owner.failed[key] with one warning and gives None (the caller runs the step eagerly, which raises a real error);
    restore() runs either way (the capture ran no kernel: the caches are put back where they were)."""
    rt = b.rt
    busy, b.busy = b.busy, None
    try:
        prepare()
        rt.begin_capture()
        body()
        b.step = None
        g = rt.end_capture()
    except Exception as e:   # noqa: BLE001 -- any failure leaves this shape eager
        b.step = None
        rt.abort_capture()
        owner.failed[key] = f"capture failed: {type(e).__name__}: {e}"
        log.warning("%s not graphable, running it eagerly: %s", what, owner.failed[key])
        return None
    except BaseException:
        b.step = None
        rt.abort_capture()
        raise
    finally:
        b.busy = busy
        restore()
    g.keep.append(keep())
    owner.graphs[key] = g
    owner.captures += 1
    while len(owner.graphs) > MAX_GRAPHS:
        _, old = owner.graphs.popitem(last=False)
        old.close()
    return g


def drop_graphs(owner) -> None:
    """What every replayed-step decoder's reset() starts with: its graphs closed (their buffers back to the pool),
    the keys seen and failed forgotten."""
    for g in owner.graphs.values():
        g.close()
    owner.graphs.clear()
    owner.seen.clear()
    owner.failed.clear()


def load_modules(rt, names) -> None:
    """Load (compile once) the kernel modules a captured step launches from; a module this toolkit rejects (moe_mma)
    is skipped: the backend does without it."""
    from coli.gpu.cuda_runtime import CudaError
    for mod in names:
        try:
            rt.module(mod)
        except CudaError:
            pass


# ---- the device side -------------------------------------------------------------------------------------------
class DeviceStep:
    """The device buffers of a replayed step and what CudaBackend reads while one is captured (backend.step)."""

    branches = True     # CudaBackend.side may fork inside its captures (COLI_GRAPH_BRANCHES=1); batched steps do not

    def __init__(self, rt, layout: StepLayout, slots, E: int, rec_layout, hidden_size: int):
        self.rt, self.layout, self.E, self.rec_layout = rt, layout, E, rec_layout
        self.slots = slots                                  # DeviceArray [L, E] uint64, None: none resident
        self.pinned_in = rt.drv.pagelocked_empty(layout.nbytes, np.uint8)
        self.pinned_in[:] = 0
        self.pinned_out = rt.drv.pagelocked_empty(1, np.int32)
        # the step's final-normed hidden state [1, H], copied here by every replay (MTP keeps it: greedy(hidden=))
        self.hidden_d = rt.empty((1, hidden_size), np.float32)
        self.route_idx = rt.drv.pagelocked_empty(layout.K, np.int32)      # a segment's top-k (coli/gpu/segments.py)
        self.route_w = rt.drv.pagelocked_empty(layout.K, np.float32)
        self.dyn = rt.empty((layout.nbytes,), np.uint8)
        self.out_d = rt.empty((1,), np.int32)
        # set for each capture:
        self.pos = 0              # the capture's host position (write_rows must write there)
        self.capacity = 0
        self.mode = "router"      # "router" (its top-k), "forced" (routes in the inputs), "dropped" (no experts)
        self.attn_n_max = 0       # the split attention's row length (attn_span): chunks as the eager step's
        self.keep: list = []

    @property
    def token_ptr(self) -> int:
        return self.dyn.ptr

    @property
    def pos_ptr(self) -> int:         # int32 (position, T)
        return self.dyn.ptr + 4

    def check_rows(self, S: int, what: str) -> "DeviceStep":
        if S != 1:
            from coli.gpu.cuda_runtime import CudaError
            raise CudaError(f"{what} of {S} rows in a captured decode step (one row only)")
        return self

    def check_start(self, start: int) -> None:
        if start != self.pos:
            from coli.gpu.cuda_runtime import CudaError
            raise CudaError(f"a row write at {start} in the step of position {self.pos}: not a cache write")

    def angles(self, half: int):
        from coli.gpu.cuda_runtime import CudaError, DeviceArray
        if half != self.layout.half:
            raise CudaError(f"rope with {half} angles in a step laid out for {self.layout.half}")
        base = self.dyn.ptr + self.layout.angles_offset
        return (DeviceArray(base, (1, half), np.float32, self.dyn.owner),
                DeviceArray(base + 4 * half, (1, half), np.float32, self.dyn.owner))

    def route_ptrs(self, layer: int, route) -> tuple[int, int]:
        from coli.gpu.cuda_runtime import CudaError
        if route.K != self.layout.K:
            raise CudaError(f"a router of top-{route.K} in a step laid out for top-{self.layout.K}")
        if self.mode == "router":
            return route.idx.ptr, route.weights.ptr
        o = self.dyn.ptr + self.layout.route_offset(layer)
        return o, o + 4 * self.layout.K

    def slots_row(self, layer: int) -> int:
        if self.slots is None:
            from coli.gpu.cuda_runtime import CudaError
            raise CudaError("a routed expert in a step without a slot table")
        return self.slots.ptr + layer * self.E * 8


class _Bounded(OrderedDict):
    """A dict of the most recent KEEP_KEYS keys: a server makes a cache (a key) per request, forever."""

    KEEP_KEYS = 64

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        self.move_to_end(key)
        while len(self) > self.KEEP_KEYS:
            self.popitem(last=False)


class ReplayedShapes:
    """What every replayed-step decoder keeps (GraphDecoder, BatchGraphDecoder, VerifyGraphs, MtpRoundGraphs): its
    graphs per step shape, the keys whose eager first step ran and those whose capture failed (capture_step and
    drop_graphs work on them), how many replays and captures, and why the last step ran eagerly."""

    def __init__(self, backend):
        self.b = backend
        self.graphs: OrderedDict[tuple, Any] = OrderedDict()
        self.seen = _Bounded()                   # keys whose eager first step ran
        self.failed = _Bounded()                 # keys whose capture failed (stay eager) -> the reason
        self.replays = self.captures = 0
        self.last_reason: str | None = None


class _Replay:
    """A route override that gives back routes already taken from the model's override (an eager fallback)."""

    def __init__(self, routes: dict):
        self.routes = routes

    def __call__(self, layer: int, n_rows: int):
        return self.routes.get(layer)


@contextlib.contextmanager
def replaying_routes(model, routes: dict):
    """Run the body with the model routed by `routes` (layer -> routes already drawn from its override), so an
    eager fallback takes the same experts the draw did; the model's own override is back afterwards."""
    saved, model.route_override = model.route_override, _Replay(routes)
    try:
        yield
    finally:
        model.route_override = saved


class GraphDecoder(ReplayedShapes):
    """Greedy decode steps of one model replayed from CUDA graphs (see the module docstring)."""

    def __init__(self, model, backend):
        super().__init__(backend)
        self.model = model
        self.tapes: OrderedDict[tuple, Any] = OrderedDict()     # segmented steps (coli/gpu/segments.py)
        self.segmented = segments_enabled()      # streaming steps as graph segments (COLI_GRAPHS_STREAM)
        self.segment_steps = 0                   # streaming steps run from captured segments
        self._experts_ref = None
        self._bind_reason: str | None = None
        self._step: DeviceStep | None = None
        self.time_gpu = False                    # benchmarks: time each replay on the device (two events)
        self.gpu_s: list[float] = []             # device time of each timed replay

    # ---- public --------------------------------------------------------------------------------------------
    def greedy(self, ids: Sequence[int], cache, hidden: bool = False):
        """The greedy next token after ids (one position) from a replayed graph; None: run the step eagerly.
        hidden: -> (token, the step's final-normed hidden state [1, H] on the device) from a replay of a step with
        every expert resident, else None (the caller runs the step eagerly: streamed or forced-route steps too)."""
        m, c = self.model, self.model.config
        reason = why_not_graphable(m, ids)
        if reason is None and hidden and m.route_override is not None:
            reason = "a route override (benchmarks): its draws would be spent by a step that cannot give the hidden"
        if reason is None and (cache.backend is not self.b or m.backend is not self.b):
            reason = "the model or its cache lives on another backend"
        if reason is not None:
            self.last_reason = reason
            return None
        tok = int(ids[0])
        if not 0 <= tok < c.vocab_size:
            return None                            # the eager step raises the one-line error
        resident = self._bind_experts()            # None: every expert resident (a slot table)
        routes, mode = None, "router"
        if m.route_override is not None:
            routes = {i: m.route_override(i, 1) for i in c.moe_layers}
            mode, bad = route_mode(routes, c.num_experts_per_tok, c.n_routed_experts)
            if resident is not None and mode != "dropped":     # streaming experts: a graph per segment
                return self._segmented(ids, cache, routes, resident)
            if bad is not None:
                return self._eager(ids, cache, routes, bad)
        elif resident is not None:
            if hidden:
                self.last_reason = f"a streaming step gives no hidden state ({resident})"
                return None
            return self._segmented(ids, cache, None, resident)
        cache.reserve(1)
        span = self._attn_span(cache.length + 1)
        key = step_key(cache, mode, self.b.moe_kernels) + (("attn", span),)
        if key in self.failed:
            return self._eager(ids, cache, routes, self.failed[key])
        g = self.graphs.get(key)
        if g is None and key not in self.seen:
            self.seen[key] = True
            return self._eager(ids, cache, routes, "first step of this shape (eager: compiles and sizes what the "
                                                   "capture needs)")
        st = self._step
        pos = cache.length
        cos, sin = cos_sin_table([pos], c.qk_rope_head_dim, c.rope_theta)
        st.layout.pack(st.pinned_in, tok, pos, cos, sin, routes if mode == "forced" else None)
        if g is None:
            st.attn_n_max = span
            g = self._capture(key, tok, cache, mode)
            if g is None:
                return self._eager(ids, cache, routes, self.failed[key])
        self.graphs.move_to_end(key)
        busy, rt = self.b.busy, self.b.rt
        if busy is not None:
            busy.mark("start")
        if self.time_gpu:
            ev0, ev1 = rt.event(), rt.event()
            ev0.record(rt.stream)
        g.launch(rt)
        if self.time_gpu:
            ev1.record(rt.stream)
        if busy is not None:
            busy.mark("end")
        rt.synchronize()
        if self.time_gpu:
            self.gpu_s.append(ev1.time_since(ev0) / 1e3)
        cache.length = pos + 1
        self.replays += 1
        self.last_reason = None
        if hidden:
            h = self.b.empty((1, c.hidden_size))
            self.b.place_rows(h, 0, st.hidden_d)        # the next replay overwrites hidden_d
            return int(st.pinned_out[0]), h
        return int(st.pinned_out[0])

    def reset(self) -> None:
        """Drop every graph (their buffers go back to the pool) and the slot table."""
        drop_graphs(self)
        for t in self.tapes.values():
            t.close()
        self.tapes.clear()
        self._experts_ref = None
        self._step = None

    # ---- inside ----------------------------------------------------------------------------------------------
    def _segmented(self, ids, cache, routes, why: str) -> int | None:
        """A streaming step (experts through the VRAM cache) as one graph per router segment, the MoE eager
        between them (coli/gpu/segments.py)."""
        from coli.gpu.segments import CaptureFailed, SegmentProxy, SegmentTape, TapeMismatch
        m, c, b = self.model, self.model.config, self.b
        if not self.segmented:
            return self._eager(ids, cache, routes, why)
        if m.pilot_hook is not None:
            return self._eager(ids, cache, routes, "the pilot's lookahead hook runs between the router and the MoE")
        cache.reserve(1)
        span = self._attn_span(cache.length + 1)
        key = ("segments",) + step_key(cache, "stream", b.moe_kernels) + (("attn", span),)
        if key in self.failed:
            return self._eager(ids, cache, routes, self.failed[key])
        tape = self.tapes.get(key)
        if tape is None and key not in self.seen:
            self.seen[key] = True
            return self._eager(ids, cache, routes, "first step of this shape (eager: compiles and sizes what the "
                                                   "capture needs)")
        st, pos, tok = self._step, cache.length, int(ids[0])
        cos, sin = cos_sin_table([pos], c.qk_rope_head_dim, c.rope_theta)
        st.layout.pack(st.pinned_in, tok, pos, cos, sin, None)
        capture = tape is None
        if capture:
            for mod in ("graph", "indexer", "argmax"):
                b.rt.module(mod)
            tape = SegmentTape()
            st.pos, st.capacity, st.mode, st.keep = pos, cache.capacity, "router", []
            st.attn_n_max = span
        proxy = SegmentProxy(b, st, tape, capture)
        saved = m.route_override
        if routes is not None:
            m.route_override = _Replay(routes)
        m.backend = cache.backend = proxy
        try:
            out = m.greedy_eager(ids, cache)
            proxy.finish()
        except (CaptureFailed, TapeMismatch) as e:
            proxy.abort()
            m.backend = cache.backend = b
            tape.close()
            self.tapes.pop(key, None)
            self.failed[key] = f"segments: {type(e).__name__}: {e}"
            log.warning("streaming decode step not graphable, running it eagerly: %s", self.failed[key])
            cache.length = pos
            return m.greedy_eager(ids, cache)          # again from the start: the same rows are rewritten
        except Exception as e:
            was_capturing = b.rt.capturing
            proxy.abort()
            m.backend = cache.backend = b
            if capture:
                tape.close()
            if not was_capturing:
                raise                                   # a real error of the step (its MoE, a kernel): as eager
            self.failed[key] = f"segments: capture failed: {type(e).__name__}: {e}"
            log.warning("streaming decode step not graphable, running it eagerly: %s", self.failed[key])
            cache.length = pos
            return m.greedy_eager(ids, cache)
        finally:
            m.backend = cache.backend = b
            m.route_override = saved
        if capture:
            tape.keep = st.keep                         # scratch buffers the graphs use (none today: MoE is eager)
            self.tapes[key] = tape
            self.captures += 1
            while len(self.tapes) > MAX_GRAPHS:
                _, old = self.tapes.popitem(last=False)
                old.close()
        self.tapes.move_to_end(key)
        self.segment_steps += 1
        self.last_reason = None
        return out

    def _attn_span(self, T: int) -> int:
        c, b = self.model.config, self.b
        return attn_span(T, c.index_topk, c.num_attention_heads, c.kv_lora_rank, b.rt.sm_count,
                         getattr(b, "attn_chunk", None))

    def _eager(self, ids, cache, routes, reason: str) -> int | None:
        """Say why, and run the step eagerly: here with the routes already drawn from the override (None: the
        caller runs it, nothing was drawn)."""
        self.last_reason = reason
        if routes is None:
            return None
        with replaying_routes(self.model, routes):
            return self.model.greedy_eager(ids, cache)

    def _bind_experts(self) -> str | None:
        """Build the slot table of model.experts (again when the model's expert source changed); None when every
        routed expert is resident, else why not. The step's device buffers exist either way (a routing that
        drops every expert needs no table)."""
        ex = self.model.experts
        if self._experts_ref is not None and self._experts_ref() is ex:
            return self._bind_reason
        self.reset()
        self._experts_ref = weakref.ref(ex)      # weak: a graph must not keep a dropped expert source's VRAM
        c, b = self.model.config, self.b
        slots, lay, reason = None, getattr(ex, "layout", None), None
        if not hasattr(ex, "slot_table"):
            reason = f"experts stream ({type(ex).__name__}: not every expert resident)"
        elif c.moe_layers and (lay is None or not b._decode_ok(lay)):
            reason = "the experts' record layout has no fused decode kernels"
        else:
            table = ex.slot_table(c.num_hidden_layers)                   # [L, E] uint64
            missing = [i for i in c.moe_layers if not table[i].all()]
            if missing:
                reason = f"MoE layer(s) {missing[:4]} not resident"
            else:
                slots = b.rt.to_device(table)
        layout = StepLayout(c.qk_rope_head_dim // 2, tuple(c.moe_layers), c.num_experts_per_tok)
        self._step = DeviceStep(b.rt, layout, slots, c.n_routed_experts, lay, c.hidden_size)
        self._bind_reason = reason
        return reason

    def _capture(self, key: tuple, tok: int, cache, mode: str):
        b, rt, st = self.b, self.b.rt, self._step
        st.pos, st.capacity, st.mode, st.keep = cache.length, cache.capacity, mode, []
        pos = cache.length

        def prepare():
            for mod in ("graph", "indexer", "argmax"):   # compiled before: loading a module is no stream work
                rt.module(mod)

        def body():
            b.step = st
            rt.drv.memcpy_htod_async(st.dyn.ptr, st.pinned_in, rt.stream)
            hn = self.model.hidden_device([tok], cache)                        # [1, H]
            b.place_rows(st.hidden_d, 0, hn)
            logits = b.linear(hn, self.model.lm_head)                          # [1, V]
            b.argmax_into(logits, st.out_d.ptr)
            rt.drv.memcpy_dtoh_async(st.pinned_out, st.out_d.ptr, rt.stream)

        def restore():
            cache.length = pos           # the capture ran no kernel: the replay advances the cache

        return capture_step(self, key, b, "decode step", prepare, body, restore, lambda: st.keep)
