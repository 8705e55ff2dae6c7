"""The decode step replayed from CUDA graphs (coli/gpu/graphs.py) against the eager step it was captured from, on
tiny GLM-5 oracles built by transformers in this run with seeds no other test uses.

- f32 containers: graph tokens equal transformers' (token-exact), and the KV cache the replays wrote is bitwise the
  eager step's -- through the indexer's switch from "every key" to top-k (index_topk 8) and a cache that grows
  (a new graph per capacity);
- int4 containers: graph tokens equal the eager GPU step's and the cache bitwise;
- a forced routing (the benchmarks' trace replay) comes from the step's inputs: tokens and cache equal the eager
  step with the same routes, and a forced routing with a dropped slot runs eagerly with the routes already drawn;
- streaming experts (a VRAM cache of 3-6 slots): one graph per router segment, the MoE eager between them --
  tokens equal transformers' (f32) and the eager streaming step's (int4), caches bitwise equal;
- what cannot be a graph runs eagerly and says why (a routing hook; streaming with COLI_GRAPHS_STREAM=0).
"""

from __future__ import annotations

import numpy as np
import pytest

from gpu_helpers import build_fresh_oracles, container, greedy, report
from oracles import load_oracle

pytestmark = pytest.mark.gpu

FRESH = {
    "graph-default": (701, {}),
    "graph-topk": (801, {"prompt_len": 12, "index_topk": 8, "indexer_pattern": "FFSS"}),
}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("gpu-graphs")


@pytest.fixture(scope="module")
def oracles(root):
    return build_fresh_oracles(root, FRESH)


def eager(model):
    """The same model with every step eager (what COLI_GRAPHS=0 gives)."""
    model.step_graphs = None
    return model


def close_streaming(model):
    """Give a streaming model's host registrations back (a VramExperts dropped without close() keeps its pinned
    ranges registered, and a later host tier mapped at the same address then fails to register)."""
    vx = model.experts
    vx.close()
    vx.host.close()


def assert_same_cache(a, b):
    ha, hb = a.host_arrays(), b.host_arrays()
    assert ha.keys() == hb.keys()
    for k in ha:
        assert np.array_equal(ha[k], hb[k]), f"cache {k} differs between the replayed and the eager steps"


@pytest.mark.parametrize("name", list(FRESH))
@pytest.mark.parametrize("capacity", [256, 4])
def test_graph_tokens_match_transformers_and_the_eager_cache(root, oracles, name, capacity):
    from coli.loader import load_model
    src, seed = oracles[name]
    o = load_oracle(src)
    d = container(root, src, f"{name}-f32", experts="f32", dense="f32")
    model, _ = load_model(d, "gpu")
    assert model.step_graphs is not None, "COLI_GRAPHS defaults to on"
    n = len(o["greedy_tokens"])
    toks, cache = greedy(model, o["prompt_ids"], n, capacity=capacity)
    g = model.step_graphs
    report("graphs_f32", oracle=name, seed=seed, capacity=capacity, replays=g.replays, captures=g.captures,
           tokens_equal=toks == o["greedy_tokens"], last_reason=g.last_reason)
    assert g.replays >= n - 4, f"the decode steps were not replayed: {g.last_reason}"
    assert toks == o["greedy_tokens"]
    ref, _ = load_model(d, "gpu")
    r_toks, r_cache = greedy(eager(ref), o["prompt_ids"], n, capacity=capacity)
    assert r_toks == toks
    assert cache.capacity == r_cache.capacity and cache.length == r_cache.length
    assert_same_cache(cache, r_cache)


@pytest.mark.parametrize("attn", ["tile3", "tile2", "tile1"])
def test_graph_tokens_with_each_tile_attention(root, oracles, monkeypatch, attn):
    """COLI_ATTN_KERNELS=tile3 (auto's first choice) / tile2 / tile1 (the backend reads the setting when it is made): replayed decode steps with
    device-side T and a grid sized for the capacity, through the indexer's switch to top-k -- tokens equal
    transformers' and the cache equals the eager step's bitwise."""
    from coli.gpu import cuda_backend
    from coli.loader import load_model
    monkeypatch.setattr(cuda_backend, "ATTN_KERNELS", attn)
    src, _ = oracles["graph-topk"]
    o = load_oracle(src)
    d = container(root, src, "graph-topk-f32", experts="f32", dense="f32")
    model, _ = load_model(d, "gpu")
    assert model.backend.attn_kernels == attn
    n = len(o["greedy_tokens"])
    toks, cache = greedy(model, o["prompt_ids"], n, capacity=256)
    assert model.step_graphs.replays >= n - 4, model.step_graphs.last_reason
    assert toks == o["greedy_tokens"]
    ref, _ = load_model(d, "gpu")
    r_toks, r_cache = greedy(eager(ref), o["prompt_ids"], n, capacity=256)
    assert r_toks == toks
    assert_same_cache(cache, r_cache)


@pytest.mark.parametrize("fmt", ["f32", "int4"])
def test_graph_branches_give_the_tokens_and_cache_of_one_chain(root, oracles, monkeypatch, fmt):
    """COLI_GRAPH_BRANCHES=1: each MoE layer's shared expert on a second branch of the captured step, beside the
    router and the routed experts -- f32 tokens equal transformers', and at both formats the tokens and the cache
    equal the one-chain graph's bit for bit (the same kernels on the same inputs, only the order between the two
    branches free)."""
    from coli.loader import load_model
    src, _ = oracles["graph-topk"]
    o = load_oracle(src)
    d = container(root, src, f"graph-topk-{fmt}", experts=fmt, dense="f32" if fmt == "f32" else "int8")
    n = len(o["greedy_tokens"])
    monkeypatch.setenv("COLI_GRAPH_BRANCHES", "1")
    model, _ = load_model(d, "gpu")
    rt = model.backend.rt
    forks = []
    fork = rt.on_side_stream
    monkeypatch.setattr(rt, "on_side_stream", lambda fn: forks.append(1) or fork(fn))
    toks, cache = greedy(model, o["prompt_ids"], n, capacity=256)
    assert model.step_graphs.replays >= n - 4, model.step_graphs.last_reason
    assert len(forks) >= len(model.config.moe_layers), "the captured step did not branch"
    if fmt == "f32":
        assert toks == o["greedy_tokens"]
    monkeypatch.setenv("COLI_GRAPH_BRANCHES", "0")
    ref, _ = load_model(d, "gpu")
    r_toks, r_cache = greedy(ref, o["prompt_ids"], n, capacity=256)
    assert r_toks == toks
    assert_same_cache(cache, r_cache)


@pytest.mark.parametrize("group,dense", [(64, "int8"), (32, "int4")])
def test_int4_graph_equals_eager_and_numpy(root, oracles, group, dense):
    from coli.loader import load_model
    src, _ = oracles["graph-topk"]
    o = load_oracle(src)
    d = container(root, src, f"topk-int4-g{group}-{dense}", experts="int4", dense=dense, group=group)
    steps = 24
    gpu, _ = load_model(d, "gpu")
    g_toks, g_cache = greedy(gpu, o["prompt_ids"], steps)
    assert gpu.step_graphs.replays >= steps - 4, gpu.step_graphs.last_reason
    ref, _ = load_model(d, "gpu")
    e_toks, e_cache = greedy(eager(ref), o["prompt_ids"], steps)
    assert g_toks == e_toks
    assert_same_cache(g_cache, e_cache)
    cpu, _ = load_model(d, "cpu")
    c_toks, _ = greedy(cpu, o["prompt_ids"], steps)
    report("graphs_int4", group=group, dense=dense, equal_numpy=g_toks == c_toks)
    # the eager GPU step's agreement with numpy is test_gpu_e2e's (near-ties allowed there); here graph == eager
    # exactly, so the graph inherits it; still, a divergence from numpy is reported above


class SeededRoutes:
    """A route override drawing K distinct experts and weights per (call, layer) from a seed: two models given
    two instances with the same seed see the same routes. drop="one" puts a -1 (a dropped slot) on the 6th call's
    first MoE layer; drop="all" drops every slot (the benchmarks' no-expert decode)."""

    def __init__(self, cfg, seed, drop=None):
        self.cfg, self.rng, self.drop = cfg, np.random.default_rng(seed), drop
        self.calls = 0
        self.first = cfg.moe_layers[0]

    def __call__(self, layer, n_rows):
        c = self.cfg
        if layer == self.first:
            self.calls += 1
        idx = np.stack([self.rng.permutation(c.n_routed_experts)[:c.num_experts_per_tok] for _ in range(n_rows)])
        w = self.rng.uniform(0.1, 1.0, idx.shape).astype(np.float32)
        if self.drop == "one" and self.calls == 6 and layer == self.first:
            idx[:, -1], w[:, -1] = -1, 0.0
        if self.drop == "all":
            idx[:], w[:] = -1, 0.0
        return idx.astype(np.int64), w


@pytest.mark.parametrize("drop", [None, "one", "all"])
def test_forced_routing_from_the_step_inputs(root, oracles, drop):
    from coli.loader import load_model
    src, _ = oracles["graph-default"]
    o = load_oracle(src)
    d = container(root, src, "default-f32", experts="f32", dense="f32")
    model, cfg = load_model(d, "gpu")
    ref, _ = load_model(d, "gpu")
    eager(ref)
    model.route_override = SeededRoutes(cfg, 5, drop)
    ref.route_override = SeededRoutes(cfg, 5, drop)
    toks, cache = greedy(model, o["prompt_ids"], 16)
    r_toks, r_cache = greedy(ref, o["prompt_ids"], 16)
    g = model.step_graphs
    report("graphs_forced", drop=drop, replays=g.replays, last_reason=g.last_reason)
    assert g.replays >= (9 if drop == "one" else 10), g.last_reason
    assert toks == r_toks
    assert_same_cache(cache, r_cache)


def test_what_cannot_be_a_graph_runs_eagerly_and_says_why(root, oracles):
    from coli.loader import GpuOptions, load_model
    src, _ = oracles["graph-default"]
    o = load_oracle(src)
    d = container(root, src, "default-f32", experts="f32", dense="f32")
    model, _ = load_model(d, "gpu")
    seen = []
    model.routing_hook = lambda layer, idx, w: seen.append(layer)
    toks, _ = greedy(model, o["prompt_ids"], 6)
    assert model.step_graphs.replays == 0 and "routing hook" in model.step_graphs.last_reason
    assert toks == o["greedy_tokens"][:6] and seen
    streaming, _ = load_model(d, "gpu", gpu=GpuOptions(vram_slots=3))
    streaming.step_graphs.segmented = False                  # COLI_GRAPHS_STREAM=0
    try:
        toks, _ = greedy(streaming, o["prompt_ids"], 6)
    finally:
        close_streaming(streaming)
    g = streaming.step_graphs
    assert g.replays == 0 and g.segment_steps == 0 and "stream" in g.last_reason
    assert toks == o["greedy_tokens"][:6]


@pytest.mark.parametrize("name,slots", [("graph-default", 3), ("graph-topk", 6)])
def test_streaming_steps_as_graph_segments(root, oracles, name, slots):
    """Experts through a VRAM cache of a few slots (constant eviction): each step is one graph per router segment
    with the MoE eager between them; tokens equal transformers' and the cache the eager streaming step's."""
    from coli.loader import GpuOptions, load_model
    src, _ = oracles[name]
    o = load_oracle(src)
    d = container(root, src, f"{name}-f32", experts="f32", dense="f32")
    n = len(o["greedy_tokens"])
    model, _ = load_model(d, "gpu", gpu=GpuOptions(vram_slots=slots))
    try:
        toks, cache = greedy(model, o["prompt_ids"], n)
        vx = model.experts.snapshot()
    finally:
        close_streaming(model)
    g = model.step_graphs
    report("graphs_segments", oracle=name, slots=slots, segment_steps=g.segment_steps, captures=g.captures,
           tokens_equal=toks == o["greedy_tokens"], last_reason=g.last_reason, misses=vx.get("misses"))
    assert g.segment_steps >= n - 4, g.last_reason
    assert toks == o["greedy_tokens"]
    ref, _ = load_model(d, "gpu", gpu=GpuOptions(vram_slots=slots))
    try:
        r_toks, r_cache = greedy(eager(ref), o["prompt_ids"], n)
    finally:
        close_streaming(ref)
    assert r_toks == toks
    assert_same_cache(cache, r_cache)


def test_int4_streaming_segments_equal_eager(root, oracles):
    from coli.loader import GpuOptions, load_model
    src, _ = oracles["graph-topk"]
    o = load_oracle(src)
    d = container(root, src, "topk-int4-g64-int8", experts="int4", dense="int8", group=64)
    model, _ = load_model(d, "gpu", gpu=GpuOptions(vram_slots=6))
    try:
        toks, cache = greedy(model, o["prompt_ids"], 24)
    finally:
        close_streaming(model)
    assert model.step_graphs.segment_steps >= 20, model.step_graphs.last_reason
    ref, _ = load_model(d, "gpu", gpu=GpuOptions(vram_slots=6))
    try:
        r_toks, r_cache = greedy(eager(ref), o["prompt_ids"], 24)
    finally:
        close_streaming(ref)
    assert toks == r_toks
    assert_same_cache(cache, r_cache)


def test_greedy_generation_replays_its_decode_steps(root, oracles):
    """`coli run`, the executor stage and the gateway decode through Generation: greedy takes the backend's argmax,
    so its steps are replayed too, with transformers' tokens."""
    from coli.generate import Generation
    from coli.loader import load_model
    src, _ = oracles["graph-topk"]
    o = load_oracle(src)
    d = container(root, src, "graph-topk-f32", experts="f32", dense="f32")
    model, _ = load_model(d, "gpu")
    n = len(o["greedy_tokens"])
    toks = list(Generation(model, o["prompt_ids"], n, ignore_eos=True))
    assert toks == o["greedy_tokens"]
    assert model.step_graphs.replays >= n - 4, model.step_graphs.last_reason
