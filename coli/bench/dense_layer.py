"""One decode layer's dense part at a model's real shapes, over random stored weights: attention (MLA projections,
rope, the compressed KV write, the indexer and its top-k, `mla_attend`), the router with its top-k, the shared expert
and the residual adds -- everything of a MoE layer but the routed experts (timed on their own by
scripts/bench_kernels.py's MoE rows). scripts/bench_kernels.py captures it as a CUDA graph and times the replay.

    src = RandomDense(config, "int8")                 # a WeightSource: `coli bench make-slice`'s random rows
    model = GlmMoeDsaModel(config, src, backend)
    h, allowed = layer_body(model, i, h, positions, cos, sin, cache, start)    # the forward's layer i
    h, x, allowed = layer_steady(model, i, h, x, positions, cos, sin, cache, start)   # as in the model's middle

`layer_body` and `layer_steady` are GlmMoeDsaModel's layer (`_layer`; tests/bench/test_dense_layer.py checks that embed
+ either over every layer + the head gives the forward's logits exactly, so they cannot drift apart).
Importing this module needs no GPU.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from coli.config import ModelConfig
from coli.container.format import MatrixLayout
from coli.container.quant import decode_matrix
from coli.model.tensors import dense_shapes, keep_full_precision


class RandomDense:
    """A weight source of random stored dense tensors (`coli bench make-slice`'s rows: std ~0.02, norm weights 1,
    biases 0) in format `fmt`; norms, routers, biases and the indexer's weights_proj f32, as `coli convert` keeps
    them. The CUDA backend uploads the stored tiles (dense_layout / dense_raw); the numpy one their float32 values."""

    def __init__(self, config: ModelConfig, fmt: str, group: int = 64, tile_kb: int = 512, seed: int = 0):
        self.config, self.fmt, self.group, self.tile_kb, self.seed = config, fmt, group, tile_kb, seed
        self.shapes = dense_shapes(config)
        self._raw: dict[str, np.ndarray] = {}

    def dense_layout(self, name: str) -> MatrixLayout:
        shape = self.shapes[name]
        rows, cols = (1, shape[0]) if len(shape) == 1 else shape
        fmt = "f32" if len(shape) == 1 or keep_full_precision(name) else self.fmt
        return MatrixLayout.make(rows, cols, fmt, self.group, self.tile_kb)

    def dense_raw(self, name: str) -> np.ndarray:
        if name not in self._raw:
            from coli.bench.slice import dense_piece
            lay = self.dense_layout(name)
            self._raw[name] = dense_piece(self.seed, name, self.shapes[name], lay, 0, lay.rows, 0)
        return self._raw[name]

    def dense(self, name: str) -> np.ndarray:
        w = np.array(decode_matrix(self.dense_raw(name), self.dense_layout(name)), np.float32)
        return w.reshape(self.shapes[name])

    def experts(self, layer: int, ids: list[int]) -> dict[int, Any]:
        """Random float32 routed experts (std 0.02), for a forward on the CPU; the GPU benchmark drops them."""
        from coli.weights import ExpertWeights
        c = self.config
        H, Im = c.hidden_size, c.moe_intermediate_size
        out = {}
        for e in ids:
            rng = np.random.default_rng([self.seed, 1, layer, e])
            g, u, d = (rng.standard_normal(s).astype(np.float32) * np.float32(0.02) for s in ((Im, H), (Im, H), (H, Im)))
            out[e] = ExpertWeights(g, u, d)
        return out


def dense_config(base: ModelConfig, layers: int = 1, vocab: int = 256) -> ModelConfig:
    """`base`'s dimensions with `layers` MoE layers, each with a full indexer, and a small vocabulary (the head is not
    part of a layer)."""
    return dataclasses.replace(base, num_hidden_layers=layers, mlp_layer_types=("sparse",) * layers,
                               indexer_types=("full",) * layers, vocab_size=vocab,
                               eos_token_ids=tuple(e for e in base.eos_token_ids if e < vocab))


def layer_body(model: Any, i: int, h: Any, positions: np.ndarray, cos: np.ndarray, sin: np.ndarray, cache: Any,
               start: int, allowed: Any = None) -> tuple[Any, Any]:
    """Decoder layer i of model's forward on the hidden state h [S, H] -> (new h, the indexer's selection), exactly
    GlmMoeDsaModel's layer (`_layer`) with its input norm in front and a plain residual add at its end."""
    c, b = model.config, model.backend
    x = b.rms_norm(h, model.layers[i].input_norm, c.rms_norm_eps)                                # [S, H]
    h, _, allowed = model._layer(i, model.layers[i], h, x, positions, cos, sin, cache, start, allowed, None)
    return h, allowed


def layer_steady(model: Any, i: int, h: Any, x: Any, positions: np.ndarray, cos: np.ndarray, sin: np.ndarray,
                 cache: Any, start: int, allowed: Any = None) -> tuple[Any, Any, Any]:
    """Decoder layer i as the forward runs a layer in the middle of the model: from h [S, H] and its normed input x,
    to (new h, the next layer's normed input, the indexer's selection) -- the residual add and the next input norm one
    op (add_rms_norm). After the last layer the next is layer 0 (a benchmark's layers in a loop: every one has the
    nodes of a middle layer)."""
    nxt = model.layers[(i + 1) % len(model.layers)].input_norm
    return model._layer(i, model.layers[i], h, x, positions, cos, sin, cache, start, allowed, nxt)
