"""Expert top-p pruning (approximate, off by default): the pruning rule on hand-made weights, the exact
path untouched, and the model with pruning on an oracle."""

from __future__ import annotations

import numpy as np
import pytest

from coli.model.numpy_backend import NumpyBackend, prune_topp
from tolerances import assert_within, rounding_bound


def test_keeps_the_fewest_heaviest_reaching_p_and_rescales_to_the_old_sum():
    idx = np.array([[4, 9, 2, 7], [1, 2, 3, 5], [8, 6, 0, 3]])
    w = np.array([[0.1, 0.5, 0.3, 0.1],       # shares .5 .3 .1 .1 -> p=.75 keeps 9, 2
                  [0.25, 0.25, 0.25, 0.25],   # even: p=.75 keeps exactly 3 (.75 >= .75)
                  [2.0, 0.1, 0.1, 0.1]],      # one dominant expert: keeps 1
                 np.float32) * 2.5
    got_i, got_w = prune_topp(idx, w, 0.75)
    assert got_i.tolist() == [[9, 2, -1, -1], [1, 2, 3, -1], [8, -1, -1, -1]]
    # prune_topp works in float64 and rounds once to float32; the sums here are float32 over K = 4 values
    assert_within(got_w.sum(-1), w.sum(-1), rounding_bound(np.abs(w).sum(-1), 4 + 1, sides=2), "the total is kept")
    want = w[0, [1, 2]] * w[0].sum() / (w[0, 1] + w[0, 2])          # float32: 3 + 3 roundings deep
    assert_within(got_w[0, :2], want, rounding_bound(np.abs(want), 6 + 1), "kept weights rescaled")
    assert (got_w[got_i < 0] == 0).all() and got_w.dtype == np.float32


def test_at_least_one_expert_and_p_one_keeps_everything():
    idx = np.array([[0, 1, 2]])
    w = np.array([[0.6, 0.3, 0.1]], np.float32)
    assert prune_topp(idx, w, 1e-9)[0].tolist() == [[0, -1, -1]]
    i, ww = prune_topp(idx, w, 1.0)
    assert sorted(i[0].tolist()) == [0, 1, 2]
    np.testing.assert_array_equal(ww, w)
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="top-p"):
            prune_topp(idx, w, bad)


def test_route_without_topp_is_the_exact_router():
    rng = np.random.default_rng(0)
    b = NumpyBackend()
    x = rng.standard_normal((5, 32)).astype(np.float32)
    gw = rng.standard_normal((16, 32)).astype(np.float32) * 0.1
    bias = rng.standard_normal(16).astype(np.float32) * 0.05
    i0, w0 = b.route(x, gw, bias, 4, 2, 4, True, 2.5)
    i1, w1 = b.route(x, gw, bias, 4, 2, 4, True, 2.5, topp=None)
    np.testing.assert_array_equal(i0, i1)
    np.testing.assert_array_equal(w0, w1)
    i2, w2 = b.route(x, gw, bias, 4, 2, 4, True, 2.5, topp=0.6)
    assert ((i2 >= 0).sum(-1) < 4).any()
    for s in range(5):  # the kept experts are the heaviest of the exact choice
        kept = set(i2[s][i2[s] >= 0].tolist())
        heaviest = i0[s][np.argsort(-w0[s], kind="stable")][:len(kept)]
        assert kept == set(heaviest.tolist())


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    from oracles import oracle_dir

    return oracle_dir(tmp_path_factory.mktemp("oracles"), "default")


def test_model_with_topp_one_is_bit_identical_and_lower_p_loads_fewer_experts(oracle):
    from coli.loader import load_model

    model, cfg = load_model(oracle)
    seq = list(range(1, 25))
    exact = model.forward(seq, model.new_cache(), all_logits=True)
    model.topp = 1.0
    np.testing.assert_array_equal(model.forward(seq, model.new_cache(), all_logits=True), exact)

    loads = []
    model.routing_hook = lambda layer, idx, w: loads.append(int((idx >= 0).sum()))
    model.topp = 0.5
    approx = model.forward(seq, model.new_cache(), all_logits=True)
    assert sum(loads) < len(seq) * len(cfg.moe_layers) * cfg.num_experts_per_tok
    assert not np.array_equal(approx, exact)  # approximate (quality is measured on the demo model: docs/policy.md)


def test_coli_run_labels_topp_as_approximate(oracle):
    from typer.testing import CliRunner

    from coli.cli.main import app

    r = CliRunner().invoke(app, ["run", "-m", str(oracle), "--prompt-ids", "1,2,3", "-n", "3", "--topp", "0.7",
                                 "--json"])
    assert r.exit_code == 0, r.output
    assert "approximate" in r.output and '"expert_topp": 0.7' in r.output
