"""End to end on the GPU, whole model resident: tiny GLM-5 oracles built by transformers in this run (seeds the
other tests never use), converted to containers.

- f32 containers: the GPU's greedy tokens (argmax taken on the GPU) equal transformers' exactly, logits
  within 1e-4 of the logit scale, and a second turn continues from the cache.
- int4 containers: the GPU's greedy tokens equal the numpy backend's over 32 steps on the same container;
  a divergence is accepted only at an argmax near-tie, and is reported.
"""

from __future__ import annotations

import numpy as np
import pytest

from gpu_helpers import build_fresh_oracles, report
from oracles import assert_logits_close, load_oracle

pytestmark = pytest.mark.gpu

# Fresh seeds (tests/oracles.py uses 3, 5, 7): the first safe seed from each base is taken.
FRESH = {
    "default": (101, {}),
    "shared-indexer": (201, {"indexer_pattern": "FFSS"}),
    "groups": (301, {"n_group": 4, "topk_group": 2}),
    "long-prompt": (401, {"prompt_len": 40, "index_topk": 8}),
}
def container(root, src, name, **opts):
    from coli.container.writer import ConvertOptions, convert
    dst = root / name
    if not dst.exists():
        convert(src, dst, ConvertOptions(**opts))
    return dst


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("gpu-oracles")


@pytest.fixture(scope="module")
def oracles(root):
    return build_fresh_oracles(root, FRESH)      # transformers, in this run, in parallel


def greedy(model, prompt, n, cache=None):
    cache = cache if cache is not None else model.new_cache()
    toks = [model.greedy(prompt, cache)]
    while len(toks) < n:
        toks.append(model.greedy([toks[-1]], cache))
    return toks, cache


@pytest.mark.parametrize("name", list(FRESH))
def test_gpu_greedy_tokens_match_transformers_on_f32_containers(root, oracles, name):
    from coli.loader import load_model
    src, seed = oracles[name]
    o = load_oracle(src)
    d = container(root, src, f"{name}-f32", experts="f32", dense="f32")
    model, cfg = load_model(d, "gpu")
    assert model.backend.name == "cuda"
    n = len(o["greedy_tokens"])
    toks, cache = greedy(model, o["prompt_ids"], n)
    # teacher-forced logits of every generated step in one prefill
    c2 = model.new_cache()
    seq = o["prompt_ids"] + o["greedy_tokens"][:-1]
    logits = model.forward(seq, c2, all_logits=True)[len(o["prompt_ids"]) - 1:]
    diff = float(np.abs(logits - o["logits"]).max())
    # the second turn continues from the cache: prefill [last token] + extra ids after 31 cached steps
    extra = o["continuation"]["extra_ids"]
    second, _ = greedy(model, [toks[-1]] + extra, len(o["continuation"]["greedy_tokens"]), cache=cache)
    report("e2e_f32", oracle=name, seed=seed, steps=n, tokens_equal=toks == o["greedy_tokens"],
           continuation_equal=second == o["continuation"]["greedy_tokens"], max_logit_diff=diff,
           logit_scale=float(np.abs(o["logits"]).max()))
    assert toks == o["greedy_tokens"]
    assert second == o["continuation"]["greedy_tokens"]
    assert_logits_close(logits, o["logits"])


def test_gpu_from_the_checkpoint_directory(oracles):
    """A Hugging Face checkpoint (no container) on the GPU: f32 weights uploaded as one-tile matrices."""
    from coli.loader import load_model
    src, _ = oracles["default"]
    o = load_oracle(src)
    model, _ = load_model(src, "gpu")
    toks, _ = greedy(model, o["prompt_ids"], len(o["greedy_tokens"]))
    assert toks == o["greedy_tokens"]


INT4 = {
    "int4-g64-dense-int8": dict(experts="int4", dense="int8", group=64),
    "int4-g32-dense-int4": dict(experts="int4", dense="int4", group=32),
    "int4-g128-dense-bf16": dict(experts="int4", dense="bf16", group=128),
}


@pytest.mark.parametrize("oracle", ["default", "long-prompt"])
@pytest.mark.parametrize("variant", list(INT4))
def test_int4_container_gpu_tokens_equal_numpy_tokens(root, oracles, oracle, variant):
    from coli.loader import load_model
    src, seed = oracles[oracle]
    o = load_oracle(src)
    d = container(root, src, f"{oracle}-{variant}", **INT4[variant])
    steps = 32
    gpu, _ = load_model(d, "gpu")
    cpu, _ = load_model(d, "cpu")
    g_toks, _ = greedy(gpu, o["prompt_ids"], steps)
    c_toks, _ = greedy(cpu, o["prompt_ids"], steps)
    first = next((i for i, (a, b) in enumerate(zip(g_toks, c_toks)) if a != b), None)
    info = dict(oracle=oracle, seed=seed, variant=variant, steps=steps, equal=first is None,
                agree_steps=steps if first is None else first)
    if first is not None:
        # trace the divergence: both paths see the same prefix; the two tokens must be an argmax near-tie
        prefix = o["prompt_ids"] + c_toks[:first]
        lc = cpu.forward(prefix, cpu.new_cache())[-1]
        lg = gpu.forward(prefix, gpu.new_cache())[-1]
        a, b = c_toks[first], g_toks[first]
        gap_cpu = float(lc[a] - lc[b])
        gap_gpu = float(lg[b] - lg[a])
        scale = float(np.abs(lc).max())
        info.update(first_divergence=first, numpy_token=a, gpu_token=b, numpy_gap=gap_cpu, gpu_gap=gap_gpu,
                    logit_scale=scale, max_logit_diff=float(np.abs(lc - lg).max()))
        report("int4_agreement", **info)
        assert gap_cpu <= 1e-4 * scale and gap_gpu <= 1e-4 * scale, f"divergence is not a near-tie: {info}"
    else:
        report("int4_agreement", **info)
