"""The router-lookahead pilot (coli.pilot): its prediction is the next layer's router applied to the
chosen tensor, computed directly here; the pilot hook changes no logits; --pilot parsing."""

from pathlib import Path

import numpy as np
import pytest

from coli.loader import load_model
from coli.model.sampling import SamplingParams
from coli.pilot import Pilot, parse_pilot, predict, recall_at_k, target_layer

DEMO = Path(__file__).resolve().parent.parent / "coli" / "demo" / "model"
PROMPT = [4089, 17, 250, 933, 12, 77, 1024, 5, 300, 41]


@pytest.fixture(scope="module")
def demo():
    model, cfg = load_model(DEMO)
    return model, cfg


def _direct_route(cfg, lw, x):
    """sigmoid(RMSNorm(x) @ router.T) + bias -> group-limited top-k, written out in numpy."""
    x = x.astype(np.float64)
    xn = x / np.sqrt((x * x).mean(-1, keepdims=True) + cfg.rms_norm_eps) * lw.post_norm
    choice = 1 / (1 + np.exp(-(xn @ np.asarray(lw.router, np.float64).T))) + lw.router_bias
    S, E = choice.shape
    G = cfg.n_group
    g = choice.reshape(S, G, E // G)
    gscore = np.sort(g, -1)[..., -2:].sum(-1)
    keep = np.argsort(-gscore, -1, kind="stable")[:, :cfg.topk_group]
    mask = np.zeros((S, G), bool)
    np.put_along_axis(mask, keep, True, -1)
    choice = np.where(np.repeat(mask, E // G, -1), choice, -np.inf)
    return np.sort(np.argsort(-choice, -1, kind="stable")[:, :cfg.num_experts_per_tok], -1)


def _capture(model, ids):
    """(layer -> (h, side)) and (layer -> routed idx) of one forward."""
    seen, routed = {}, {}
    model.pilot_hook = lambda i, h, side: seen.__setitem__(i, (np.array(h), np.array(side)))
    model.routing_hook = lambda i, idx, w: routed.__setitem__(i, np.array(idx))
    try:
        logits = model.forward(ids, model.new_cache(), all_logits=True)
    finally:
        model.pilot_hook = model.routing_hook = None
    return seen, routed, logits


def test_predict_matches_a_direct_computation(demo):
    model, cfg = demo
    seen, _, _ = _capture(model, PROMPT)
    assert sorted(seen) == list(range(cfg.num_hidden_layers))  # every layer, the dense one too
    for layer, (h, side) in seen.items():
        for n in (1, 2):
            t = target_layer(model, layer, n)
            if t is None:
                continue
            for x, s in ((h, None), (h + side, side)):
                got = np.sort(predict(model, t, h, s), -1)
                want = _direct_route(cfg, model.layers[t], x)
                assert (got == want).mean() > 0.98  # float32 vs float64: a near-tie may flip
                assert got.shape == (len(PROMPT), cfg.num_experts_per_tok)


def test_lookahead_zero_is_the_layers_own_routing(demo):
    """The hook's h is exactly the tensor a layer's own router normalises: predicting a layer from its
    own h reproduces its routing bit for bit (which pins down the hook point)."""
    model, cfg = demo
    seen, routed, _ = _capture(model, PROMPT)
    for layer, idx in routed.items():
        assert (predict(model, layer, seen[layer][0]) == idx).all()


def test_target_layer(demo):
    model, cfg = demo
    assert target_layer(model, 0, 1) == 1 and target_layer(model, 1, 2) == 3
    assert target_layer(model, 2, 2) is None and target_layer(model, 3, 1) is None
    assert target_layer(model, 1, 0) is None
    with pytest.raises(ValueError):
        predict(model, 0, np.zeros((1, cfg.hidden_size), np.float32))


def test_pilot_hook_changes_no_logits_and_no_tokens(demo):
    model, cfg = demo
    want = model.forward(PROMPT, model.new_cache(), all_logits=True)
    got_preds = []
    model.pilot_hook = Pilot(model, 1, "shared", sink=lambda t, e, idx: got_preds.append((t, e)))
    try:
        got = model.forward(PROMPT, model.new_cache(), all_logits=True)
    finally:
        model.pilot_hook = None
    assert np.array_equal(want, got)  # bit for bit
    assert [t for t, _ in got_preds] == [1, 2, 3]
    assert all(e == sorted(set(e)) and len(e) >= cfg.num_experts_per_tok for _, e in got_preds)

    from coli.generate import Generation
    plain = list(Generation(model, PROMPT, 12, SamplingParams(greedy=True), ignore_eos=True))
    model.pilot_hook = Pilot(model, 2, "pre")
    try:
        piloted = list(Generation(model, PROMPT, 12, SamplingParams(greedy=True), ignore_eos=True))
    finally:
        model.pilot_hook = None
    assert plain == piloted


def test_pilot_is_better_than_chance_on_the_trained_demo(demo):
    model, cfg = demo
    preds = {}
    model.pilot_hook = Pilot(model, 1, "shared", sink=lambda t, e, idx: preds.__setitem__(t, idx))
    try:
        _, routed, _ = _capture_keep(model)
    finally:
        model.pilot_hook = None
    r = np.concatenate([recall_at_k(preds[t], routed[t]) for t in preds])
    assert r.mean() > 0.6  # chance is k/E = 0.25; docs/pilot.md measures ~0.88


def _capture_keep(model):
    routed = {}
    model.routing_hook = lambda i, idx, w: routed.__setitem__(i, np.array(idx))
    try:
        model.forward(PROMPT, model.new_cache(), all_logits=True)
    finally:
        model.routing_hook = None
    return None, routed, None


def test_recall_at_k():
    pred = np.array([[0, 1, 2, 3], [4, 5, 6, 7]])
    act = np.array([[3, 2, 9, 8], [4, 5, 6, -1]])
    assert recall_at_k(pred, act).tolist() == [0.5, 0.75]


@pytest.mark.parametrize("s,n", [("off", 0), ("on", 1), ("1", 1), ("2", 2), (None, 0), ("0", 0)])
def test_parse_pilot(s, n):
    assert parse_pilot(s) == n


def test_parse_pilot_rejects():
    for bad in ("maybe", "-1"):
        with pytest.raises(ValueError):
            parse_pilot(bad)
