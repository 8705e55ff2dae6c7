"""The host side of the batched decode step replayed from CUDA graphs (coli/gpu/batch_graphs.py), no GPU needed: its
setting, the layout of its per-step inputs, which row's values the backend reads where, the per-row MoE launches,
and a whole capture of a real oracle model's batched step, all on a recording stand-in runtime (fake addresses, no
data; every launch checked against the kernel's signature, as in tests/test_decode_launches.py; a host read-back or
upload while capturing raises, as on the device). The replayed step's values are checked on the GPU
(tests/gpu/test_gpu_batch.py)."""

from __future__ import annotations

import numpy as np
import pytest

from coli.errors import ColiError
from coli.gpu.batch_graphs import BatchStepInputs, BatchStepLayout, batch_graphs_enabled
from coli.gpu.cuda_runtime import CudaError, DeviceArray
from recording_runtime import RecordingRuntime


def test_the_setting_is_off_by_default_and_must_be_0_or_1():
    assert batch_graphs_enabled({}) is False
    assert batch_graphs_enabled({"COLI_BATCH_GRAPHS": "1"}) is True
    assert batch_graphs_enabled({"COLI_BATCH_GRAPHS": " 0 "}) is False
    with pytest.raises(ColiError, match=r"COLI_BATCH_GRAPHS='yes': use 1 .* or 0"):
        batch_graphs_enabled({"COLI_BATCH_GRAPHS": "yes"})


def test_layout_packs_tokens_positions_and_each_rows_angles():
    lay = BatchStepLayout(B=3, half=4)
    assert (lay.pos_at, lay.angles_at) == (16, 48)          # both 16-byte aligned for the kernels' loads
    assert lay.nbytes == 48 + 8 * 3 * 4
    buf = np.zeros(lay.nbytes, np.uint8)
    cos = np.arange(12, dtype=np.float32).reshape(3, 4)
    sin = -cos
    lay.pack(buf, [7, 8, 9], [0, 41, 5], cos, sin)
    assert buf[:12].view(np.int32).tolist() == [7, 8, 9]
    assert buf[16:40].view(np.int32).reshape(3, 2).tolist() == [[0, 1], [41, 42], [5, 6]]   # (position, T)
    assert lay.pos_offset(1) == 24
    a = buf[48:].view(np.float32)
    np.testing.assert_array_equal(a[:12].reshape(3, 4), cos)
    np.testing.assert_array_equal(a[12:].reshape(3, 4), sin)
    with pytest.raises(ValueError, match="a step of 3 rows got 2 tokens"):
        lay.pack(buf, [7, 8], [0, 41, 5], cos, sin)
    with pytest.raises(ValueError, match="uint8 buffer of 144 bytes"):
        lay.pack(np.zeros(100, np.uint8), [7, 8, 9], [0, 41, 5], cos, sin)
    with pytest.raises(ValueError, match="row 3 of a step of 3"):
        lay.pos_offset(3)



def test_layout_packs_a_forced_routing_per_moe_layer():
    from coli.gpu.batch_graphs import batch_route_mode
    lay = BatchStepLayout(B=2, half=4, moe_layers=(1, 3), K=3)
    assert lay.route_offset(1) == lay.angles_at + 8 * 2 * 4 and lay.route_offset(3) == lay.route_offset(1) + 8 * 6
    assert lay.nbytes == lay.route_offset(3) + 8 * 6
    buf = np.zeros(lay.nbytes, np.uint8)
    angles = np.zeros((2, 4), np.float32)
    idx = np.array([[0, 5, 2], [7, 1, 3]])
    w = np.arange(6, dtype=np.float32).reshape(2, 3) / 8
    lay.pack(buf, [1, 2], [3, 4], angles, angles, {3: (idx, w)})
    o = lay.route_offset(3)
    assert buf[o:o + 24].view(np.int32).reshape(2, 3).tolist() == idx.tolist()
    np.testing.assert_array_equal(buf[o + 24:o + 48].view(np.float32).reshape(2, 3), w)
    with pytest.raises(ValueError, match=r"a forced routing of shape \(1, 3\) at layer 1 in a step of 2x3"):
        lay.pack(buf, [1, 2], [3, 4], angles, angles, {1: (idx[:1], w[:1])})
    ok = {1: (idx, w), 3: (idx, w)}
    assert batch_route_mode(ok, 2, 3, 8) is None
    assert "keeps the router's choice at layer 3" in batch_route_mode({1: (idx, w), 3: None}, 2, 3, 8)
    assert "dropped slots" in batch_route_mode({1: (np.where(idx == 5, -1, idx), w)}, 2, 3, 8)
    assert "outside 0..5" in batch_route_mode({1: (idx, w)}, 2, 3, 6)
    assert "shape (1, 3)" in batch_route_mode({1: (idx[:1], w[:1])}, 2, 3, 8)


class _Drv:
    @staticmethod
    def pagelocked_empty(n, dtype):
        return np.empty(n, dtype)


class _RecordingRuntime(RecordingRuntime):
    """Hands out fake device addresses and records every launch with its arguments (no GPU)."""

    drv = _Drv()

    def zero(self, ptr, nbytes):
        self.launches.append(("zero", (ptr, nbytes)))

    def record(self, name, argtypes, grid, block, args, smem):
        self.launches.append((name, args))


def _backend():
    from coli.gpu.cuda_backend import CudaBackend
    gb = CudaBackend.__new__(CudaBackend)
    gb.rt, gb.busy, gb.moe_kernels, gb._scratch, gb._mma_usable = _RecordingRuntime(), None, "v2", {}, None
    gb.step = None
    return gb


def _inputs(gb, B, H=128, Im=64, E=16, K=4):
    from coli.container.format import RecordLayout
    lay = RecordLayout.make(H, Im, "int4", 64, 512)
    slots = gb.rt.empty((4, E), np.uint64)
    return BatchStepInputs(gb.rt, BatchStepLayout(B, 8, (1, 2, 3), K), slots, E, lay), slots


def test_rows_read_their_own_position_span_and_capacity():
    gb = _backend()
    st, _ = _inputs(gb, 3)
    st.positions, st.capacities, st.spans = [10, 20, 30], [64, 128, 64], [64, 64, 128]
    assert st.check_rows(3, "embed") is st and st.token_ptr == st.dyn.ptr
    cs, sn = st.angles(8)
    assert cs.shape == (3, 8) and sn.ptr == cs.ptr + 4 * 3 * 8
    with pytest.raises(CudaError, match="a position outside a row's attention"):
        st.pos_ptr
    with pytest.raises(CudaError, match="write_rows of 1 rows in the batch of a captured batched step"):
        st.check_rows(1, "write_rows")
    st.select(2)
    assert st.check_rows(1, "write_rows") is st
    assert st.pos_ptr == st.dyn.ptr + 16 + 8 * 2
    assert (st.pos, st.capacity, st.attn_n_max) == (30, 64, 128)
    st.check_start(30)
    with pytest.raises(CudaError, match="a row write at 29 in row 2's step of position 30"):
        st.check_start(29)
    with pytest.raises(CudaError, match="embed inside a row's attention"):
        st.token_ptr
    with pytest.raises(CudaError, match="rope with 8 angles"):
        st.angles(8)
    with pytest.raises(CudaError, match="moe_step of 3 rows in row 2's attention"):
        st.check_rows(3, "moe_step")


@pytest.mark.parametrize("mode", ["router", "forced"])
def test_a_batched_moe_step_runs_each_rows_fused_decode_on_its_own_rows(mode):
    from coli.gpu.cuda_backend import DeviceRoute
    gb = _backend()
    B, H, K = 3, 128, 4
    st, slots = _inputs(gb, B, H=H, K=K)
    st.mode = mode
    gb.step = st
    x = gb.rt.empty((B, H))
    route = DeviceRoute(gb.rt.empty((B, K), np.int32), gb.rt.empty((B, K)), K)
    out = gb.moe_step(2, x, route)
    assert out.shape == (B, H)
    names = [n for n, _ in gb.rt.launches]
    assert names == ["expert_table", "moe_gateup_int4", "moe_down_int4"] * B
    # the router's [B, K] choice, or layer 2's forced [B, K] in the step's inputs
    idx0, w0 = ((route.idx.ptr, route.weights.ptr) if mode == "router" else
                (st.dyn.ptr + st.layout.route_offset(2), st.dyn.ptr + st.layout.route_offset(2) + 4 * B * K))
    for r in range(B):
        tab, gu, dn = (args for _, args in gb.rt.launches[3 * r:3 * r + 3])
        assert tab[0] == idx0 + 4 * K * r and tab[2] == slots.ptr + 2 * 16 * 8   # row r's top-k, layer 2's slots
        assert gu[10] == x.ptr + 4 * H * r                                       # row r's activation
        assert dn[9] == w0 + 4 * K * r and dn[11] == out.ptr + 4 * H * r         # its weights, its output
        assert dn[12] == 0                                                       # K <= 8: one launch, no sum


class _CapturingRuntime(_RecordingRuntime):
    """_RecordingRuntime with what a whole model needs: uploads, read-backs (zeros) and a stream capture whose
    graph counts its launches. Like the device runtime, a synchronous call while capturing raises."""

    def __init__(self):
        super().__init__()
        self.capture: list | None = None
        self.graph_launches = 0
        self.stream = None

    @property
    def capturing(self) -> bool:
        return self.capture is not None

    def _not_capturing(self, what):
        if self.capture is not None:
            raise CudaError(f"{what} while capturing")

    def module(self, name):
        return name

    def alloc(self, n):
        ptr, self._next = self._next, self._next + ((n + 255) // 256 + 1) * 256
        return ptr

    def empty(self, shape, dtype=np.float32):
        return DeviceArray(self.alloc(int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize), shape, dtype)

    def to_device(self, host, dtype=None):
        self._not_capturing("a synchronous upload")
        h = np.asarray(host, dtype=dtype or np.asarray(host).dtype)
        return self.empty(h.shape, h.dtype)

    to_device_async = to_device

    def upload_bytes(self, raw, dst):
        self._not_capturing("a synchronous upload")

    def to_host(self, x):
        self._not_capturing("a read-back")
        return np.zeros(x.shape, x.dtype)

    def synchronize(self):
        self._not_capturing("a synchronisation")

    def copy(self, dst, src, nbytes):
        self.launches.append(("copy", (dst, src, nbytes)))

    def begin_capture(self):
        self.capture = []

    def end_capture(self):
        self.capture = None
        rt = self

        class Graph:
            keep: list = []

            def launch(self, _rt):
                rt.graph_launches += 1

            def close(self):
                pass
        return Graph()

    def abort_capture(self):
        self.capture = None

    def on_side_stream(self, fn):
        """A captured step's second branch (COLI_GRAPH_BRANCHES, on by default), run in place: its launches are
        recorded in the order the forward asked for them (_BranchingRuntime marks the forks and joins)."""
        if self.capture is None:
            raise CudaError("on_side_stream outside a CUDA graph capture")
        value = fn()
        return lambda: value


_CapturingRuntime.drv = type("Drv", (), {"pagelocked_empty": staticmethod(lambda n, dtype: np.zeros(n, dtype)),
                                         "memcpy_htod_async": staticmethod(lambda *a: None),
                                         "memcpy_dtoh_async": staticmethod(lambda *a: None)})()


@pytest.fixture(scope="module")
def oracle_src(tmp_path_factory):
    from coli.container.writer import ConvertOptions, convert
    from oracles import load_oracle, oracle_dir
    d = oracle_dir(tmp_path_factory.mktemp("oracles"), "long-prompt")
    int4 = tmp_path_factory.mktemp("containers") / "long-prompt-int4"
    convert(d, int4, ConvertOptions(experts="int4", dense="int8", group=64))
    return {"f32": d, "int4": int4}, load_oracle(d)


class _Forced:
    """A route override (what the benchmarks' TraceRouting is): fixed experts per layer, every call recorded."""

    def __init__(self, K, E):
        self.K, self.E, self.calls = K, E, []

    def __call__(self, layer, n):
        self.calls.append((layer, n))
        idx = (np.arange(n * self.K).reshape(n, self.K) + layer) % self.E
        return idx.astype(np.int64), np.full((n, self.K), 1.0 / self.K, np.float32)


class _Dropped(_Forced):
    """The benchmarks' no-routed-expert override: every slot of every row dropped (idx -1)."""

    def __call__(self, layer, n):
        self.calls.append((layer, n))
        return np.full((n, self.K), -1, np.int64), np.zeros((n, self.K), np.float32)


def _override(routing: str, c):
    """The route override a test's `routing` names ("router": none, the model's own router)."""
    cls = {"forced": _Forced, "dropped": _Dropped}.get(routing)
    return cls(c.num_experts_per_tok, c.n_routed_experts) if cls is not None else None


@pytest.mark.parametrize("routing,fmt", [("router", "f32"), ("forced", "f32"), ("dropped", "f32"),
                                         ("router", "int4")])
def test_a_batched_step_is_captured_once_and_replayed(oracle_src, monkeypatch, routing, fmt):
    from coli.gpu.cuda_backend import CudaBackend
    from coli.loader import open_weights
    from coli.model.batch import BatchRow, batch_graphs, greedy_batch
    from coli.model.forward import GlmMoeDsaModel
    monkeypatch.setenv("COLI_BATCH_GRAPHS", "1")
    monkeypatch.setenv("COLI_GRAPHS", "1")
    dirs, o = oracle_src
    d = dirs[fmt]                                    # the checkpoint, or an int4 container (int8 dense core)
    rt = _CapturingRuntime()
    gb = CudaBackend(runtime=rt)
    w = open_weights(d)
    model = GlmMoeDsaModel(w.config, w, gb, experts=gb.expert_source(w))
    p = o["prompt_ids"]
    caches = [model.new_cache(64) for _ in range(3)]
    toks = [model.greedy_eager(q, c) for q, c in zip([p, p[:5], p[:20]], caches)]
    dec = batch_graphs(model)
    c = model.config
    forced = _override(routing, c)
    model.route_override = forced
    marks = []
    for step in range(4):
        marks.append(len(rt.launches))
        toks = greedy_batch(model, [BatchRow(c, [t]) for c, t in zip(caches, toks)])
        assert [c.length for c in caches] == [len(p) + 1 + step, 6 + step, 21 + step]
        if step == 0:
            assert dec.last_reason.startswith("first step of this batch") and rt.graph_launches == 0
    marks.append(len(rt.launches))
    assert not dec.failed and (dec.captures, dec.replays, rt.graph_launches) == (1, 3, 3)
    assert marks[4] == marks[2]                      # replayed steps launch nothing from the host but the graph
    captured = rt.launches[marks[1]:marks[2]]
    st = dec.inputs[3]
    if forced is not None:        # drawn once per MoE layer per step: eager, captured and replayed steps alike
        assert forced.calls == [(i, 3) for _ in range(4) for i in c.moe_layers]
        tables = [args[0] for name, args in captured if name == "expert_table"]
        K = c.num_experts_per_tok
        if routing == "dropped":      # the routed sums are zeroed, no expert is read
            assert tables == [] and sum(name == "zero" for name, _ in captured) == len(c.moe_layers)
        else:
            assert tables == [st.dyn.ptr + st.layout.route_offset(i) + 4 * K * r for i in c.moe_layers
                              for r in range(3)]
    bufs = [{int(x.ptr) for lc in cache.layers for x in (lc.lat, lc.k_pe, lc.k_idx) if x is not None}
            for cache in caches]
    rows = []
    for name, args in captured:
        if name == "kv_put3":     # (pos_ptr, then (src, n, dst) per cache row): row r's position, row r's caches
            r = (args[0] - st.dyn.ptr - st.layout.pos_at) // 8
            dsts = [a for a in args[3::3] if a]        # the unused slots' pointers are 0
            assert all(d in bufs[r] for d in dsts)
            rows.append((r, len(dsts)))
        elif name == "indexer_scores_dyn":
            rows.append(("idx", (args[5] - st.dyn.ptr - st.layout.pos_at) // 8))
        elif name.startswith("embed_"):
            assert args[-2] == st.dyn.ptr                                     # the B tokens of the step's inputs
        elif name in ("rope", "rope4"):
            assert name == "rope4"                                            # a layer's ropes in one launch
            assert args[2] == 3 and args[0] == st.dyn.ptr + st.layout.angles_at   # B rows of angles
    full = sum(t == "full" for t in c.indexer_types)
    want = []
    for i in range(c.num_hidden_layers):   # per layer, rows in order: one write of lat, k_pe (+ k_idx), then the indexer
        for r in range(3):
            want += [(r, 3), ("idx", r)] if c.indexer_types[i] == "full" else [(r, 2)]
    assert rows == want and full > 0
    # a row leaving: a new key, eager once, then captured
    for _ in range(3):
        toks = greedy_batch(model, [BatchRow(c2, [t]) for c2, t in zip(caches[:2], toks[:2])])
    assert (dec.captures, dec.replays) == (2, 5) and not dec.failed
    if forced is not None:
        assert forced.calls[4 * len(c.moe_layers):] == [(i, 2) for _ in range(3) for i in c.moe_layers]


def test_a_model_with_batched_graphs_can_be_freed(oracle_src, monkeypatch):
    """The decoder is kept per model (coli.model.batch.batch_graphs): it must not keep its model -- and the model's
    device weights -- alive once the caller drops it."""
    import gc
    import weakref
    from coli.gpu.cuda_backend import CudaBackend
    from coli.loader import open_weights
    from coli.model.batch import batch_graphs
    from coli.model.forward import GlmMoeDsaModel
    monkeypatch.setenv("COLI_BATCH_GRAPHS", "1")
    dirs, _ = oracle_src
    w = open_weights(dirs["f32"])
    gb = CudaBackend(runtime=_CapturingRuntime())
    model = GlmMoeDsaModel(w.config, w, gb, experts=gb.expert_source(w))
    assert batch_graphs(model) is not None
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None


def test_verify_graphs_are_on_unless_turned_off_and_a_bad_value_is_named():
    from coli.gpu.verify_graphs import MAX_ROWS, verify_graphs_enabled
    from coli.model.mtp import MAX_DRAFTS
    assert verify_graphs_enabled({}) is True
    assert verify_graphs_enabled({"COLI_VERIFY_GRAPHS": "1"}) is True
    assert verify_graphs_enabled({"COLI_VERIFY_GRAPHS": "0"}) is False
    with pytest.raises(ColiError, match="COLI_VERIFY_GRAPHS='on'"):
        verify_graphs_enabled({"COLI_VERIFY_GRAPHS": "on"})
    assert MAX_ROWS == MAX_DRAFTS + 1          # a verify step of every draft count SpeculativeDecoder runs


def test_a_verify_step_lays_out_its_rows_as_a_batched_step_of_one_cache():
    """VerifyGraphs packs S consecutive positions of one sequence as a batched step of B = S rows (what
    forward_rows' captured attention reads per row: its position and T = position + 1), with a forced routing of
    [S, K] per MoE layer."""
    lay = BatchStepLayout(3, 4, (1, 2), 2)
    buf = np.zeros(lay.nbytes, np.uint8)
    cos, sin = np.ones((3, 4), np.float32), np.zeros((3, 4), np.float32)
    forced = {i: (np.array([[0, 1], [2, 3], [4, 5]]), np.full((3, 2), 0.5, np.float32)) for i in (1, 2)}
    lay.pack(buf, [7, 8, 9], [40, 41, 42], cos, sin, forced)
    for r, p in enumerate((40, 41, 42)):
        assert buf[lay.pos_offset(r):lay.pos_offset(r) + 8].view(np.int32).tolist() == [p, p + 1]
    idx = buf[lay.route_offset(2):lay.route_offset(2) + 24].view(np.int32).reshape(3, 2)
    assert idx.tolist() == [[0, 1], [2, 3], [4, 5]]


@pytest.mark.parametrize("routing", ["router", "forced", "dropped"])
def test_a_verify_step_is_captured_once_and_replayed(oracle_src, monkeypatch, routing):
    """coli/gpu/verify_graphs.py on the recording runtime: S = 3 positions of one cache captured once and replayed
    (the host launches nothing per replay but the graph and the copy of its hidden states); in the capture, each
    row's cache writes read its own position (rows in order, every write into the one cache), and a route override
    is drawn once per MoE layer per step for the S rows -- as the eager step draws it."""
    from coli.gpu.cuda_backend import CudaBackend
    from coli.loader import open_weights
    from coli.model.forward import GlmMoeDsaModel
    monkeypatch.setenv("COLI_GRAPHS", "1")
    dirs, o = oracle_src
    rt = _CapturingRuntime()
    gb = CudaBackend(runtime=rt)
    w = open_weights(dirs["f32"])
    model = GlmMoeDsaModel(w.config, w, gb, experts=gb.expert_source(w))
    monkeypatch.setenv("COLI_VERIFY_GRAPHS", "0")
    assert gb.verify_graphs(model) is None, "COLI_VERIFY_GRAPHS=0 turns them off"
    monkeypatch.delenv("COLI_VERIFY_GRAPHS")
    assert gb.verify_graphs(model) is not None, "on by default"
    vg = gb.verify_graphs(model, force=True)
    c = model.config
    cache = model.new_cache(64)
    model.greedy_eager(o["prompt_ids"], cache)
    P, S = cache.length, 3
    forced = _override(routing, c)
    model.route_override = forced
    marks = []
    for step in range(4):
        marks.append(len(rt.launches))
        got = vg.greedy(cache, [5, 6, 7])
        if step == 0:
            assert vg.last_reason.startswith("first verify step of this shape") and rt.graph_launches == 0
            # no override: nothing ran (the caller runs the step); with one, the routes drawn ran it here
            assert (got is None) == (forced is None) and cache.length == (P if forced is None else P + S)
        else:
            toks, hn = got
            assert len(toks) == S and hn.shape == (S, c.hidden_size) and cache.length == P + S
        cache.truncate(P)
    marks.append(len(rt.launches))
    assert not vg.failed and (vg.captures, vg.replays, rt.graph_launches) == (1, 3, 3)
    for a, b in ((2, 3), (3, 4)):                      # a replay: the graph, then one copy of its hidden states
        assert [name for name, _ in rt.launches[marks[a]:marks[b]]] == ["copy"]
    if forced is not None:
        assert forced.calls == [(i, S) for _ in range(4) for i in c.moe_layers]
    st = vg.inputs[S]
    bufs = {int(x.ptr) for lc in cache.layers for x in (lc.lat, lc.k_pe, lc.k_idx) if x is not None}
    rows = []
    for name, args in rt.launches[marks[1]:marks[2]]:
        if name == "kv_put3":
            rows.append((args[0] - st.dyn.ptr - st.layout.pos_at) // 8)
            assert all(d in bufs for d in args[3::3] if d)
    assert rows == [r for _ in range(c.num_hidden_layers) for r in range(S)]
    assert vg.greedy(cache, [1, 2, 3, 4, 5]) is None and "5 positions" in vg.last_reason


def test_mtp_rounds_of_three_drafts_verify_through_the_replayed_step(oracle_src, monkeypatch, tmp_path):
    """With COLI_VERIFY_GRAPHS=1 a greedy round of k = 3 drafts hands its verify step to the head's VerifyGraphs
    (coli.model.mtp.SpeculativeDecoder.step): eager the first time, then captured and replayed, the round accepting
    on the replay's argmax (the recording runtime's values are zeros: every draft agrees, the path is what is
    checked here; the tokens are tests/gpu/test_gpu_verify_graphs.py's)."""
    from checkpoints import with_mtp_layer
    from coli.generate import Generation
    from coli.gpu.cuda_backend import CudaBackend
    from coli.loader import open_weights
    from coli.model.forward import GlmMoeDsaModel
    from coli.model.mtp import load_mtp_head
    monkeypatch.setenv("COLI_GRAPHS", "1")
    monkeypatch.setenv("COLI_VERIFY_GRAPHS", "1")
    monkeypatch.setenv("COLI_MTP_GRAPHS", "0")        # k = 1 too would go through VerifyGraphs then; k = 3 does anyway
    dirs, o = oracle_src
    d = with_mtp_layer(dirs["f32"], tmp_path / "with-mtp", seed=31)
    gb = CudaBackend(runtime=_CapturingRuntime())
    w = open_weights(d)
    model = GlmMoeDsaModel(w.config, w, gb, experts=gb.expert_source(w))
    head = load_mtp_head(model)
    assert head.verify is not None and head.rounds is None
    toks = list(Generation(model, o["prompt_ids"], 14, ignore_eos=True, mtp=(head, 3)))
    assert len(toks) == 14
    assert head.verify.captures == 1 and head.verify.replays >= 2, head.verify.last_reason


def test_a_decode_over_mapped_host_records_is_replayed_as_a_resident_ones(oracle_src, monkeypatch):
    """coli/gpu/mapped_experts.py on the recording runtime: a model whose experts are the zero-copy source (every
    record in pinned RAM, mapped by a stand-in driver) runs its prefill's MoE on the records' mapped addresses and
    replays its decode steps from one graph, as with every expert resident (the bench's mapped-ram row); the values
    are tests/gpu/test_gpu_mapped.py's."""
    from coli.container.reader import ContainerReader
    from coli.gpu.cuda_backend import CudaBackend
    from coli.gpu.host_records import MemoryHostTier
    from coli.gpu.mapped_experts import MappedHostExperts
    from coli.model.forward import GlmMoeDsaModel
    monkeypatch.setenv("COLI_GRAPHS", "1")

    class Drv:                                            # maps each range at an address of its own
        def __init__(self):
            self.maps = {}

        def host_register(self, addr, n, device_map=False):
            assert device_map
            self.maps[addr] = 0x7f00_0000_0000 + 0x1_0000_0000 * len(self.maps)

        def host_device_pointer(self, addr):
            return self.maps[addr]

        def host_unregister(self, addr):
            del self.maps[addr]

    dirs, o = oracle_src
    r = ContainerReader(dirs["int4"])
    c = r.config
    rt = _CapturingRuntime()
    uploads = []                                          # what the host uploads: the MoE kernels' record tables
    upload = rt.to_device

    def recording_upload(host, dtype=None):
        uploads.append(np.array(host))
        return upload(host, dtype)
    rt.to_device = rt.to_device_async = recording_upload
    gb = CudaBackend(runtime=rt)
    drv = Drv()
    mx = MappedHostExperts(drv, MemoryHostTier(r, list(c.moe_layers)), r.record_layout, c.moe_layers,
                           c.n_routed_experts, sync=rt.synchronize)
    model = GlmMoeDsaModel(c, r, gb, experts=mx)
    mapped = set(mx.slot_table(c.num_hidden_layers).ravel().tolist()) - {0}
    cache = model.new_cache(64)
    mark = len(uploads)
    tok = model.greedy(o["prompt_ids"], cache)            # the prefill: eager, the MoE on the mapped records
    tables = [set(x.ravel().tolist()) for x in uploads[mark:] if x.dtype == np.uint64]
    assert tables and all(t <= mapped for t in tables), "the prefill's MoE read records at other addresses"
    for _ in range(4):
        tok = model.greedy([tok], cache)
    g = model.step_graphs
    assert g.last_reason is None and g.replays >= 2 and g.captures == 1, g.last_reason
    mx.close()
    assert drv.maps == {}


class _Ev:
    def __init__(self, log, n):
        self.log, self.n = log, n

    def record(self, stream):
        self.log.append(("record", self.n, stream.name))


class _St:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def wait_for_event(self, ev):
        self.log.append(("wait", ev.n, self.name))


def _side_stub():
    """The attributes CudaRuntime.on_side_stream uses, with streams and events that log what is queued where."""
    from types import SimpleNamespace
    log, made = [], []

    def event():
        made.append(_Ev(log, len(made)))
        return made[-1]
    rt = SimpleNamespace(_capture_keep=[], _side=None, _unjoined=[], stream=_St(log, "main"), event=event,
                         drv=SimpleNamespace(Stream=lambda: _St(log, "side")))
    return rt, log


def test_a_side_branch_forks_after_the_queued_work_and_joins_once():
    """CudaRuntime.on_side_stream with stand-in streams: fn's launches go to the side stream after it waits for an
    event recorded on the compute stream; the compute stream is back at once; join() makes the compute stream wait
    for the side's last event, once, and gives fn's result; a join the caller never makes is made by
    _join_branches (end_capture / abort_capture: the driver refuses an unjoined fork); when fn raises, its branch is
    joined before the error goes on; the events live as long as the graph; outside a capture it refuses."""
    from coli.gpu.cuda_runtime import CudaRuntime
    rt, log = _side_stub()
    seen = []
    join = CudaRuntime.on_side_stream(rt, lambda: seen.append(rt.stream.name) or "shared")
    assert seen == ["side"] and rt.stream.name == "main"
    assert log == [("record", 0, "main"), ("wait", 0, "side"), ("record", 1, "side")]
    assert rt._unjoined == [join]
    assert join() == "shared" and join() == "shared"
    assert log[3:] == [("wait", 1, "main")] and rt._unjoined == []          # joined once
    assert len(rt._capture_keep) == 2                                       # both events kept with the graph
    side = rt._side
    del log[:]
    CudaRuntime.on_side_stream(rt, lambda: None)                            # never joined by its caller
    CudaRuntime._join_branches(rt)
    assert log[-1] == ("wait", 3, "main") and rt._unjoined == []
    del log[:]
    with pytest.raises(RuntimeError, match="boom"):
        CudaRuntime.on_side_stream(rt, lambda: (_ for _ in ()).throw(RuntimeError("boom")))
    assert log == [("record", 4, "main"), ("wait", 4, "side"), ("record", 5, "side"), ("wait", 5, "main")]
    assert rt.stream.name == "main" and rt._side is side and rt._unjoined == []   # restored, joined; one side stream
    rt._capture_keep = None
    with pytest.raises(CudaError, match="outside a CUDA graph capture"):
        CudaRuntime.on_side_stream(rt, lambda: None)


def test_graph_branches_are_on_by_default_and_a_bad_value_is_named_when_the_backend_is_made(monkeypatch):
    from coli.gpu.cuda_backend import CudaBackend
    from coli.gpu.graphs import graph_branches_enabled
    assert graph_branches_enabled({}) is True and graph_branches_enabled({"COLI_GRAPH_BRANCHES": "0"}) is False
    monkeypatch.setenv("COLI_GRAPH_BRANCHES", "yes")
    with pytest.raises(ColiError, match="COLI_GRAPH_BRANCHES='yes': use 1"):
        CudaBackend(runtime=_CapturingRuntime())


class _BranchingRuntime(_CapturingRuntime):
    """_CapturingRuntime that marks a capture's start and end, its side branches' forks and joins, and which
    launches went to the side stream."""

    def __init__(self):
        super().__init__()
        self.side = False

    def begin_capture(self):
        self.launches.append(("<capture>", None))
        super().begin_capture()

    def end_capture(self):
        self.launches.append(("</capture>", None))
        return super().end_capture()

    def record(self, name, argtypes, grid, block, args, smem):
        self.launches.append((name + ("@side" if self.side else ""), args))

    def on_side_stream(self, fn):
        assert self.capturing and not self.side
        self.launches.append(("<fork>", None))
        self.side = True
        try:
            value = fn()
        finally:
            self.side = False

        def join():
            self.launches.append(("<join>", None))
            return value
        return join


@pytest.mark.parametrize("branches,fmt", [("1", "f32"), ("1", "int4"), ("0", "int4")])
def test_a_captured_step_runs_the_shared_expert_on_a_second_branch(oracle_src, monkeypatch, branches, fmt):
    """COLI_GRAPH_BRANCHES=1: in the captured decode step each MoE layer forks before its router, runs the shared
    expert's two launches (and nothing else) on the side branch, and joins before the layer's residual add; a
    projection outside linear_many's gemv2x groups (the f32 weights_proj beside an int8 core) runs beside the group's
    launch and joins right after it; each layer's absorbed queries (mla_qabs) run beside its cache write and
    indexer and join before attention's core -- every fork joined inside the capture; the eager steps never fork.
    0: one chain, no fork. The values are tests/gpu/test_gpu_graphs.py's."""
    from coli.gpu.cuda_backend import CudaBackend
    from coli.loader import open_weights
    from coli.model.forward import GlmMoeDsaModel
    monkeypatch.setenv("COLI_GRAPHS", "1")
    monkeypatch.setenv("COLI_GRAPH_BRANCHES", branches)
    dirs, o = oracle_src
    rt = _BranchingRuntime()
    gb = CudaBackend(runtime=rt)
    w = open_weights(dirs[fmt])
    model = GlmMoeDsaModel(w.config, w, gb, experts=gb.expert_source(w))
    c = model.config
    cache = model.new_cache(64)
    tok = model.greedy(o["prompt_ids"], cache)
    for _ in range(3):
        tok = model.greedy([tok], cache)
    g = model.step_graphs
    assert g.last_reason is None and g.captures == 1 and g.replays >= 1, g.last_reason
    names = [n for n, _ in rt.launches]
    a, b = names.index("<capture>"), names.index("</capture>")
    outside = names[:a] + names[b:]
    assert "<fork>" not in outside and not any(n.endswith("@side") for n in outside), "an eager step forked"
    inside = names[a + 1:b]
    if branches == "0":
        assert "<fork>" not in inside and not any(n.endswith("@side") for n in inside)
        return
    dense = "f32" if fmt == "f32" else "int8"            # the container's dense core
    shared, projections, absorbs = 0, 0, 0
    assert inside.count("<fork>") == inside.count("<join>")
    for f in [i for i, n in enumerate(inside) if n == "<fork>"]:
        j = inside.index("<join>", f)
        side = [n for n in inside[f + 1:j] if n.endswith("@side")]
        main = [n for n in inside[f + 1:j] if not n.endswith("@side")]
        if side == [f"moe_gateup_{dense}@side", f"moe_down_{dense}@side"]:    # the shared expert, alone
            shared += 1
            assert "route_topk" in main and main[0] == "gemv2_f32"            # the router beside it
            assert inside[j + 1] == "add_rmsnorm"                             # joined before the residual add
        elif side == [f"mla_qabs_{dense}@side"]:                             # the absorbed queries, alone
            absorbs += 1
            assert main[0] == "kv_put3", main                                 # beside the cache write ...
            if "indexer_scores_dyn" in main:                                  # ... and the indexer's selection
                assert main[1:] == ["indexer_scores_dyn", "topk_select_dyn"], main
            else:
                assert main == ["kv_put3"], main
            assert inside[j + 1].startswith("mla_attend_"), inside[j + 1]     # joined before attention's core
        else:
            projections += 1
            assert side == ["gemv2_f32@side"] and main == [f"gemv2x_{dense}"], (side, main)
    assert shared == len(c.moe_layers)
    assert absorbs == len(model.layers)                                        # every layer's attention
    full = sum(1 for lw in model.layers if lw.attn.idx_wq_b is not None)       # layers with an indexer of their own
    assert full > 0 and projections == (full if fmt != "f32" else 0)   # f32: weights_proj in the group with q_a
