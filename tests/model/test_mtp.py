"""MTP speculative decoding (coli.model.mtp): the MTP layer against a float64 torch re-implementation built on
transformers' own decoder layer; greedy tokens with drafts equal to those without (transformers' oracle tokens),
on f32 checkpoints and int4 containers; the KV caches after rollback equal a plain run's; the speculative-sampling
rule keeps the target distribution (statistical, fixed seed, bounds from the sample count)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from checkpoints import mtp_layer_tensors, torch_mtp_logits, with_mtp_layer
from coli_run import coli_run_json
from coli.container.writer import ConvertOptions, convert
from coli.generate import Generation
from coli.loader import load_model
from coli.model.mtp import (
    MtpUnavailable, SpeculativeDecoder, accept_greedy, accept_sampled, load_mtp_head, parse_mtp,
)
from coli.model.sampling import Sampler, SamplingParams
from oracles import load_oracle, oracle_dir


@pytest.fixture(scope="module")
def oracle_root(tmp_path_factory):
    return tmp_path_factory.mktemp("oracles")


@pytest.fixture(scope="module")
def mtp_oracle(oracle_root, tmp_path_factory):
    """The default transformers oracle with a random MTP layer added beside it."""
    src = oracle_dir(oracle_root, "default")
    return src, with_mtp_layer(src, tmp_path_factory.mktemp("mtp") / "default", seed=11)


def test_mtp_layer_matches_a_float64_torch_reimplementation(oracle_root, tmp_path):
    import torch
    from tolerances import reference_error_bound

    src = oracle_dir(oracle_root, "long-prompt")                     # 40 positions, index_topk 8: the indexer selects
    d = with_mtp_layer(src, tmp_path / "m", seed=3)
    prompt = load_oracle(src)["prompt_ids"]
    exact = torch_mtp_logits(d, prompt, torch.float64)
    ref32 = torch_mtp_logits(d, prompt, torch.float32)
    model, _ = load_model(d)
    head = load_mtp_head(model)
    hn, _ = model.forward_hidden(prompt, model.new_cache())
    got = head.step(prompt[1:], hn[:-1], head.new_cache(64))[1]
    bound = reference_error_bound(ref32, exact)
    err = float(np.abs(got.astype(np.float64) - exact).max())
    assert err <= bound, f"MTP logits off the float64 reference by {err:.3g} (bound {bound:.3g})"
    assert np.array_equal(got.argmax(-1), exact.argmax(-1))


@pytest.mark.parametrize("drafts", [1, 3, "auto"])
def test_greedy_tokens_with_mtp_equal_transformers(mtp_oracle, drafts):
    src, d = mtp_oracle
    o = load_oracle(src)
    model, _ = load_model(d)
    head = load_mtp_head(model)
    gen = Generation(model, o["prompt_ids"], 32, ignore_eos=True, mtp=(head, drafts))
    assert list(gen) == o["greedy_tokens"]
    s = gen.stats.mtp
    assert s["tokens"] >= 31 and s["rounds"] <= 31
    assert sum(s["drafted"]) > 0 or drafts == "auto"


def test_kv_caches_after_rollback_equal_a_plain_run(mtp_oracle):
    src, d = mtp_oracle
    o = load_oracle(src)
    model, _ = load_model(d)
    plain = model.new_cache()
    list(Generation(model, o["prompt_ids"], 20, ignore_eos=True, cache=plain))
    spec = model.new_cache()
    gen = Generation(model, o["prompt_ids"], 20, ignore_eos=True, cache=spec, mtp=(load_mtp_head(model), 3))
    assert list(gen) == o["greedy_tokens"][:20]
    assert spec.length == plain.length == len(o["prompt_ids"]) + 19
    # the same positions computed in another batching (one teacher-forced prefill) set the rounding scale: a stale
    # row of a rejected draft (another token) would be off by the values' own size, far beyond it
    from tolerances import reference_error_bound
    forced = model.new_cache()
    model.forward(o["prompt_ids"] + o["greedy_tokens"][:19], forced)
    assert forced.length == plain.length
    a, b, f = plain.host_arrays(), spec.host_arrays(), forced.host_arrays()
    assert a.keys() == b.keys() == f.keys()
    for k in a:   # rejected drafts' rows were written, then rolled back and overwritten by the accepted tokens
        bound = reference_error_bound(f[k], a[k])
        err = float(np.abs(b[k].astype(np.float64) - a[k]).max())
        assert err <= bound, f"{k}: the rolled-back cache differs by {err:.3g} (rounding scale {bound:.3g})"


def test_greedy_int4_container_with_mtp_equals_without(mtp_oracle, tmp_path):
    _, d = mtp_oracle
    c = tmp_path / "int4"
    convert(d, c, ConvertOptions(experts="int4", dense="int8", group=32))
    model, _ = load_model(c)
    prompt = [5, 9, 13, 2, 77, 3]
    want = list(Generation(model, prompt, 24, ignore_eos=True))
    head = load_mtp_head(model)
    for k in (1, 3):
        assert list(Generation(model, prompt, 24, ignore_eos=True, mtp=(head, k))) == want, k


def test_mtp_on_a_model_without_the_layer_says_so(oracle_root, mtp_oracle, tmp_path):
    model, _ = load_model(oracle_dir(oracle_root, "default"))
    with pytest.raises(MtpUnavailable, match=r"--mtp: .* cannot draft: the checkpoint has no MTP layer.*--mtp off"):
        load_mtp_head(model)
    c = tmp_path / "no-mtp"
    convert(mtp_oracle[1], c, ConvertOptions(experts="f32", dense="f32", mtp=False))
    model, _ = load_model(c)
    with pytest.raises(MtpUnavailable, match=r"converted with --no-mtp"):
        load_mtp_head(model)


def test_an_incomplete_mtp_layer_is_named(oracle_root, tmp_path):
    src = oracle_dir(oracle_root, "default")
    from coli.config import load_config
    t = mtp_layer_tensors(load_config(src))
    del t["model.layers.4.self_attn.o_proj.weight"]
    model, _ = load_model(with_mtp_layer(src, tmp_path / "m", tensors=t))
    with pytest.raises(MtpUnavailable, match=r"MTP layer 4 is incomplete: tensor 'model\.layers\.4\.self_attn\.o_proj"):
        load_mtp_head(model)


@pytest.mark.parametrize("text,want", [("off", None), ("on", 1), ("2", 2), ("3", 3), ("auto", "auto")])
def test_parse_mtp(text, want):
    assert parse_mtp(text) == want


@pytest.mark.parametrize("bad", ["4", "0.5", "fast", "-1"])
def test_parse_mtp_refuses_the_rest(bad):
    with pytest.raises(Exception, match=r"--mtp .* is not off, on, auto or a draft count 1\.\.3"):
        parse_mtp(bad)


def test_accept_greedy():
    assert accept_greedy([4, 5, 6], [4, 5, 6, 7]) == [4, 5, 6, 7]   # all kept, plus the bonus
    assert accept_greedy([4, 5, 6], [4, 9, 6, 7]) == [4, 9]         # second rejected: the target's token instead
    assert accept_greedy([4], [8, 1]) == [8]
    assert accept_greedy([], [3]) == [3]


def _within(counts: np.ndarray, probs: np.ndarray, n: int, z: float = 5.0) -> None:
    """Each outcome's count within z binomial standard deviations of n * p (z = 5: a false alarm per outcome
    has probability < 6e-7, so a fixed seed passing says nothing lucky; a wrong rule is off by far more)."""
    sd = np.sqrt(n * probs * (1 - probs))
    assert np.all(np.abs(counts - n * probs) <= z * sd + 1e-9), (counts / n, probs)


def test_speculative_sampling_keeps_the_target_distribution():
    rng = np.random.default_rng(0)
    p = [np.array([0.5, 0.3, 0.15, 0.05]), np.array([0.1, 0.2, 0.3, 0.4])]
    q = [np.array([0.1, 0.1, 0.4, 0.4])]              # a poor draft: most drafts are rejected
    n = 40000
    counts = np.zeros(4)
    for _ in range(n):
        d = int(rng.choice(4, p=q[0]))
        counts[accept_sampled([d], q, p, rng)[0]] += 1
    _within(counts, p[0], n)
    # the naive rule (keep the draft if the target's argmax agrees, else the target's argmax) would be far off
    assert abs(counts[0] / n - 0.5) < 0.02


def test_speculative_sampling_over_a_markov_chain_keeps_the_joint_distribution():
    """Three drafts per round over a 3-token Markov chain (target P[x] -> next, draft Q[x]): the joint law of the
    first three tokens after the start equals the chain's, counted over every one of the 27 sequences."""
    P = np.array([[0.6, 0.3, 0.1], [0.2, 0.2, 0.6], [0.3, 0.5, 0.2]])
    Q = np.array([[0.2, 0.5, 0.3], [0.3, 0.4, 0.3], [0.6, 0.2, 0.2]])
    rng = np.random.default_rng(1)
    n = 30000
    counts = np.zeros((3, 3, 3))
    for _ in range(n):
        seq = [0]
        while len(seq) < 4:
            drafts, qs, ctx = [], [], seq[-1]
            for _ in range(3):
                d = int(rng.choice(3, p=Q[ctx]))
                drafts.append(d)
                qs.append(Q[ctx])
                ctx = d
            ps = [P[x] for x in [seq[-1]] + drafts]
            seq += accept_sampled(drafts, qs, ps, rng)
        counts[seq[1], seq[2], seq[3]] += 1
    want = np.einsum("i,ij,jk->ijk", P[0], P, P)
    _within(counts.ravel(), want.ravel(), n)


def test_sampled_generation_with_mtp_is_seeded_and_valid(mtp_oracle):
    src, d = mtp_oracle
    o = load_oracle(src)
    model, _ = load_model(d)
    head = load_mtp_head(model)
    params = SamplingParams(greedy=False, temperature=0.8, top_k=20, seed=7)
    a = list(Generation(model, o["prompt_ids"], 16, params, ignore_eos=True, mtp=(head, 2)))
    b = list(Generation(model, o["prompt_ids"], 16, SamplingParams(greedy=False, temperature=0.8, top_k=20, seed=7),
                        ignore_eos=True, mtp=(head, 2)))
    assert a == b and len(a) == 16 and all(0 <= t < model.config.vocab_size for t in a)


def test_stats_count_acceptance_per_position(mtp_oracle):
    src, d = mtp_oracle
    o = load_oracle(src)
    model, _ = load_model(d)
    cache = model.new_cache()
    dec = SpeculativeDecoder(load_mtp_head(model), cache, Sampler(SamplingParams()), 3)
    out = [dec.prefill(o["prompt_ids"])]
    while len(out) < 20:
        out += dec.step(20 - len(out))
    assert out == o["greedy_tokens"][:20]
    s = dec.stats
    assert s.tokens == 19 and s.rounds >= 19 / 4
    assert s.drafted[0] >= s.drafted[1] >= s.drafted[2] and all(a <= r for a, r in zip(s.accepted, s.drafted))
    assert s.accepted[0] >= s.accepted[1] >= s.accepted[2]
    assert s.tokens == s.rounds + sum(s.accepted)
    assert math.isclose(s.tokens_per_step, 19 / s.rounds)
    json.dumps(s.to_dict())


def _coli(*args, timeout=180):
    import subprocess
    import sys
    return subprocess.run([sys.executable, "-m", "coli.cli.main", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)


def test_coli_run_mtp_on_3_auto_give_the_tokens_of_off(mtp_oracle):
    src, d = mtp_oracle
    o = load_oracle(src)
    prompt = ",".join(map(str, o["prompt_ids"]))
    runs = {}
    for mode in ("off", "on", "3", "auto"):
        r = _coli("run", "--model", d, "--prompt-ids", prompt, "-n", "32", "--ignore-eos", "--json", "--mtp", mode)
        assert r.returncode == 0, r.stderr
        runs[mode] = json.loads(r.stdout)
    for mode, j in runs.items():
        assert j["tokens"] == o["greedy_tokens"], mode
    assert "mtp" not in runs["off"]["stats"]
    assert runs["3"]["stats"]["mtp"]["drafts"] == 3 and len(runs["3"]["stats"]["mtp"]["acceptance_per_position"]) == 3
    human = _coli("run", "--model", d, "--prompt-ids", prompt, "-n", "8", "--mtp", "2")
    assert human.returncode == 0 and "[MTP 2:" in human.stderr and "tokens per step" in human.stderr


@pytest.mark.parametrize("fmt", ["f32", "int4"])
def test_coli_run_mtp_on_a_container_gives_the_tokens_without_it(mtp_oracle, tmp_path, fmt):
    """`coli run` on a container (what `coli convert` writes): lossless f32 gives transformers' tokens with --mtp on
    and --mtp 3; int4 experts with an int8 dense core give the tokens of --mtp off."""
    src, d = mtp_oracle
    o = load_oracle(src)
    c = tmp_path / fmt
    convert(d, c, ConvertOptions(experts=fmt, dense="f32" if fmt == "f32" else "int8", group=32))
    p = o["prompt_ids"]
    want = o["greedy_tokens"] if fmt == "f32" else coli_run_json(c, p, 32, "--mtp", "off")["tokens"]
    for mode, k in (("on", 1), ("3", 3)):
        j = coli_run_json(c, p, 32, "--mtp", mode)
        assert j["tokens"] == want, mode
        assert j["stats"]["mtp"]["drafts"] == k and sum(j["stats"]["mtp"]["drafted"]) > 0, j["stats"]["mtp"]


def test_coli_run_mtp_without_the_layer_is_a_clear_error(oracle_root):
    d = oracle_dir(oracle_root, "default")
    r = _coli("run", "--model", d, "--prompt-ids", "1,2,3", "-n", "4", "--mtp", "on")
    assert r.returncode == 2 and "--mtp" in r.stderr and "has no MTP layer" in r.stderr and "--mtp off" in r.stderr
    assert "Traceback" not in r.stderr
    r = _coli("run", "--model", d, "--prompt-ids", "1,2,3", "-n", "4", "--mtp", "7")
    assert r.returncode == 2 and "--mtp '7' is not off, on, auto or a draft count 1..3" in r.stderr


def _auto_choices(t_plain: float, t_draft: float, tokens_draft: int, rounds: int = 64) -> list[int]:
    from coli.model.mtp import AutoChoice
    auto, got = AutoChoice(explore=8), []
    for _ in range(rounds):
        k = auto.choose()
        got.append(k)
        auto.record(k, t_plain if k == 0 else t_draft, 1 if k == 0 else tokens_draft)
    return got


def test_auto_drafts_where_the_measured_round_pays_and_not_where_it_loses():
    # drafting: 2 tokens a round in 1.3 plain-step times (1.54 per step time): it drafts, re-measuring plain steps
    pays = _auto_choices(1.0, 1.3, 2)
    assert pays[:2] == [0, 1] and pays.count(1) >= 50 and pays.count(0) <= 10
    # the same acceptance at 2.2 step times (the verify step's expert union streams): plain steps, drafting re-measured
    loses = _auto_choices(1.0, 2.2, 2)
    assert loses.count(0) >= 50 and 1 <= loses.count(1) <= 10


@pytest.mark.parametrize("drafts", [1, 3])
def test_a_second_turn_drafts_from_the_first_turns_carry(mtp_oracle, drafts):
    """Two turns over one cache (a session): the second continues the MTP side from the first's MtpCarry and gives
    transformers' continuation tokens; without the carry it decodes without drafts, the same tokens."""
    src, d = mtp_oracle
    o = load_oracle(src)
    model, _ = load_model(d)
    head = load_mtp_head(model)
    cache = model.new_cache(8)
    first = Generation(model, o["prompt_ids"], 32, ignore_eos=True, cache=cache, mtp=(head, drafts))
    assert list(first) == o["greedy_tokens"] and first.mtp_carry is not None
    extra = o["continuation"]["extra_ids"]
    second = Generation(model, [o["greedy_tokens"][-1]] + extra, 32, ignore_eos=True, cache=cache,
                        mtp=(head, drafts, first.mtp_carry))
    assert list(second) == o["continuation"]["greedy_tokens"]
    assert second.stats.mtp["rounds"] > 0 and sum(second.stats.mtp["drafted"]) > 0
    # no carry: the turn runs without drafts (nothing to draft from), the same tokens
    cache2 = model.new_cache(8)
    list(Generation(model, o["prompt_ids"], 32, ignore_eos=True, cache=cache2))
    plain = Generation(model, [o["greedy_tokens"][-1]] + extra, 32, ignore_eos=True, cache=cache2, mtp=(head, drafts))
    assert list(plain) == o["continuation"]["greedy_tokens"] and plain.stats.mtp is None


def test_a_carry_survives_a_turn_stopped_inside_a_round_and_a_cache_cut_back(mtp_oracle):
    src, d = mtp_oracle
    o = load_oracle(src)
    model, _ = load_model(d)
    head = load_mtp_head(model)
    seq = o["prompt_ids"] + o["greedy_tokens"]
    cache = model.new_cache()
    g = Generation(model, o["prompt_ids"], 7, ignore_eos=True, cache=cache, mtp=(head, 3))   # stops mid-round
    assert list(g) == o["greedy_tokens"][:7]
    cache.truncate(len(o["prompt_ids"]) + 3)          # a session cut back to a shorter common prefix
    n = cache.length
    g2 = Generation(model, seq[n:n + 1], 20, ignore_eos=True, cache=cache, mtp=(head, 3, g.mtp_carry))
    assert list(g2) == o["greedy_tokens"][n - len(o["prompt_ids"]) + 1:][:20]
    assert g2.stats.mtp is not None and sum(g2.stats.mtp["drafted"]) > 0      # it drafted from the carry
