"""The router-lookahead pilot (issue 7, ARCHITECTURE.md §4 "Bounded speculation"): guess the routed
experts of layer l+N from the residual stream available at layer l, so they can be read while layer l
computes. Pure prediction: nothing here touches the model's outputs.

Which tensor. At layer l the forward pass has

    h_l   = residual stream after layer l's attention add, before its MLP (the input of layer l's
            post_attention_layernorm; the earliest point layer l's own router could run);
    s_l   = layer l's shared-expert output (the dense MLP's output on a dense layer);
    h_l+1 = h_l + s_l + routed_l + attn_{l+1}(...)   (what layer l+1's router really sees, normed).

The pilot applies layer t = l+N's post_attention_layernorm (RMSNorm) and router (sigmoid scores +
correction bias, group-limited top-k — the backend's own `route`, so the same arithmetic) to

    variant "pre":    h_l            (available right after layer l's attention)
    variant "shared": h_l + s_l      (after layer l's shared expert; the routed experts and the later
                                      attentions are what it still misses)

`GlmMoeDsaModel.pilot_hook(layer, h, mlp_side)` hands (h_l, s_l) over at every layer after its router
and before its routed experts are asked for; `Pilot` is such a hook.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

VARIANTS = ("pre", "shared")


def parse_pilot(value: str | int | None) -> int:
    """`--pilot off|on|N` -> layers ahead (0 = off, on = 1)."""
    if value is None:
        return 0
    s = str(value).strip().lower()
    if s in ("off", "0", "false", "no", ""):
        return 0
    if s in ("on", "true", "yes"):
        return 1
    try:
        n = int(s)
    except ValueError:
        raise ValueError(f"--pilot {value!r}: expected off, on or a number of layers ahead") from None
    if n < 0:
        raise ValueError(f"--pilot {value!r}: layers ahead must be >= 0")
    return n


def predict(model, target: int, h, side=None) -> np.ndarray:
    """Predicted top-k expert ids [S, K] (host int64) of MoE layer `target` from the residual stream h
    [S, H] of an earlier layer (plus `side`, that layer's shared-expert/dense-MLP output, if given)."""
    c, b = model.config, model.backend
    lw = model.layers[target]
    if lw.router is None:
        raise ValueError(f"layer {target} is dense: it has no router to look ahead with")
    x = h if side is None else b.add(h, side)
    xn = b.rms_norm(x, lw.post_norm, c.rms_norm_eps)
    idx, _ = b.route(xn, lw.router, lw.router_bias, c.n_group, c.topk_group, c.num_experts_per_tok,
                     c.norm_topk_prob, c.routed_scaling_factor)
    return np.asarray(idx, dtype=np.int64)


def target_layer(model, layer: int, ahead: int) -> int | None:
    """The layer `ahead` layers after `layer` if it is a MoE layer of the model, else None."""
    t = layer + ahead
    if ahead < 1 or t >= len(model.layers) or model.layers[t].router is None:
        return None
    return t


class Pilot:
    """A pilot_hook: at layer l predicts layer l+ahead's experts and hands them to `sink(target_layer,
    experts, idx)` — experts the sorted union over the S rows, idx [S, K] per row."""

    def __init__(self, model, ahead: int = 1, variant: str = "shared",
                 sink: Callable[[int, list[int], np.ndarray], None] | None = None):
        if variant not in VARIANTS:
            raise ValueError(f"pilot variant {variant!r}: expected one of {VARIANTS}")
        self.model, self.ahead, self.variant, self.sink = model, ahead, variant, sink
        self.predictions: dict[int, list[int]] = {}  # target layer -> last predicted expert set

    def __call__(self, layer: int, h, side) -> None:
        t = target_layer(self.model, layer, self.ahead)
        if t is None:
            return
        idx = predict(self.model, t, h, side if self.variant == "shared" else None)
        experts = sorted(set(int(e) for e in idx.ravel().tolist() if e >= 0))
        self.predictions[t] = experts
        if self.sink is not None:
            self.sink(t, experts, idx)


def recall_at_k(pred: np.ndarray, actual: np.ndarray) -> np.ndarray:
    """Per row |pred ∩ actual| / k for [S, K] expert-id arrays (pruned -1 slots of `actual` not counted
    as experts)."""
    k = pred.shape[1]
    out = np.empty(pred.shape[0])
    for r in range(pred.shape[0]):
        a = set(int(e) for e in actual[r] if e >= 0)
        out[r] = len(a & set(int(e) for e in pred[r])) / k
    return out
