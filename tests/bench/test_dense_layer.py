"""coli.bench.dense_layer, the dense decode layer scripts/bench_kernels.py replays as a CUDA graph: its random weight
source stores what `coli convert` stores, and its layer body is the forward's (on the numpy backend: embed, the body
for every layer and the head give GlmMoeDsaModel's logits bit for bit)."""

from __future__ import annotations

import numpy as np
import pytest

from coli.bench.dense_layer import RandomDense, dense_config, layer_body, layer_steady
from coli.config import PRESETS
from coli.model.backend import cos_sin_table
from coli.model.forward import GlmMoeDsaModel
from coli.model.numpy_backend import NumpyBackend


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_random_dense_stores_the_formats_convert_stores(fmt):
    cfg = dense_config(PRESETS["glm5"], layers=1)
    src = RandomDense(cfg, fmt)
    a = "model.layers.0.self_attn."
    for name, want in ((a + "q_a_proj.weight", fmt), (a + "o_proj.weight", fmt), (a + "indexer.wk.weight", fmt),
                       ("model.layers.0.mlp.shared_experts.up_proj.weight", fmt),
                       ("model.layers.0.mlp.gate.weight", "f32"), (a + "indexer.weights_proj.weight", "f32"),
                       (a + "q_a_layernorm.weight", "f32")):
        assert src.dense_layout(name).fmt == want, name
    lay = src.dense_layout(a + "kv_a_proj_with_mqa.weight")
    assert (lay.rows, lay.cols) == (576, 6144) and src.dense_raw(a + "kv_a_proj_with_mqa.weight").nbytes == lay.nbytes
    w = src.dense(a + "kv_a_proj_with_mqa.weight")
    assert w.shape == (576, 6144) and 0.015 < float(w.std()) < 0.025
    assert (src.dense(a + "kv_a_layernorm.weight") == 1).all()


def test_layer_body_is_the_forwards_loop_body():
    cfg = dense_config(PRESETS["tiny"], layers=2, vocab=64)
    b = NumpyBackend()
    model = GlmMoeDsaModel(cfg, RandomDense(cfg, "int8", group=32), b)
    ids = np.array([3, 17, 5, 60])
    want = model.forward(ids, model.new_cache(16), all_logits=True)          # [S, V]
    cache = model.new_cache(16)
    S = len(ids)
    pos = np.arange(S)
    cos, sin = cos_sin_table(pos, cfg.qk_rope_head_dim, cfg.rope_theta)
    cache.reserve(S)
    h, allowed = b.embed(model.embed, ids), None
    for i in range(cfg.num_hidden_layers):
        h, allowed = layer_body(model, i, h, pos, cos, sin, cache, 0, allowed)
    got = b.linear(b.rms_norm(h, model.final_norm, cfg.rms_norm_eps), model.lm_head)
    np.testing.assert_array_equal(got, want)
    assert np.isfinite(got).all() and float(np.abs(got).max()) > 0
    # layer_steady (what scripts/bench_kernels.py captures: each layer ends in the next input norm) is the same layer
    cache = model.new_cache(16)
    cache.reserve(S)
    h, allowed = b.embed(model.embed, ids), None
    x = b.rms_norm(h, model.layers[0].input_norm, cfg.rms_norm_eps)
    for i in range(cfg.num_hidden_layers):
        h, x, allowed = layer_steady(model, i, h, x, pos, cos, sin, cache, 0, allowed)
    np.testing.assert_array_equal(b.rms_norm(h, model.layers[0].input_norm, cfg.rms_norm_eps), x)
    np.testing.assert_array_equal(b.linear(b.rms_norm(h, model.final_norm, cfg.rms_norm_eps), model.lm_head), want)
