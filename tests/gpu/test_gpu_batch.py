"""One forward step over several sequences (coli.model.batch) on the CUDA backend, on tiny GLM-5 oracles built by
transformers in this run with seeds no other test uses:

- f32 containers: every sequence of a batch (prompts of different lengths, joining and leaving mid-run, one
  cancelled, one prompt chunked) gets transformers' tokens exactly, and a short one its tokens alone;
- int4 containers: the GPU's batched tokens equal the numpy path's batched tokens, which equal each sequence's
  alone (tests/model/test_batch.py);
- streaming experts (a VRAM cache of a few slots): tokens equal transformers', and the engine sees one stream()
  of the step's union per MoE layer per step.
"""

from __future__ import annotations

import numpy as np
import pytest

from gpu_helpers import build_fresh_oracles, container, greedy, report
from oracles import load_oracle

pytestmark = pytest.mark.gpu

FRESH = {
    "batch-topk": (901, {"prompt_len": 40, "index_topk": 8}),
    "batch-shared": (1001, {"prompt_len": 24, "index_topk": 8, "indexer_pattern": "FFSS"}),
}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("gpu-batch")


@pytest.fixture(scope="module")
def oracles(root):
    return build_fresh_oracles(root, FRESH)


def _continuation_prompt(o):
    return o["prompt_ids"] + o["greedy_tokens"] + o["continuation"]["extra_ids"]


def run_batch(model, prompts, n_new, joins=None, cancel_at=None, chunks=None) -> list[list[int]]:
    """Greedy tokens of each prompt, all running in one batch: prompt k joins at step joins[k] (0), is fed in
    chunks of chunks[k] tokens (all at once), produces n_new[k] tokens and leaves; cancel_at[k]: dropped with its
    cache after that step."""
    from coli.model.batch import BatchRow, greedy_batch
    joins, cancel_at, chunks = joins or {}, cancel_at or {}, chunks or {}
    K = len(prompts)
    caches = [model.new_cache(8) for _ in range(K)]
    pending = [list(p) for p in prompts]
    toks: list[list[int]] = [[] for _ in range(K)]
    running: list[int] = []
    step = 0
    while True:
        running += [k for k in range(K) if joins.get(k, 0) == step]
        running = [k for k in running if len(toks[k]) < n_new[k]]
        if not running and all(joins.get(k, 0) <= step for k in range(K)):
            return toks
        rows, last = [], []
        for k in running:
            if pending[k]:
                n = chunks.get(k) or len(pending[k])
                ids, pending[k] = pending[k][:n], pending[k][n:]
            else:
                ids = [toks[k][-1]]
            rows.append(BatchRow(caches[k], ids))
            last.append(not pending[k])
        if rows:
            for k, t, counts in zip(running, greedy_batch(model, rows), last):
                if counts:
                    toks[k].append(t)
        for k, at in cancel_at.items():
            if at == step and k in running:
                running.remove(k)
                caches[k] = None
        step += 1


def _prompts(o):
    p = o["prompt_ids"]
    return [p, _continuation_prompt(o), p[:5], p[3:20]]


@pytest.mark.parametrize("name", list(FRESH))
def test_gpu_batched_tokens_match_transformers_on_f32_containers(root, oracles, name):
    from coli.loader import load_model
    src, seed = oracles[name]
    o = load_oracle(src)
    d = container(root, src, f"{name}-f32", experts="f32", dense="f32")
    model, _ = load_model(d, "gpu")
    assert model.backend.name == "cuda"
    prompts = _prompts(o)
    n_new = [32, 32, 9, 32]
    # the oracle prompt joins at step 3 in chunks of 7; the short one leaves at step 8; the last is cancelled
    got = run_batch(model, prompts, n_new, joins={0: 3, 3: 5}, chunks={0: 7}, cancel_at={3: 12})
    short_alone, _ = greedy(model, prompts[2], 9)
    report("batch_f32", oracle=name, seed=seed, first_equal=got[0] == o["greedy_tokens"],
           continuation_equal=got[1] == o["continuation"]["greedy_tokens"], short_equal=got[2] == short_alone)
    assert got[0] == o["greedy_tokens"]
    assert got[1] == o["continuation"]["greedy_tokens"]
    assert got[2] == short_alone
    assert len(got[3]) == 12 - 5 + 1 and got[3] == greedy(model, prompts[3], 8)[0]


@pytest.mark.parametrize("variant", [dict(experts="int4", dense="int8", group=64),
                                     dict(experts="int4", dense="int4", group=32)])
def test_gpu_batched_int4_tokens_equal_the_numpy_path(root, oracles, variant):
    from coli.loader import load_model
    src, _ = oracles["batch-topk"]
    o = load_oracle(src)
    d = container(root, src, f"batch-topk-{variant['dense']}-g{variant['group']}", **variant)
    gpu, _ = load_model(d, "gpu")
    cpu, _ = load_model(d, "cpu")
    prompts = _prompts(o)
    n_new = [24, 24, 9, 24]
    plan = dict(joins={0: 3, 3: 5}, chunks={0: 7})
    g = run_batch(gpu, prompts, n_new, **plan)
    c = run_batch(cpu, prompts, n_new, **plan)
    alone = [greedy(gpu, p, n)[0] for p, n in zip(prompts, n_new)]
    report("batch_int4", variant=str(variant), equal=g == c, gpu_alone_equal=g == alone)
    assert g == c
    assert g == alone


def test_streaming_engine_sees_one_stream_of_the_union_per_layer(root, oracles):
    from coli.loader import GpuOptions, load_model
    from coli.model.batch import BatchRow, greedy_batch
    src, _ = oracles["batch-topk"]
    o = load_oracle(src)
    d = container(root, src, "batch-topk-f32", experts="f32", dense="f32")
    model, cfg = load_model(d, "gpu", gpu=GpuOptions(vram_slots=6, tile_kb=16))
    vx = model.experts
    try:
        prompts = _prompts(o)[:3]
        n_new = [32, 32, 9]
        got = run_batch(model, prompts, n_new, joins={0: 2})
        assert got[0] == o["greedy_tokens"]
        assert got[1] == o["continuation"]["greedy_tokens"]
        # one step of three rows: the engine's step counter moves once per MoE layer, and the experts it was asked
        # for (hits + misses) are the union of what the rows route to
        routed: dict[int, set] = {}
        model.routing_hook = lambda layer, idx, w: routed.setdefault(layer, set()).update(
            int(e) for e in np.asarray(idx).ravel() if e >= 0)
        caches = [model.new_cache() for _ in prompts]
        firsts = [model.greedy(p, c) for p, c in zip(prompts, caches)]
        vx.finish()
        before = vx.snapshot()
        routed.clear()
        calls: list[tuple[int, list[int]]] = []

        class Recording:       # the engine itself, each stream() call recorded on its way in
            def stream(self, layer, ids):
                calls.append((layer, list(ids)))
                return vx.stream(layer, ids)

        model.experts = Recording()
        try:
            greedy_batch(model, [BatchRow(c, [t]) for c, t in zip(caches, firsts)])
        finally:
            model.experts = vx
        vx.finish()
        assert calls == [(layer, sorted(routed[layer])) for layer in cfg.moe_layers]
        assert any(len(ids) > cfg.num_experts_per_tok for _, ids in calls)    # a union, not one row's choice
        after = vx.snapshot()
        model.routing_hook = None
        asked = (after["hits"] + after["misses"]) - (before["hits"] + before["misses"])
        report("batch_streaming", steps=after["steps"] - before["steps"], asked=asked,
               union=sum(len(v) for v in routed.values()))
        assert after["steps"] - before["steps"] == len(cfg.moe_layers)
        assert asked == sum(len(v) for v in routed.values())
    finally:
        vx.close()
        vx.host.close()


@pytest.mark.parametrize("variant", ["f32", "int4"])
def test_replayed_batched_decode_steps_give_the_same_tokens(root, oracles, monkeypatch, variant):
    """COLI_BATCH_GRAPHS=1: pure decode steps of 3 then 2 rows replayed from CUDA graphs (a key per batch and cache
    shape: the short row leaving and a cache growing make new ones) give transformers' tokens (f32) and the numpy
    path's (int4)."""
    from coli.loader import load_model
    from coli.model.batch import batch_graphs
    monkeypatch.setenv("COLI_BATCH_GRAPHS", "1")
    src, _ = oracles["batch-topk"]
    o = load_oracle(src)
    opts = dict(experts="f32", dense="f32") if variant == "f32" else dict(experts="int4", dense="int8", group=64)
    d = container(root, src, f"batch-topk-{'f32' if variant == 'f32' else 'int8-g64'}", **opts)
    model, _ = load_model(d, "gpu")
    prompts = _prompts(o)[:3]
    n_new = [32, 32, 9]
    got = run_batch(model, prompts, n_new)
    dec = batch_graphs(model)
    report("batch_graphs", variant=variant, replays=dec.replays, captures=dec.captures, failed=dict(dec.failed),
           last_reason=dec.last_reason)
    assert dec.replays > 0 and dec.captures >= 2 and not dec.failed
    if variant == "f32":
        assert got[0] == o["greedy_tokens"]
        assert got[1] == o["continuation"]["greedy_tokens"]
        assert got[2] == greedy(model, prompts[2], 9)[0]
    else:
        cpu, _ = load_model(d, "cpu")
        assert got == run_batch(cpu, prompts, n_new)


def test_a_bad_batch_graphs_setting_fails_at_model_load(root, oracles, monkeypatch):
    from coli.errors import ColiError
    from coli.loader import load_model
    src, _ = oracles["batch-topk"]
    d = container(root, src, "batch-topk-f32", experts="f32", dense="f32")
    monkeypatch.setenv("COLI_BATCH_GRAPHS", "on")
    with pytest.raises(ColiError, match="COLI_BATCH_GRAPHS='on'"):
        load_model(d, "gpu")


class FixedRoutes:
    """A route override (as the benchmarks' trace replay): each token's experts a function of its layer and row."""

    def __init__(self, K, E):
        self.K, self.E = K, E

    def __call__(self, layer, n):
        idx = (np.arange(n * self.K).reshape(n, self.K) * 3 + layer) % self.E
        w = np.linspace(0.5, 1.5, n * self.K, dtype=np.float32).reshape(n, self.K)
        return idx.astype(np.int64), w


def test_replayed_batched_steps_with_a_forced_routing_equal_the_numpy_path(root, oracles, monkeypatch):
    from coli.loader import load_model
    from coli.model.batch import batch_graphs
    monkeypatch.setenv("COLI_BATCH_GRAPHS", "1")
    src, _ = oracles["batch-topk"]
    o = load_oracle(src)
    d = container(root, src, "batch-topk-f32", experts="f32", dense="f32")
    gpu, cfg = load_model(d, "gpu")
    cpu, _ = load_model(d, "cpu")
    for m in (gpu, cpu):
        m.route_override = FixedRoutes(cfg.num_experts_per_tok, cfg.n_routed_experts)
    prompts = _prompts(o)[:3]
    n_new = [20, 20, 20]
    g = run_batch(gpu, prompts, n_new)
    dec = batch_graphs(gpu)
    report("batch_graphs_forced", replays=dec.replays, captures=dec.captures, failed=dict(dec.failed))
    assert dec.replays > 0 and not dec.failed
    assert g == run_batch(cpu, prompts, n_new)
