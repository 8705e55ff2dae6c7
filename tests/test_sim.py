"""The cache policy simulator: Belady is optimal (exhaustive search on tiny traces) and bounds every
other policy on synthetic and recorded traces; each policy's behaviour on hand-made traces; coli sim."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from coli.sim import ONLINE, POLICIES, miss_stream, next_use, simulate, sweep, top_used_pins
from coli.traces_synth import glm52, uniform

A, B, C, D, X, Y, Z = range(7)


def tr(*tokens, K=None):
    """A one-layer trace from token lists ([a, b] = the token routes to a and b); -1 pads."""
    K = K or max(len(t) for t in tokens)
    return np.array([[list(t) + [-1] * (K - len(t))] for t in tokens], np.int32)  # [T, 1, K]


def hits(idx, policy, slots, **kw):
    return simulate(idx, policy, slots, n_experts=8, record_hits=True, **kw).hit_mask[:, 0, :]


def best_possible(idx, cap):
    """Exhaustive search over every cache content the model allows (subset of old U requested)."""
    best = {frozenset(): 0}
    for t in range(idx.shape[0]):
        req = {int(e) for e in idx[t, 0] if e >= 0}
        nxt = {}
        for s, v in best.items():
            h = v + len(s & req)
            pool = sorted(s | req)
            for n in range(min(cap, len(pool)) + 1):
                for sub in itertools.combinations(pool, n):
                    k = frozenset(sub)
                    if nxt.get(k, -1) < h:
                        nxt[k] = h
        best = nxt
    return max(best.values())


def test_belady_is_optimal_on_small_random_traces():
    rng = np.random.default_rng(0)
    for _ in range(60):
        E = int(rng.integers(3, 7))
        K = int(rng.integers(1, min(3, E) + 1))
        cap = int(rng.integers(1, E))
        T = int(rng.integers(3, 9))
        p = rng.dirichlet(np.full(E, 0.5))
        idx = np.stack([rng.choice(E, K, replace=False, p=p) for _ in range(T)])[:, None, :]
        opt = best_possible(idx, cap)
        assert simulate(idx, "belady", cap, n_experts=E).hits == opt
        for pol in ONLINE:
            assert simulate(idx, pol, cap, n_experts=E).hits <= opt


def _assert_bound(idx, w, E, sizes, shared=False):
    res = sweep(idx, ONLINE + ("belady",), sizes, weights=w, n_experts=E, shared=shared)
    by = {(r.policy, r.slots): r.hits for r in res}
    for s in sizes:
        for p in ONLINE:
            assert by[(p, s)] <= by[("belady", s)], (p, s, by[(p, s)], by[("belady", s)])
    return res


@pytest.mark.parametrize("gen", ["glm52", "uniform", "glm52-sticky"])
def test_belady_bounds_every_policy_on_synthetic_traces(gen):
    if gen == "uniform":
        idx, w = uniform(200, 6, seed=1)
    else:
        idx, w = glm52(200, 6, seed=2, **({"refractory": -2.0} if gen == "glm52-sticky" else {}))
    _assert_bound(idx, w, 256, [1, 4, 8, 16, 64])
    _assert_bound(idx, w, 256, [2, 8], shared=True)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """A routing trace recorded from a model run: the demo model when it is installed, else an oracle."""
    from coli.generate import Generation
    from coli.loader import load_model
    from coli.trace import RoutingRecorder, read_trace

    from importlib import resources
    from pathlib import Path

    demo = Path(str(resources.files("coli.demo"))) / "model"
    if (demo / "config.json").is_file():
        d = demo
    else:
        from oracles import oracle_dir
        d = oracle_dir(tmp_path_factory.mktemp("oracles"), "default")
    model, cfg = load_model(d)
    path = tmp_path_factory.mktemp("traces") / "rec.trace"
    with RoutingRecorder.for_model(path, cfg) as rec:
        model.routing_hook = rec
        for prompt in ([1, 5, 9, 13, 17, 21], [2, 3, 4]):
            rec.new_sequence()
            list(Generation(model, prompt, 24, ignore_eos=True))
    return read_trace(path)


def test_belady_bounds_every_policy_on_a_recorded_trace(recorded):
    assert recorded.n_tokens == 6 + 23 + 3 + 23
    E = recorded.header.n_experts
    _assert_bound(recorded.idx, recorded.weights, E, [1, 2, 4, 8, E])
    _assert_bound(recorded.idx, recorded.weights, E, [1, 4], shared=True)


# ---- policy behaviour on hand-made traces ---------------------------------------------------------------
def test_a_hit_means_resident_before_the_token_and_padding_is_no_request():
    idx = tr([A, B], [A, C], [C, -1])
    h = hits(idx, "lru", 4)
    assert h.tolist() == [[False, False], [True, False], [True, False]]
    r = simulate(idx, "lru", 4, n_experts=8)
    assert (r.hits, r.requests) == (2, 5)
    assert simulate(idx, "lru", 0, n_experts=8).hits == 0


def test_lru_evicts_the_least_recent_and_keeps_the_heavier_of_a_token():
    idx = tr([A], [B], [C], [A])          # 2 slots: C evicts A
    assert hits(idx, "lru", 2)[:, 0].tolist() == [False, False, False, False]
    idx = tr([A], [B], [A], [C], [A])     # A refreshed at t2: C evicts B
    assert hits(idx, "lru", 2)[:, 0].tolist() == [False, False, True, False, True]
    # 1 slot, a token of two experts: the heavier one stays
    idx = tr([A, B], [B], [A])
    w = np.array([[[0.2, 0.8]], [[1.0, 0.0]], [[1.0, 0.0]]], np.float32)
    h = simulate(idx, "lru", 1, weights=w, n_experts=8, record_hits=True).hit_mask[:, 0, 0]
    assert h.tolist() == [False, True, False]


def test_lfu_admits_every_miss_but_freq_only_one_that_out_counts_a_resident():
    idx = tr([A], [A], [A], [B], [C], [A])
    # lfu (forced): B evicts nothing (2 slots: A, B); C evicts B (count 1, older) -> A hits at the end
    assert hits(idx, "lfu", 2)[:, 0].tolist() == [False, True, True, False, False, True]
    idx = tr([A], [A], [B], [B], [C], [B], [A])
    # 1 slot: lfu always takes the newcomer (C evicts B, then B evicts C...); freq keeps the most used
    assert hits(idx, "lfu", 1)[:, 0].tolist() == [False, True, False, True, False, False, False]
    assert hits(idx, "freq", 1)[:, 0].tolist() == [False, True, False, False, False, True, False]


def test_decayed_counts_let_a_newly_popular_expert_in():
    idx = tr([A], [A], [A], [B], [B], [B])
    assert hits(idx, "freq", 1)[:, 0].tolist() == [False, True, True, False, False, False]
    assert hits(idx, "freq", 1, count_decay=0.5)[:, 0].tolist() == [False, True, True, False, True, True]


def test_rdf_breaks_recency_ties_with_decayed_frequency():
    # 3 slots; A and B both last used at t3 (B the heavier); A was used often before -> on D, rdf evicts
    # the rarer B, lru the lighter A (and then A evicts B)
    idx = tr([A], [A], [A], [B, A], [C], [D], [A], [B])
    assert hits(idx, "rdf", 3)[-2:, 0].tolist() == [True, False]
    assert hits(idx, "lru", 3)[-2:, 0].tolist() == [False, False]  # A back evicts B, the LRU
    # with decay 0 every frequency is 1: the in-token order decides, as in lru
    assert hits(idx, "rdf", 3, decay=0.0).tolist() == hits(idx, "lru", 3).tolist()


def test_slru_protects_experts_that_hit_against_a_scan():
    # 4 slots (3 protected): A, B hit once -> protected; a scan of X, Y, Z, C, D cycles through probation
    idx = tr([A], [B], [A], [B], [X], [Y], [Z], [C], [D], [A], [B])
    s = hits(idx, "slru", 4, protected=0.75)[:, 0]
    l = hits(idx, "lru", 4)[:, 0]
    assert s[-2:].tolist() == [True, True] and l[-2:].tolist() == [False, False]


def test_pinlru_evicts_unpinned_experts_first():
    idx = tr([A], [B], [C], [D], [A], [D])
    pins = np.zeros((1, 8), bool)
    pins[0, A] = True
    assert hits(idx, "pinlru", 2, pins=pins)[:, 0].tolist() == [False, False, False, False, True, True]
    assert hits(idx, "lru", 2)[:, 0].tolist() == [False, False, False, False, False, True]


def test_belady_keeps_what_is_needed_soonest_and_may_refuse_a_miss():
    idx = tr([A], [B], [C], [A], [B], [C])
    # 2 slots: keep A, B; C is never kept (its next use is the farthest)
    assert hits(idx, "belady", 2)[:, 0].tolist() == [False, False, False, True, True, False]


def test_next_use_and_helpers():
    idx = tr([A, B], [C, -1], [A, C])
    nu = next_use(idx)
    assert nu[0, 0].tolist() == [2, 4] and nu[1, 0, 0] == 2 and nu[2, 0].tolist() == [4, 4]
    pins = top_used_pins(np.concatenate([idx, idx], axis=1), 2, 8)
    assert pins.shape == (2, 8) and pins.sum() == 2 and pins[0, A] and pins[0, C]  # ties: lowest key first
    m = miss_stream(idx, hits(idx, "lru", 4)[:, None, :])
    assert m[2, 0].tolist() == [-1, -1] and m[0, 0].tolist() == [A, B]


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="twice"):
        simulate(tr([A, A]), "lru", 2, n_experts=8)
    with pytest.raises(ValueError, match="unknown policy"):
        simulate(tr([A]), "mru", 2, n_experts=8)
    with pytest.raises(ValueError, match="pins"):
        simulate(tr([A]), "pinlru", 2, n_experts=8)
    assert set(ONLINE) < set(POLICIES)


def test_coli_sim_command(tmp_path):
    from typer.testing import CliRunner

    from coli.cli.main import app

    p = tmp_path / "s.trace"
    r = CliRunner().invoke(app, ["sim", "--synth", "glm52", "--tokens", "60", "--layers", "3", "--write-trace", str(p),
                                 "-s", "2,8", "--shared"])
    assert r.exit_code == 0, r.output
    assert "belady >= every other policy at every size: ok" in r.output and "shared pool" in r.output
    r = CliRunner().invoke(app, ["sim", "--trace", str(p), "-p", "lru,belady", "-s", "8", "--json"])
    assert r.exit_code == 0, r.output
    assert r.output.count('"policy"') == 2
    r = CliRunner().invoke(app, ["sim", "--trace", str(tmp_path / "missing.trace")])
    assert r.exit_code == 2 and "does not exist" in r.output
