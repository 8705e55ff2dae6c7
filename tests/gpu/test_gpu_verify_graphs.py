"""Greedy MTP verify steps of 2-4 positions replayed from CUDA graphs (coli/gpu/verify_graphs.py), on an oracle with an
MTP layer added (checkpoints.with_mtp_layer; seeds no other test uses):

- a replayed step gives its eager forward_rows' tokens, and the KV cache bit for bit up to the first MoE layer
  (the graph's MoE runs each row's one-token fused decode, the eager step of several rows the grouped prefill GEMM:
  from there the two agree in tokens, not in bits -- as the batched steps' replays and their eager steps);
- the tokens equal the positions decoded one at a time (forward_hidden per token);
- with a forced routing (the benchmarks' trace replay) and with every slot dropped (their no-expert step);
- `--mtp 3` and `--mtp 2` with COLI_VERIFY_GRAPHS=1 give transformers' greedy tokens (f32) and the tokens without MTP
  (int4), the verify steps replayed;
- what cannot be replayed runs eagerly and says why (streamed experts; more than MAX_ROWS positions).
"""

from __future__ import annotations

import numpy as np
import pytest

from checkpoints import with_mtp_layer
from gpu_helpers import container
from oracles import load_oracle, oracle_dir

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("gpu-verify-graphs")


@pytest.fixture(scope="module")
def src(root):
    o = oracle_dir(root, "default")
    return o, with_mtp_layer(o, root / "with-mtp", seed=29)


def _model(root, src, fmt="f32"):
    from coli.loader import load_model
    if fmt == "f32":
        d = container(root, src[1], "f32", experts="f32", dense="f32")
    else:
        d = container(root, src[1], "int4", experts="int4", dense="int8", group=32)
    model, _ = load_model(d, "gpu")
    assert model.backend.name == "cuda"
    return model


def _filled(model, prompt):
    cache = model.new_cache(128)
    model.forward_hidden(prompt, cache)
    return cache


def _eager_rows(model, cache, ids):
    from coli.model.batch import forward_rows
    hn, logits = forward_rows(model, cache, ids)
    b = model.backend
    return [int(t) for t in b.argmax(logits)], b.to_host(hn)


@pytest.mark.parametrize("S", [2, 3, 4])
def test_a_replayed_verify_step_gives_its_eager_steps_tokens(root, src, S):
    o = load_oracle(src[0])
    model = _model(root, src)
    vg = model.backend.verify_graphs(model, force=True)
    prompt = o["prompt_ids"]
    ids = [prompt[-1]] + o["greedy_tokens"][:S - 1]
    ref = _filled(model, prompt[:-1])
    P = ref.length
    want_tok, want_h = _eager_rows(model, ref, ids)
    cache = _filled(model, prompt[:-1])
    assert vg.greedy(cache, ids) is None and "first verify step" in vg.last_reason   # the caller runs it eagerly
    assert cache.length == P
    for step in range(4):                               # captured, then replayed
        got = vg.greedy(cache, ids)
        assert got is not None, vg.last_reason
        toks, hn = got
        assert toks == want_tok, step
        h = model.backend.to_host(hn)                   # the hidden states the MTP layer's catch-up reads
        assert h.shape == want_h.shape and np.isfinite(h).all()
        assert cache.length == P + S
        if step < 3:
            cache.truncate(P)
    assert vg.replays == 4 and vg.captures == 1
    first_moe = model.config.moe_layers[0]
    ha, hb = cache.host_arrays(), ref.host_arrays()
    same = [k for k in ha if np.array_equal(ha[k][:P + S], hb[k][:P + S])]
    # layers up to the first MoE layer: written before any routed expert's output reaches them
    want_same = [k for k in ha if int(k.split(".")[0]) <= first_moe]
    assert want_same and set(want_same) <= set(same), sorted(set(want_same) - set(same))


def test_replayed_tokens_equal_the_positions_one_at_a_time_with_a_forced_and_a_dropped_routing(root, src):
    from coli.bench.batch_decode import DropAllExperts
    o = load_oracle(src[0])
    model = _model(root, src)
    c = model.config
    vg = model.backend.verify_graphs(model, force=True)
    rng = np.random.default_rng(5)

    def forced(layer, n_rows):
        idx = np.stack([rng.permutation(c.n_routed_experts)[:c.num_experts_per_tok] for _ in range(n_rows)])
        return idx.astype(np.int64), np.full(idx.shape, 0.25, np.float32)

    prompt = o["prompt_ids"]
    for override in (forced, DropAllExperts(c.num_experts_per_tok)):
        routes = []                                     # the same draws for the replay and the one-at-a-time steps
        model.route_override = lambda layer, n, ov=override: routes.append(ov(layer, n)) or routes[-1]
        cache = _filled(model, prompt)
        P = cache.length
        for _ in range(3):
            routes.clear()
            got = vg.greedy(cache, [3, 7, 11])
            assert got is not None
            cache.truncate(P)
        drawn = list(routes)
        rows = [{layer: (d[0][j:j + 1], d[1][j:j + 1]) for layer, d in zip(c.moe_layers, drawn)} for j in range(3)]
        model.route_override = None
        from coli.gpu.graphs import replaying_routes
        alone = []
        for j, t in enumerate([3, 7, 11]):
            with replaying_routes(model, rows[j]):
                _, lg = model.forward_hidden([t], cache)
            alone.append(int(model.backend.argmax(lg)[-1]))
        assert got[0] == alone, override
        assert vg.last_reason is None, vg.last_reason


@pytest.mark.parametrize("fmt,drafts", [("f32", 3), ("f32", 2), ("int4", 3)])
def test_mtp_with_replayed_verify_steps_gives_the_tokens_without_it(root, src, monkeypatch, fmt, drafts):
    from coli.generate import Generation
    from coli.model.mtp import load_mtp_head
    monkeypatch.setenv("COLI_VERIFY_GRAPHS", "1")
    o = load_oracle(src[0])
    model = _model(root, src, fmt)
    head = load_mtp_head(model)
    assert head.verify is not None
    prompt = o["prompt_ids"]
    want = o["greedy_tokens"] if fmt == "f32" else list(Generation(model, prompt, 32, ignore_eos=True))
    gen = Generation(model, prompt, 32, ignore_eos=True, mtp=(head, drafts))
    assert list(gen) == want
    assert head.verify.replays > 0, head.verify.last_reason


def test_what_cannot_be_replayed_says_why(root, src):
    o = load_oracle(src[0])
    model = _model(root, src)
    vg = model.backend.verify_graphs(model, force=True)
    cache = _filled(model, o["prompt_ids"])
    assert vg.greedy(cache, [1, 2, 3, 4, 5]) is None and "5 positions" in vg.last_reason
    model.step_graphs = None
    assert vg.greedy(cache, [1, 2]) is None and "COLI_GRAPHS=0" in vg.last_reason
