"""MTP speculative decoding on the GPU (CUDA backend, whole model resident, the MTP layer's experts too): greedy tokens
with drafts equal transformers' on an f32 container of an oracle with an MTP layer added, and the numpy backend's on
an int4 container; the MTP layer's logits equal the numpy backend's within the float32 bound of its size; a verify
row sharing batched steps (coli.model.batch.forward_batch_hidden) with plain rows gives every sequence its solo
tokens; `coli run --device gpu --mtp on|3` gives the tokens without MTP (f32: transformers'; int4: `--mtp off`'s,
experts resident and streamed through a few VRAM slots); one-draft rounds replayed from CUDA graphs give the tokens of
eager ones. Through the stage processes: test_gpu_mtp_stages.py."""

from __future__ import annotations

import numpy as np
import pytest

from checkpoints import with_mtp_layer
from coli_run import coli_run_json
from gpu_helpers import container
from oracles import load_oracle, oracle_dir

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("gpu-mtp")


@pytest.fixture(scope="module")
def src(root):
    o = oracle_dir(root, "default")
    return o, with_mtp_layer(o, root / "with-mtp", seed=17)


@pytest.mark.parametrize("drafts", [1, 3, "auto"])
def test_gpu_greedy_tokens_with_mtp_match_transformers(root, src, drafts):
    from coli.generate import Generation
    from coli.loader import load_model
    from coli.model.mtp import load_mtp_head

    o = load_oracle(src[0])
    d = container(root, src[1], "f32", experts="f32", dense="f32")
    model, _ = load_model(d, "gpu")
    assert model.backend.name == "cuda"
    gen = Generation(model, o["prompt_ids"], 32, ignore_eos=True, mtp=(load_mtp_head(model), drafts))
    assert list(gen) == o["greedy_tokens"]


def test_gpu_mtp_layer_logits_match_a_float64_reference(root, src):
    """The MTP layer's logits on the GPU (and the numpy backend) against transformers' decoder layer in float64
    (checkpoints.torch_mtp_logits), within the float32 bound that the same layer in torch float32 sets."""
    import torch
    from checkpoints import torch_mtp_logits
    from coli.loader import load_model
    from coli.model.mtp import load_mtp_head
    from tolerances import reference_error_bound

    o = load_oracle(src[0])
    prompt = o["prompt_ids"]
    exact = torch_mtp_logits(src[1], prompt, torch.float64)                  # [n-1, V]
    bound = reference_error_bound(torch_mtp_logits(src[1], prompt, torch.float32), exact)
    d = container(root, src[1], "f32", experts="f32", dense="f32")
    for dev in ("cpu", "gpu"):
        model, _ = load_model(d, dev)
        head = load_mtp_head(model)
        hn, _ = model.forward_hidden(prompt, model.new_cache())
        n = len(prompt)
        _, logits = head.step(prompt[1:], model.backend.rows(hn, n - 1), head.new_cache(64))
        got = np.asarray(model.backend.to_host(logits), np.float64)
        err = float(np.abs(got - exact).max())
        assert err <= bound, f"{dev}: MTP logits off the float64 reference by {err:.3g} (bound {bound:.3g})"
        assert np.array_equal(got.argmax(-1), exact.argmax(-1)), dev


def test_gpu_int4_container_with_mtp_equals_numpy(root, src):
    from coli.generate import Generation
    from coli.loader import load_model
    from coli.model.mtp import load_mtp_head

    d = container(root, src[1], "int4", experts="int4", dense="int8", group=32)
    prompt = [5, 9, 13, 2, 77, 3]
    cpu, _ = load_model(d, "cpu")
    want = list(Generation(cpu, prompt, 24, ignore_eos=True))
    model, _ = load_model(d, "gpu")
    head = load_mtp_head(model)
    plain = list(Generation(model, prompt, 24, ignore_eos=True))
    for k in (1, 3):
        got = list(Generation(model, prompt, 24, ignore_eos=True, mtp=(head, k)))
        assert got == plain, k
    assert plain == want


@pytest.mark.parametrize("drafts", [1, 3])
def test_gpu_batched_verify_row_beside_plain_rows_gives_each_sequence_its_solo_tokens(root, src, drafts):
    from coli.generate import Generation
    from coli.loader import load_model
    from coli.model.sampling import SamplingParams
    from stages_helpers import verify_row_beside_plain_rows

    o = load_oracle(src[0])
    model, _ = load_model(container(root, src[1], "f32", experts="f32", dense="f32"), "gpu")
    assert model.backend.name == "cuda"
    p = o["prompt_ids"]

    def alone(prompt, n, params=None):
        return list(Generation(model, prompt, n, params or SamplingParams(), ignore_eos=True))

    got = verify_row_beside_plain_rows(model, p, drafts)
    assert got["shared"] > 3                                   # the verify row did share steps with the others
    assert got["mtp"] == o["greedy_tokens"][:30]               # transformers' tokens, drafted in a batch
    assert got["plain"] == alone(p[3:15], 20)
    assert got["sampled"] == alone(p[1:9], 18, SamplingParams(False, 0.8, 0.9, 20, 99))
    assert got["stats"].drafted[drafts - 1] > 0


@pytest.mark.parametrize("fmt,vram", [("f32", ()), ("int4", ()), ("int4", ("--vram-slots", "6"))])
def test_gpu_coli_run_mtp_on_and_3_give_the_tokens_without_it(root, src, fmt, vram):
    o = load_oracle(src[0])
    if fmt == "f32":
        d = container(root, src[1], "f32", experts="f32", dense="f32")
    else:
        d = container(root, src[1], "int4", experts="int4", dense="int8", group=32)
    p = o["prompt_ids"]
    gpu = ("--device", "gpu", *vram)
    want = o["greedy_tokens"] if fmt == "f32" else coli_run_json(d, p, 32, *gpu, "--mtp", "off")["tokens"]
    for mode, k in (("on", 1), ("3", 3)):
        j = coli_run_json(d, p, 32, *gpu, "--mtp", mode)
        assert j["tokens"] == want, mode
        assert j["stats"]["mtp"]["drafts"] == k and sum(j["stats"]["mtp"]["drafted"]) > 0, j["stats"]["mtp"]
        assert ("vram" in j) == bool(vram)                       # streamed through the VRAM cache where asked


@pytest.mark.parametrize("choice", ["resident", "upload"])
def test_gpu_mtp_experts_resident_or_uploaded_under_the_budget_give_the_tokens_without_mtp(root, src, choice):
    """The MTP layer's experts paid from the VRAM budget (coli.gpu.setup.plan_mtp): resident, or uploaded from the
    container on each draft (COLI_MTP_EXPERTS forces the share rule's choice); either way `coli run --mtp on|3`
    gives `--mtp off`'s tokens, and the run says where they lived."""
    o = load_oracle(src[0])
    d = container(root, src[1], "int4", experts="int4", dense="int8", group=32)
    p = o["prompt_ids"]
    gpu = ("--device", "gpu", "--vram-slots", "6")
    want = coli_run_json(d, p, 24, *gpu, "--mtp", "off")["tokens"]
    for mode in ("on", "3"):
        j = coli_run_json(d, p, 24, *gpu, "--mtp", mode, env={"COLI_MTP_EXPERTS": choice})
        assert j["tokens"] == want, (choice, mode)
        assert j["vram"]["mtp_experts"] == choice
        assert sum(j["stats"]["mtp"]["drafted"]) > 0


def test_gpu_mtp_rounds_replay_from_graphs_with_the_tokens_of_eager_rounds(monkeypatch):
    """Greedy one-draft rounds replay one CUDA graph each (coli/gpu/mtp_graphs.py) on the demo model (its trained
    head keeps drafts, so both the accept and the reject path replay): the tokens of decoding without MTP, and of
    the eager rounds (COLI_MTP_GRAPHS=0)."""
    from pathlib import Path

    from coli.chat_template import load_chat_template
    from coli.generate import Generation
    from coli.loader import load_model
    from coli.model.mtp import load_mtp_head
    from coli.tokenizer import load_tokenizer

    demo = Path(__file__).resolve().parents[2] / "coli" / "demo" / "model"
    tok, tpl = load_tokenizer(demo), load_chat_template(demo)
    ids = tok.encode(tpl.render([{"role": "user", "content": "What does mimetypes.guess_type do?"}]))
    model, _ = load_model(demo, "gpu")
    want = list(Generation(model, ids, 48, ignore_eos=True))
    head = load_mtp_head(model)
    assert head.rounds is not None
    gen = Generation(model, ids, 48, ignore_eos=True, mtp=(head, 1))
    assert list(gen) == want
    assert head.rounds.replays > 0 and head.rounds.captures >= 1, head.rounds.last_reason
    s = gen.stats.mtp
    assert 0 < s["accepted"][0] < s["drafted"][0]
    again = Generation(model, ids, 48, ignore_eos=True, mtp=(head, 1))      # the graphs of the first, replayed
    assert list(again) == want
    monkeypatch.setenv("COLI_MTP_GRAPHS", "0")
    eager = load_mtp_head(model)
    assert eager.rounds is None
    assert list(Generation(model, ids, 48, ignore_eos=True, mtp=(eager, 1))) == want
