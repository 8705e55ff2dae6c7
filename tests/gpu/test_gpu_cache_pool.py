"""Replayed decode graphs surviving from one request to the next (coli/model/cache_pool.py): two consecutive
generations as `coli run` makes them (Generation, a cache of its own each) on a GPU model with every expert resident
and graphs on. The second one's cache gets the first one's buffers (its KV rows poisoned with NaN in between), so
it captures nothing -- the decoder's `captures` stay, its `replays` grow by every decode step, its first one
included -- and its tokens are transformers'. The same for greedy one-draft MTP rounds (MtpRoundGraphs), whose key
is both caches'."""

from __future__ import annotations

import pytest

from checkpoints import with_mtp_layer
from gpu_helpers import container, report
from oracles import load_oracle, oracle_dir

pytestmark = pytest.mark.gpu

NAN_BITS = 0x7FC00000     # a float32 quiet NaN, as the 32-bit pattern memset writes


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("gpu-cache-pool")


@pytest.fixture(scope="module")
def src(root):
    o = oracle_dir(root, "default")
    return o, with_mtp_layer(o, root / "with-mtp", seed=23)


def poison_idle(model, pool, capacity: int, make) -> None:
    """Fill the idle set of `capacity` in `pool` with NaN on the device (taken out through a cache, put back)."""
    c = make(capacity)
    rt = model.backend.rt
    for lc in c.layers:
        for a in (lc.lat, lc.k_pe, lc.k_idx):
            if a is not None:
                rt.drv.memset_d32(a.ptr, NAN_BITS, a.nbytes // 4)
    rt.synchronize()
    c.release()
    assert pool.idle().get(capacity) == 1


def test_a_second_generation_replays_the_first_one_s_graphs_from_its_first_step(root, src):
    from coli.generate import Generation
    from coli.gpu.graphs import step_key
    from coli.loader import load_model

    o = load_oracle(src[0])
    p, n = o["prompt_ids"], len(o["greedy_tokens"])
    model, _ = load_model(container(root, src[0], "f32", experts="f32", dense="f32"), "gpu")
    g = model.step_graphs
    assert g is not None, "COLI_GRAPHS defaults to on"
    first = Generation(model, p, n, ignore_eos=True)
    assert list(first) == o["greedy_tokens"]
    assert g.captures >= 1 and first.cache.released
    cap = first.cache.pool.idle()
    assert len(cap) == 1
    poison_idle(model, model.cache_pool, next(iter(cap)), model.new_cache)
    captures, replays = g.captures, g.replays
    second = Generation(model, p, n, ignore_eos=True, keep_cache=True)
    toks = list(second)
    report("cache_pool_decode", captures_first=captures, replays_first=replays, captures_second=g.captures,
           replays_second=g.replays - replays, decode_steps=n - 1, tokens_equal=toks == o["greedy_tokens"],
           last_reason=g.last_reason)
    assert toks == o["greedy_tokens"]                    # the poisoned rows past its length were never read
    assert g.captures == captures, "the second generation captured again: its cache did not get the same buffers"
    assert g.replays - replays == n - 1, f"not every decode step replayed: {g.last_reason}"
    assert step_key(second.cache, "router", "")[:2] in {k[:2] for k in g.graphs}


def test_a_second_mtp_generation_replays_the_round_graphs(root, src):
    from coli.generate import Generation
    from coli.loader import load_model
    from coli.model.mtp import load_mtp_head

    o = load_oracle(src[0])
    p, n = o["prompt_ids"], len(o["greedy_tokens"])
    model, _ = load_model(container(root, src[1], "mtp-f32", experts="f32", dense="f32"), "gpu")
    head = load_mtp_head(model)
    rg = head.rounds
    assert rg is not None, "COLI_MTP_GRAPHS defaults to on"
    first = Generation(model, p, n, ignore_eos=True, mtp=(head, 1))
    assert list(first) == o["greedy_tokens"]
    assert rg.captures >= 1, rg.last_reason
    (cap,), (mcap,) = model.cache_pool.idle(), head.cache_pool.idle()
    poison_idle(model, model.cache_pool, cap, model.new_cache)
    poison_idle(model, head.cache_pool, mcap, head.new_cache)
    captures, replays, eager = rg.captures, rg.replays, rg.eager
    second = Generation(model, p, n, ignore_eos=True, mtp=(head, 1))
    toks = list(second)
    report("cache_pool_mtp", captures_first=captures, replays_first=replays, captures_second=rg.captures,
           replays_second=rg.replays - replays, tokens_equal=toks == o["greedy_tokens"], last_reason=rg.last_reason)
    assert toks == o["greedy_tokens"]
    assert rg.captures == captures, "the second generation's rounds captured again"
    assert rg.eager == eager, f"a round of the second generation ran eagerly: {rg.last_reason}"
    assert rg.replays - replays > replays, "the second generation's first rounds were not replayed"
