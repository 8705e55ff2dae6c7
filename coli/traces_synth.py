"""Synthetic routing traces for cache and scheduler studies when no real GLM-5 trace is at hand.

    idx, weights = glm52(tokens=1000, layers=75, seed=0)     # idx [T, L, K] int32, weights [T, L, K] f32

`uniform`: every token picks K distinct experts uniformly at random in every layer (no popularity, no
locality): the floor any cache policy is measured against.

`glm52`: calibrated to the published GLM-5.x routing statistics (per layer, 256 experts, top-8):
about 237 of 256 experts used within any 75 consecutive tokens, the 4 most used experts taking ~4 %
of a layer's selections, and consecutive tokens sharing few experts (fewer than the 0.25 of uniform
routing). The model, per layer and token:

    affinity[e] = skew * pop[e] - refractory * recent[e] + Gumbel noise      (pop ~ Exp(1), per layer)
    chosen      = the top_k affinities
    recent      = memory * recent + onehot(chosen)

A fixed right-skewed popularity makes a few experts hot without starving the rest; the refractory
term (a decayed count of recent uses; the load-balancing pressure of the router's correction bias)
spreads a layer's choices over many experts within tens of tokens. A negative `refractory` gives
sticky, local routing instead, for what-if studies. Routing weights are exp(affinity / weight_temp)
normalised over the chosen experts and multiplied by `scaling` (GLM-5's routed_scaling_factor) -- their
shape is a plausible stand-in, not calibrated to published figures. Columns are ordered by weight,
heaviest first. Everything is seeded: the same arguments give the same trace.

`routing_stats` measures the calibration statistics of any trace (synthetic or recorded).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

# Fitted with routing_stats over 1000 tokens (see tests/test_traces_synth.py for the tolerances).
GLM52_PARAMS = dict(skew=0.36, refractory=0.50, memory=0.95)
GLM_SCALING = 2.5


def _weights(aff_sel: np.ndarray, weight_temp: float, scaling: float) -> np.ndarray:
    z = aff_sel / weight_temp
    z = z - z.max(axis=-1, keepdims=True)
    w = np.exp(z)
    return (w / w.sum(axis=-1, keepdims=True) * scaling).astype(np.float32)


def _order_by_weight(idx: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    o = np.argsort(-w, axis=-1, kind="stable")
    return np.take_along_axis(idx, o, axis=-1), np.take_along_axis(w, o, axis=-1)


def _gumbel_blocks(rng: np.random.Generator, tokens: int, shape: tuple[int, int], block: int = 32):
    """Float32 Gumbel noise [*shape] per token, drawn `block` tokens at a time (fewer, larger draws)."""
    for t0 in range(0, tokens, block):
        u = rng.random((min(block, tokens - t0), *shape), dtype=np.float32)
        g = -np.log(-np.log(np.maximum(u, np.float32(1e-30))))
        yield from g


def _check(tokens: int, layers: int, n_experts: int, top_k: int) -> None:
    if tokens < 0 or layers < 1:
        raise ValueError(f"need tokens >= 0 and layers >= 1 (got {tokens}, {layers})")
    if not 1 <= top_k <= n_experts:
        raise ValueError(f"top_k must be in 1..n_experts (got {top_k}, {n_experts})")


def uniform(tokens: int, layers: int = 75, n_experts: int = 256, top_k: int = 8, seed: int = 0,
            weight_temp: float = 2.0, scaling: float = GLM_SCALING) -> tuple[np.ndarray, np.ndarray]:
    """K distinct uniformly random experts per token and layer. -> idx [T, L, K] int32, weights [T, L, K]."""
    _check(tokens, layers, n_experts, top_k)
    rng = np.random.default_rng(seed)
    idx = np.empty((tokens, layers, top_k), np.int32)
    w = np.empty((tokens, layers, top_k), np.float32)
    for t, g in enumerate(_gumbel_blocks(rng, tokens, (layers, n_experts))):
        sel = np.argpartition(-g, top_k - 1, axis=1)[:, :top_k]
        idx[t] = sel
        w[t] = _weights(np.take_along_axis(g, sel, axis=1), weight_temp, scaling)
    return _order_by_weight(idx, w)


def glm52(tokens: int, layers: int = 75, n_experts: int = 256, top_k: int = 8, seed: int = 0, *,
          skew: float = GLM52_PARAMS["skew"], refractory: float = GLM52_PARAMS["refractory"],
          memory: float = GLM52_PARAMS["memory"], weight_temp: float = 2.0,
          scaling: float = GLM_SCALING) -> tuple[np.ndarray, np.ndarray]:
    """GLM-5.x-like routing (module docstring). -> idx [T, L, K] int32, weights [T, L, K] float32."""
    _check(tokens, layers, n_experts, top_k)
    if not 0.0 <= memory < 1.0:
        raise ValueError(f"memory must be in [0, 1) (got {memory})")
    rng = np.random.default_rng(seed)
    base = (skew * rng.standard_exponential((layers, n_experts))).astype(np.float32)   # [L, E]
    recent = np.zeros((layers, n_experts), np.float32)                                  # [L, E]
    rows = np.arange(layers)[:, None]
    idx = np.empty((tokens, layers, top_k), np.int32)
    w = np.empty((tokens, layers, top_k), np.float32)
    for t, g in enumerate(_gumbel_blocks(rng, tokens, (layers, n_experts))):
        aff = base - np.float32(refractory) * recent + g
        sel = np.argpartition(-aff, top_k - 1, axis=1)[:, :top_k]                     # [L, K]
        idx[t] = sel
        w[t] = _weights(np.take_along_axis(aff, sel, axis=1), weight_temp, scaling)
        recent *= np.float32(memory)
        recent[rows, sel] += 1.0
    return _order_by_weight(idx, w)


GENERATORS: dict[str, Callable[..., tuple[np.ndarray, np.ndarray]]] = {"uniform": uniform, "glm52": glm52}


def generate(name: str, tokens: int, layers: int = 75, n_experts: int = 256, top_k: int = 8, seed: int = 0,
             **kw) -> tuple[np.ndarray, np.ndarray]:
    try:
        gen = GENERATORS[name]
    except KeyError:
        raise ValueError(f"unknown generator {name!r} (choose from {', '.join(GENERATORS)})") from None
    return gen(tokens, layers, n_experts, top_k, seed, **kw)


def routing_stats(idx: np.ndarray, n_experts: int, window: int = 75) -> dict:
    """Per-layer statistics averaged over layers, for idx [T, L, K] (-1 = none):

    unique_in_window   distinct experts used within `window` consecutive tokens (mean over windows)
    top4_share         share of all selections taken by the layer's 4 most used experts
    consecutive_shared experts a token shares with the previous token
    used_share         experts used at least once in the whole trace / n_experts
    """
    T, L, K = idx.shape
    W = min(window, T)
    uniq, top4, shared, used = [], [], [], []
    for l in range(L):
        oh = np.zeros((T, n_experts), bool)                                    # [T, E]
        rows = np.repeat(np.arange(T), K)
        ids = idx[:, l, :].reshape(-1)
        ok = ids >= 0
        oh[rows[ok], ids[ok]] = True
        c = np.concatenate([np.zeros((1, n_experts), np.int32), np.cumsum(oh, axis=0, dtype=np.int32)])
        if W > 0:
            uniq.append(float(((c[W:] - c[:-W]) > 0).sum(axis=1).mean()))
        counts = oh.sum(axis=0)
        total = max(int(counts.sum()), 1)
        top4.append(float(np.sort(counts)[-4:].sum()) / total)
        if T > 1:
            shared.append(float((oh[1:] & oh[:-1]).sum(axis=1).mean()))
        used.append(float((counts > 0).mean()))
    mean = lambda xs: float(np.mean(xs)) if xs else 0.0  # noqa: E731
    return {"tokens": T, "layers": L, "window": W, "unique_in_window": mean(uniq), "top4_share": mean(top4),
            "consecutive_shared": mean(shared), "used_share": mean(used)}
