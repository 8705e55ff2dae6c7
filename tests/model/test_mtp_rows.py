"""MTP rounds in their fixed shape (coli.model.mtp.row_round, what coli/gpu/mtp_graphs.py replays as one CUDA graph):
the verify step as one-position rows of one cache (coli.model.batch.forward_rows) and the MTP catch-up over both
verified rows. Checked on the numpy backend, the same code the GPU captures: the values against the other ways of
batching the same positions, greedy tokens against transformers' oracle, the caches after the rounds against a
plain run, and the hand-over between row rounds and the eager rounds (a plain step, the last token of max_tokens,
a second turn)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from checkpoints import with_mtp_layer
from coli.generate import Generation
from coli.loader import load_model
from coli.model.batch import forward_rows
from coli.model.mtp import EagerRowRounds, SpeculativeDecoder, load_mtp_head
from coli.model.sampling import Sampler, SamplingParams
from oracles import load_oracle, oracle_dir
from tolerances import reference_error_bound

DEMO = Path(__file__).resolve().parents[2] / "coli" / "demo" / "model"


@pytest.fixture(scope="module")
def mtp_oracle(tmp_path_factory):
    src = oracle_dir(tmp_path_factory.mktemp("oracles"), "default")
    return src, with_mtp_layer(src, tmp_path_factory.mktemp("mtp") / "default", seed=11)


def _row_head(model):
    head = load_mtp_head(model)
    head.rounds = EagerRowRounds(head)
    return head


def test_forward_rows_is_the_verify_step_in_rows(mtp_oracle):
    src, d = mtp_oracle
    o = load_oracle(src)
    model, _ = load_model(d)
    b = model.backend
    prompt, nxt = o["prompt_ids"], o["greedy_tokens"][:3]
    rows_c, pre_c, one_c = model.new_cache(), model.new_cache(), model.new_cache()
    for c in (rows_c, pre_c, one_c):
        model.forward(prompt, c)
    _, logits = forward_rows(model, rows_c, nxt)                         # [3, V]
    assert rows_c.length == len(prompt) + 3
    _, lp = model.forward_hidden(nxt, pre_c)                            # one prefill of the 3 positions
    one = np.concatenate([model.forward([t], one_c) for t in nxt])       # three decode steps
    got, pre = b.to_host(logits), b.to_host(lp)
    assert list(got.argmax(-1)) == o["greedy_tokens"][1:4]
    # the prefill and the decode steps batch the same positions two other ways: their difference is the scale
    bound = reference_error_bound(pre, one)
    assert float(np.abs(got.astype(np.float64) - one).max()) <= bound
    for k, v in rows_c.host_arrays().items():
        want = one_c.host_arrays()[k]
        assert float(np.abs(v.astype(np.float64) - want).max()) <= reference_error_bound(pre_c.host_arrays()[k], want)


def test_forward_rows_refuses_a_bad_token_before_touching_the_cache(mtp_oracle):
    _, d = mtp_oracle
    model, _ = load_model(d)
    cache = model.new_cache()
    model.forward([1, 2, 3], cache)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        forward_rows(model, cache, [4, model.config.vocab_size])
    with pytest.raises(ValueError, match="at least one"):
        forward_rows(model, cache, [])
    assert cache.length == 3


def test_step_rows_is_the_mtp_step_in_rows(mtp_oracle):
    _, d = mtp_oracle
    model, _ = load_model(d)
    head = load_mtp_head(model)
    b = model.backend
    ids = [7, 3, 11, 5, 9, 2]
    cache = model.new_cache()
    hn, _ = model.forward_hidden(ids, cache)
    outs = {}
    for how in ("step", "step_rows", "one_by_one"):
        mc = head.new_cache(16)
        head.step(ids[1:4], b.rows(hn, 3), mc)                       # 3 positions cached first
        if how == "one_by_one":
            h_host = b.to_host(hn)
            parts = [b.to_host(head.step([ids[4 + j]], b.upload(h_host[3 + j:4 + j]), mc)[1]) for j in range(2)]
            outs[how] = np.concatenate(parts)
        else:
            h2 = b.upload(b.to_host(hn)[3:5])
            outs[how] = b.to_host(getattr(head, how)(ids[4:6], h2, mc)[1])
        assert mc.length == 5
    bound = reference_error_bound(outs["step"], outs["one_by_one"])
    assert float(np.abs(outs["step_rows"].astype(np.float64) - outs["one_by_one"]).max()) <= bound


def test_greedy_tokens_with_row_rounds_equal_transformers_and_the_caches_a_plain_run(mtp_oracle):
    src, d = mtp_oracle
    o = load_oracle(src)
    model, _ = load_model(d)
    head = _row_head(model)
    plain, spec = model.new_cache(), model.new_cache()
    list(Generation(model, o["prompt_ids"], 21, ignore_eos=True, cache=plain))
    gen = Generation(model, o["prompt_ids"], 21, ignore_eos=True, cache=spec, mtp=(head, 1))
    assert list(gen) == o["greedy_tokens"][:21]
    s = gen.stats.mtp
    assert s["drafted"][0] == s["rounds"] - s["plain_rounds"] and s["drafted"][0] > 0   # (random head: few kept)
    assert spec.length == plain.length == len(o["prompt_ids"]) + 20
    forced = model.new_cache()
    model.forward(o["prompt_ids"] + o["greedy_tokens"][:20], forced)
    a, b, f = plain.host_arrays(), spec.host_arrays(), forced.host_arrays()
    for k in a:
        assert float(np.abs(b[k].astype(np.float64) - a[k]).max()) <= reference_error_bound(f[k], a[k]), k


def test_row_rounds_draft_what_the_eager_rounds_draft(mtp_oracle):
    """The same drafts and acceptance, round for round, as the verify-step + catch-up rounds (the MTP layer sees
    the same pairs; only the batching of its attention differs)."""
    src, d = mtp_oracle
    o = load_oracle(src)
    model, _ = load_model(d)
    stats = []
    for head in (load_mtp_head(model), _row_head(model)):
        g = Generation(model, o["prompt_ids"], 24, ignore_eos=True, mtp=(head, 1))
        assert list(g) == o["greedy_tokens"][:24]
        stats.append((g.stats.mtp["rounds"], g.stats.mtp["accepted"]))
    assert stats[0] == stats[1]


@pytest.fixture(scope="module")
def demo():
    """The demo model and its trained head (drafts are kept often: both the accept and the reject path run)."""
    from coli.chat_template import load_chat_template
    from coli.tokenizer import load_tokenizer
    model, _ = load_model(DEMO)
    tok, tpl = load_tokenizer(DEMO), load_chat_template(DEMO)
    ids = tok.encode(tpl.render([{"role": "user", "content": "What does mimetypes.guess_type do?"}]))  # held out
    return model, ids, list(Generation(model, ids, 40, ignore_eos=True))


def test_demo_row_rounds_give_the_tokens_without_and_keep_drafts(demo):
    model, ids, want = demo
    gen = Generation(model, ids, 40, ignore_eos=True, mtp=(_row_head(model), 1))
    assert list(gen) == want
    s = gen.stats.mtp
    assert 0 < s["accepted"][0] < s["drafted"][0]       # both paths of a round: d_1 kept and rejected


def test_row_rounds_hand_over_to_plain_steps_and_eager_rounds(demo):
    """After a row round d_1 is drafted and nothing waits: a plain step (room for one token), then a round through
    begin_round/end_round (the stages' way), then row rounds again -- every token the plain decode's."""
    model, ids, want = demo
    cache = model.new_cache()
    dec = SpeculativeDecoder(_row_head(model), cache, Sampler(SamplingParams(temperature=0.0)), 1)
    toks = [dec.prefill(ids)]
    toks += dec.step(3)                       # a row round
    assert dec.ready is not None and dec.pending_h is None
    toks += dec.step(1)                       # one token of room: a plain step drops the ready draft
    assert dec.ready is None
    toks += dec.step(3)                       # a row round again (catches up first)
    assert dec.ready is not None
    rid = dec.begin_round(3)                  # an eager round uses the ready draft
    assert len(rid) == 2 and dec.ready is None
    hn, logits = model.forward_hidden(rid, cache)
    toks += dec.end_round(hn, logits)
    while len(toks) < 30:
        toks += dec.step(30 - len(toks))
    assert toks == want[:len(toks)] and len(toks) == 30
    assert cache.length == len(ids) + len(toks) - 1
    assert dec.stats.accepted[0] > 0


def test_a_second_turn_after_row_rounds_drafts_from_the_carry(mtp_oracle):
    src, d = mtp_oracle
    o = load_oracle(src)
    model, _ = load_model(d)
    head = _row_head(model)
    cache = model.new_cache(8)
    first = Generation(model, o["prompt_ids"], 32, ignore_eos=True, cache=cache, mtp=(head, 1))
    assert list(first) == o["greedy_tokens"] and first.mtp_carry is not None
    extra = o["continuation"]["extra_ids"]
    second = Generation(model, [o["greedy_tokens"][-1]] + extra, 32, ignore_eos=True, cache=cache,
                        mtp=(head, 1, first.mtp_carry))
    assert list(second) == o["continuation"]["greedy_tokens"]
    assert second.stats.mtp["drafted"][0] > 0
