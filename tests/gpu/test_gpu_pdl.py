"""Programmatic dependent launch in the replayed graphs (COLI_PDL, coli/gpu/pdl.py) on tiny GLM-5 oracles built by
transformers in this run (seeds no other test uses):

- a replayed decode step with programmatic kernel->kernel edges gives bit-identical tokens, final-normed hidden
  states (the lm_head's input: its logits) and KV cache to the same replays with ordinary edges, through the
  indexer's switch to top-k, on an f32 container (tokens also equal transformers'), and edges were converted;
- streaming experts (graph segments, the MoE eager between them): the same with a VRAM cache of 3 slots;
- a driver without the edge calls, or a device below sm_90: one warning, the graphs as captured, the same tokens;
- scripts/bench_kernels.py's dense-layer rows: both captures replay to the eager step's bits, edges converted.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import numpy as np
import pytest

from gpu_helpers import build_fresh_oracles, container, greedy, report
from oracles import load_oracle

pytestmark = pytest.mark.gpu

FRESH = {"pdl-topk": (1307, {"prompt_len": 12, "index_topk": 8, "indexer_pattern": "FFSS"})}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("gpu-pdl")


@pytest.fixture(scope="module")
def oracles(root):
    return build_fresh_oracles(root, FRESH)


@pytest.fixture
def rt():
    """The process's CUDA runtime with its COLI_PDL switch restored after the test."""
    from coli.gpu.cuda_runtime import get_runtime
    r = get_runtime()
    saved = r.pdl
    yield r
    r.pdl = saved


def decode(d, o, n, rt, pdl: bool, **gpu):
    """n greedy tokens after the oracle's prompt with rt.pdl = pdl for every capture -> (tokens, final-normed hidden
    state of each decode step [n - 1, H], cache, the model's step graphs)."""
    from coli.loader import GpuOptions, load_model
    rt.pdl = pdl
    model, _ = load_model(d, "gpu", gpu=GpuOptions(**gpu)) if gpu else load_model(d, "gpu")
    try:
        cache = model.new_cache(256)
        toks, hs = [model.greedy(o["prompt_ids"], cache)], []
        while len(toks) < n:
            if gpu:                                       # streaming: segments give no hidden state
                toks.append(model.greedy([toks[-1]], cache))
                continue
            t, h = model.greedy_hidden([toks[-1]], cache)
            toks.append(t)
            hs.append(model.backend.to_host(h))
    finally:
        if gpu:
            model.experts.close()
            model.experts.host.close()
    return toks, (np.concatenate(hs) if hs else None), cache, model.step_graphs


def assert_same_cache(a, b):
    ha, hb = a.host_arrays(), b.host_arrays()
    assert ha.keys() == hb.keys()
    for k in ha:
        assert np.array_equal(ha[k], hb[k]), f"cache {k} differs between programmatic and ordinary edges"


def test_programmatic_edges_replay_the_same_bits(root, oracles, rt):
    src, seed = oracles["pdl-topk"]
    o = load_oracle(src)
    d = container(root, src, "pdl-topk-f32", experts="f32", dense="f32")
    n = len(o["greedy_tokens"])
    toks0, h0, cache0, g0 = decode(d, o, n, rt, False)
    toks1, h1, cache1, g1 = decode(d, o, n, rt, True)
    edges0 = [g.pdl_edges for g in g0.graphs.values()]
    edges1 = [g.pdl_edges for g in g1.graphs.values()]
    nodes = [g.nodes for g in g1.graphs.values()]
    all_edges = [g.edges for g in g1.graphs.values()]
    report("pdl_graphs", seed=seed, replays=g1.replays, captures=g1.captures, pdl_edges=edges1, nodes=nodes,
           edges=all_edges, tokens_equal=toks1 == toks0, hidden_equal=bool(np.array_equal(h0, h1)))
    assert g0.replays >= n - 4 and g1.replays >= n - 4, (g0.last_reason, g1.last_reason)
    assert toks0 == o["greedy_tokens"] and toks1 == toks0
    assert np.array_equal(h1, h0), "the final hidden states differ with programmatic edges"
    assert_same_cache(cache1, cache0)
    assert edges0 and not any(edges0), "COLI_PDL=0 converted edges"
    if tuple(rt.cc) >= (9, 0):
        # a captured step is mostly kernels: most of its edges are kernel -> kernel (with the graph branches, on by
        # default, a step has more edges than a chain of its nodes: each fork adds one)
        assert all(ne is not None and ne / 2 < e <= ne for e, ne in zip(edges1, all_edges)), (edges1, all_edges, nodes)
    else:
        assert not any(edges1)


def test_streaming_segments_with_programmatic_edges(root, oracles, rt):
    src, _ = oracles["pdl-topk"]
    o = load_oracle(src)
    d = container(root, src, "pdl-topk-f32", experts="f32", dense="f32")
    n = len(o["greedy_tokens"])
    toks0, _, cache0, g0 = decode(d, o, n, rt, False, vram_slots=3)
    toks1, _, cache1, g1 = decode(d, o, n, rt, True, vram_slots=3)
    assert g1.segment_steps >= n - 4, g1.last_reason
    assert toks0 == o["greedy_tokens"] and toks1 == toks0
    assert_same_cache(cache1, cache0)
    edges = [g.pdl_edges for t in g1.tapes.values() for g in t.graphs]
    report("pdl_segments", pdl_edges=edges)
    if tuple(rt.cc) >= (9, 0):
        assert sum(edges) > 0


@pytest.mark.parametrize("why", ["old driver", "old device"])
def test_pdl_that_cannot_be_had_keeps_the_graph_as_captured(root, oracles, rt, monkeypatch, caplog, why):
    """What a user gets with COLI_PDL=1 on a driver older than CUDA 12.3 (the edge calls absent) or a card below
    sm_90: one warning, every graph with its ordinary edges, the same tokens."""
    from coli.gpu import pdl
    from coli.gpu.driver import get_driver
    src, _ = oracles["pdl-topk"]
    o = load_oracle(src)
    d = container(root, src, "pdl-topk-f32", experts="f32", dense="f32")
    monkeypatch.setattr(pdl, "_warned", set())
    if why == "old driver":
        monkeypatch.setattr(get_driver(), "missing", {"cuGraphGetEdges_v2", "cuGraphAddDependencies_v2"})
    else:
        monkeypatch.setattr(rt, "cc", (8, 9))
    n = 10
    with caplog.at_level(logging.WARNING, logger="coli.cuda"):
        toks, _, _, g = decode(d, o, n, rt, True)
    warnings = [r.getMessage() for r in caplog.records if "COLI_PDL=1" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert ("cuGraphGetEdges_v2" if why == "old driver" else "sm_89") in warnings[0]
    assert g.captures >= 1 and not any(gr.pdl_edges for gr in g.graphs.values())
    assert toks == o["greedy_tokens"][:n]


def test_bench_dense_layer_rows_measure_both(rt):
    """The benchmark's dense-layer rows (one GLM-5 dense layer, int8 core, a short cache): both captures replay to
    the eager step's bits and the programmatic one has its edges converted."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    import bench_kernels
    from coli.gpu.cuda_backend import CudaBackend
    gb = CudaBackend()
    tm = bench_kernels.Timer(gb.rt, spin=True)
    out = bench_kernels.dense_layer_bench(gb, tm, "int8", 64, 2, versions=("v3",), layers=1)
    v = out["v3"]
    report("pdl_bench_dense_layer", **{k: v[k] for k in ("us_per_layer", "graph_nodes", "pdl")})
    assert v["replay_equals_eager"] and v["pdl"]["replay_equals_eager"]
    if tuple(gb.rt.cc) >= (9, 0):
        assert 0 < v["pdl"]["edges"] < v["graph_nodes"]
