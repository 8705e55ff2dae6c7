"""The slice's routing: GlmMoeDsaModel.route_override (the router still runs; the experts asked for are exactly
the override's), TraceRouting replaying a slice's stored trace (consecutive tokens per call, wrap-around), and
recorded trace files mapped onto a slice's layers."""

from __future__ import annotations

import numpy as np
import pytest

from coli.bench.trace_router import (TRACE_NAME, SliceTraceError, TraceRouting, build_slice_trace,
                                     source_layer_map)
from coli.container.reader import ContainerReader
from coli.errors import ColiError
from coli.model.forward import GlmMoeDsaModel
from coli.model.numpy_backend import NumpyBackend
from coli.trace import read_trace, write_trace
from slice_helpers import AskedExperts, write_tiny
from tolerances import U16, assert_within


class CountingBackend(NumpyBackend):
    def __init__(self):
        self.routes = 0

    def route(self, *a, **kw):
        self.routes += 1
        return super().route(*a, **kw)


@pytest.fixture()
def model3(tiny_slice3):
    r = ContainerReader(tiny_slice3)
    be, src = CountingBackend(), AskedExperts(r)
    yield GlmMoeDsaModel(r.config, r, be, experts=src), be, src
    r.close()


def test_override_replaces_the_routing_and_the_router_still_runs(model3):
    model, be, src = model3
    c = model.config
    rng = np.random.default_rng(0)
    forced = {}

    def override(layer, n_rows):
        idx = np.stack([rng.choice(c.n_routed_experts, c.num_experts_per_tok, replace=False) for _ in range(n_rows)])
        forced[layer] = idx
        return idx.astype(np.int64), np.full(idx.shape, 0.5, np.float32)

    seen = {}
    model.route_override = override
    model.routing_hook = lambda layer, idx, w: seen.__setitem__(layer, idx)
    model.forward([1, 2, 3, 4, 5], model.new_cache())
    assert be.routes == len(c.moe_layers) == 3                          # the router's cost is still paid
    assert [layer for layer, _ in src.asked] == c.moe_layers
    for layer, ids in src.asked:
        assert ids == sorted(set(forced[layer].ravel().tolist()))       # exactly the override's experts
        np.testing.assert_array_equal(seen[layer], forced[layer])      # hooks see the routing that was used


def test_override_returning_none_keeps_the_router(model3):
    model, _, src = model3
    cache = model.new_cache()
    ref = model.forward([5, 6, 7], cache, all_logits=True)
    asked_ref = list(src.asked)
    src.asked.clear()
    calls = []
    model.route_override = lambda layer, n: calls.append((layer, n))   # returns None
    np.testing.assert_array_equal(model.forward([5, 6, 7], model.new_cache(), all_logits=True), ref)
    assert src.asked == asked_ref and calls == [(0, 3), (1, 3), (2, 3)]


def test_trace_routing_replays_the_stored_trace_token_by_token_with_wraparound(model3, tiny_slice3):
    model, _, src = model3
    tr = read_trace(tiny_slice3 / TRACE_NAME)
    T = tr.n_tokens
    assert T == 40
    routing = TraceRouting(tiny_slice3).install(model)
    assert model.route_override is routing
    cache = model.new_cache(capacity=64)
    steps = [list(range(1, 31))] + [[7]] * 14                         # a 30-token prefill, then 14 decode steps
    t = 0
    for ids in steps:
        src.asked.clear()
        model.forward(ids, cache)
        rows = (t + np.arange(len(ids))) % T                          # consecutive tokens, wrapping at 40
        for layer, asked in src.asked:
            want = tr.idx[rows, layer]
            assert asked == sorted(set(want.ravel().tolist())), (t, layer)
        t += len(ids)
    assert routing.tokens_used == 44 and routing.cursor == 4
    idx, w = routing(0, 2)                                            # the override's own output
    np.testing.assert_array_equal(idx, tr.idx[[4, 5], 0])
    np.testing.assert_array_equal(w, tr.weights[[4, 5], 0])
    assert idx.dtype == np.int64 and w.dtype == np.float32 and idx.shape == (2, model.config.num_experts_per_tok)
    routing.reset(38)
    assert routing(0, 3)[0].tolist() == tr.idx[[38, 39, 0], 0].tolist()


def test_trace_routing_refuses_a_trace_that_does_not_fit(tmp_path, model3, tiny_slice):
    model, _, _ = model3
    with pytest.raises(ColiError, match="no routing for MoE layer"):
        TraceRouting(tiny_slice).install(model)                       # 1-layer trace, 3-layer model
    with pytest.raises(ColiError, match="no routing trace here"):
        TraceRouting(tmp_path)
    f = tmp_path / "k2.trace"
    write_trace(f, np.zeros((3, 3, 2), np.int32) + [[[0, 1]]], n_experts=16)
    with pytest.raises(ColiError, match="routes top-2, the model top-4"):
        TraceRouting(f).install(model)


def test_source_layer_map():
    assert source_layer_map(75, 2) == [0, 37]
    assert source_layer_map(75, 1) == [0]
    assert source_layer_map(3, 3) == [0, 1, 2]
    assert source_layer_map(3, 5) == [0, 1, 2, 0, 1]
    m = source_layer_map(75, 10)
    assert m == sorted(set(m)) and len(m) == 10


def test_recorded_trace_file_is_mapped_onto_the_slice_layers(tmp_path):
    rng = np.random.default_rng(1)
    idx = np.stack([[rng.choice(16, 4, replace=False) for _ in range(5)] for _ in range(12)]).astype(np.int32)
    w = rng.random(idx.shape).astype(np.float32)
    f = tmp_path / "run.trace"
    write_trace(f, idx, w, n_experts=16, moe_layers=[1, 2, 3, 4, 5], meta={"model": "demo"})
    got_i, got_w, meta = build_slice_trace(str(f), 2, 16, 4, None, 0)
    np.testing.assert_array_equal(got_i, idx[:, [0, 2]])
    assert_within(got_w, w[:, [0, 2]], U16 * np.abs(w[:, [0, 2]]) + 2.0 ** -25, "mapped trace weights")   # float16
    assert meta["source_layers"] == [0, 2] and meta["source_moe_layers"] == [1, 2, 3, 4, 5]
    assert meta["trace"] == "recorded" and meta["tokens"] == 12 and meta["source_meta"] == {"model": "demo"}
    assert build_slice_trace(str(f), 7, 16, 4, 5, 0)[0].shape == (5, 7, 4)
    d = write_tiny(tmp_path / "s", layers=2, trace=str(f))
    np.testing.assert_array_equal(read_trace(d / TRACE_NAME).idx, idx[:, [0, 2]])
    with pytest.raises(SliceTraceError, match="routes top-4, the slice routes top-8"):
        build_slice_trace(str(f), 2, 256, 8, None, 0)
    with pytest.raises(SliceTraceError, match=r"uses expert ids up to 15, the slice has 8 experts .*--experts"):
        build_slice_trace(str(f), 2, 8, 4, None, 0)
    (tmp_path / "junk.trace").write_bytes(b"not a trace")
    with pytest.raises(SliceTraceError, match="junk.trace.*cannot read it as a routing trace"):
        build_slice_trace(str(tmp_path / "junk.trace"), 2, 16, 4, None, 0)
