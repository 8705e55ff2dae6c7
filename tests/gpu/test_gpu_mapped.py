"""The zero-copy expert source (coli/gpu/mapped_experts.py): every routed expert stays in pinned host RAM
(MemoryHostTier) and the MoE kernels read it over PCIe through its device-mapped address. On tiny GLM-5 oracles built
by transformers in this run (seeds no other test uses):

- f32 container: tokens equal transformers' -- replayed from CUDA graphs (the warm path's slot table, pointing at host
  RAM) and eager alike;
- int4 container: tokens and the KV cache equal the resident experts' bitwise (the same kernels, the same bytes at
  other addresses), replayed and eager;
- the records really are read from host RAM: zeroing one expert's host bytes changes what the layer computes.
"""

from __future__ import annotations

import numpy as np
import pytest

from gpu_helpers import build_fresh_oracles, container, greedy, report
from oracles import load_oracle

pytestmark = pytest.mark.gpu

FRESH = {"mapped": (1201, {"prompt_len": 10, "index_topk": 8, "indexer_pattern": "FFSS"})}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("gpu-mapped")


@pytest.fixture(scope="module")
def oracles(root):
    return build_fresh_oracles(root, FRESH)


def _mapped(model, d):
    """model's experts replaced by the mapped source over a MemoryHostTier of the container at d: (source, tier)."""
    from coli.container.reader import ContainerReader
    from coli.gpu.driver import get_driver
    from coli.gpu.host_records import MemoryHostTier
    from coli.gpu.mapped_experts import MappedHostExperts
    reader = ContainerReader(d)
    c = reader.config
    tier = MemoryHostTier(reader, list(c.moe_layers))
    mx = MappedHostExperts(get_driver(), tier, reader.record_layout, c.moe_layers, c.n_routed_experts,
                           sync=model.backend.rt.synchronize)
    model.experts = mx
    return mx, tier


def _same_cache(a, b):
    ha, hb = a.host_arrays(), b.host_arrays()
    assert ha.keys() == hb.keys()
    for k in ha:
        assert np.array_equal(ha[k], hb[k]), f"cache {k} differs"


@pytest.mark.parametrize("graphs", [True, False])
def test_f32_tokens_equal_transformers(root, oracles, graphs):
    from coli.loader import load_model
    src, seed = oracles["mapped"]
    o = load_oracle(src)
    d = container(root, src, "mapped-f32", experts="f32", dense="f32")
    model, _ = load_model(d, "gpu")
    if not graphs:
        model.step_graphs = None
    mx, _ = _mapped(model, d)
    try:
        n = len(o["greedy_tokens"])
        toks, _ = greedy(model, o["prompt_ids"], n)
        g = model.step_graphs
        report("mapped_f32", seed=seed, graphs=graphs, replays=None if g is None else g.replays,
               tokens_equal=toks == o["greedy_tokens"])
        if graphs:
            assert g.replays >= n - 4, f"the decode steps were not replayed: {g.last_reason}"
        assert toks == o["greedy_tokens"]
    finally:
        mx.close()


@pytest.mark.parametrize("graphs", [True, False])
def test_int4_tokens_and_cache_equal_the_resident_experts(root, oracles, graphs):
    from coli.loader import load_model
    src, _ = oracles["mapped"]
    o = load_oracle(src)
    d = container(root, src, "mapped-int4", experts="int4", dense="int8", group=64)
    steps = 20
    ref, _ = load_model(d, "gpu")
    got, _ = load_model(d, "gpu")
    if not graphs:
        ref.step_graphs = got.step_graphs = None
    r_toks, r_cache = greedy(ref, o["prompt_ids"], steps)
    mx, _ = _mapped(got, d)
    try:
        toks, cache = greedy(got, o["prompt_ids"], steps)
        if graphs:
            assert got.step_graphs.replays >= steps - 4, got.step_graphs.last_reason
        assert toks == r_toks
        _same_cache(cache, r_cache)
    finally:
        mx.close()


def test_the_records_are_read_from_host_ram(root, oracles):
    """Zero every host record of the first MoE layer: the same prompt then gives another KV cache past that layer
    (its MoE output feeds the next layer's attention), so the kernels read the host bytes, not a VRAM copy."""
    from coli.loader import load_model
    src, _ = oracles["mapped"]
    o = load_oracle(src)
    d = container(root, src, "mapped-int4", experts="int4", dense="int8", group=64)
    model, _ = load_model(d, "gpu")
    mx, tier = _mapped(model, d)
    try:
        _, before = greedy(model, o["prompt_ids"], 2)
        first = model.config.moe_layers[0]
        for e in range(model.config.n_routed_experts):
            tier.probe(first, e).array[:] = 0
        _, after = greedy(model, o["prompt_ids"], 2)
        hb, ha = before.host_arrays(), after.host_arrays()
        assert any(not np.array_equal(hb[k], ha[k]) for k in hb), "zeroed host records changed nothing"
    finally:
        mx.close()
