"""`coli up --mtp` and the per-request `mtp` field: MTP speculative decoding through the stage processes gives the
tokens transformers gives (the oracle's greedy tokens), for the run's default and per request; a run asked to draft
with a model that has no MTP layer is refused before any stage starts; the HTTP body field is checked."""

from __future__ import annotations

import pytest

from checkpoints import with_mtp_layer
from coli.serve.client import Client
from harness import assert_run_gone
from oracles import load_oracle, oracle_dir


@pytest.fixture(scope="module")
def mtp_model(oracle_root, tmp_path_factory):
    src = oracle_dir(oracle_root, "default")
    return src, with_mtp_layer(src, tmp_path_factory.mktemp("rt-mtp") / "default-mtp", seed=11)


def test_up_mtp_gives_the_oracle_tokens_by_default_and_per_request(start_run, mtp_model):
    src, d = mtp_model
    o = load_oracle(src)
    run = start_run(d, args=("--mtp", "3"))
    with Client(run.name, base=str(run.run_base)) as c:
        r = c.generate(o["prompt_ids"], 32, greedy=True, ignore_eos=True)       # the run's --mtp 3
        assert r.tokens == o["greedy_tokens"]
        assert r.timing["mtp_rounds"] >= 1 and r.timing["mtp_tokens_per_step"] >= 1.0
        off = c.generate(o["prompt_ids"], 32, greedy=True, ignore_eos=True, mtp="off")
        assert off.tokens == o["greedy_tokens"] and "mtp_rounds" not in off.timing
        two = c.generate(o["prompt_ids"], 32, greedy=True, ignore_eos=True, mtp="2")
        assert two.tokens == o["greedy_tokens"] and two.timing["mtp_rounds"] >= 1


def test_a_sessions_second_turn_drafts_and_gives_the_oracle_continuation(start_run, mtp_model):
    src, d = mtp_model
    o = load_oracle(src)
    run = start_run(d, args=("--mtp", "2"))
    with Client(run.name, base=str(run.run_base)) as c:
        t1 = c.generate(o["prompt_ids"], 32, greedy=True, ignore_eos=True, session="s", new_session=True)
        assert t1.tokens == o["greedy_tokens"] and t1.timing["mtp_rounds"] >= 1
        p2 = o["prompt_ids"] + t1.tokens + o["continuation"]["extra_ids"]
        t2 = c.generate(p2, 32, greedy=True, ignore_eos=True, session="s")
        assert t2.tokens == o["continuation"]["greedy_tokens"]
        assert t2.timing["reused_tokens"] == len(o["prompt_ids"]) + 31   # the session's cache, and ...
        assert t2.timing["mtp_rounds"] >= 1                                # ... drafts from its MTP carry


def test_up_mtp_on_a_model_without_the_layer_is_refused_before_it_starts(start_run, oracle_root):
    run = start_run(oracle_dir(oracle_root, "default"), args=("--mtp", "on"), wait=False)
    assert run.proc.wait(timeout=120) == 2
    out = run.output()
    assert "--mtp on:" in out and "has no MTP layer" in out and "--mtp off" in out and "Traceback" not in out
    assert_run_gone(run)


def test_a_request_for_mtp_on_a_run_without_the_layer_is_a_bad_request(start_run, default_oracle):
    from coli.serve.client import RequestError
    o = load_oracle(default_oracle)
    run = start_run(default_oracle)
    with Client(run.name, base=str(run.run_base)) as c:
        with pytest.raises(RequestError, match=r"cannot draft: .*has no MTP layer"):
            c.generate(o["prompt_ids"], 4, greedy=True, mtp="on")
        assert c.generate(o["prompt_ids"], 32, greedy=True, ignore_eos=True).tokens == o["greedy_tokens"]


@pytest.mark.parametrize("value,want", [("on", "on"), ("AUTO", "auto"), (2, "2"), ("3", "3"), (0, "off"),
                                        (False, "off"), (True, "on"), (None, None)])
def test_http_body_mtp_field(value, want):
    from coli.serve.openai_api import parse_params
    body = {"prompt": "x"} if value is None else {"prompt": "x", "mtp": value}
    assert parse_params(body).mtp == want


@pytest.mark.parametrize("value", ["fast", 4, -1, 1.5, ["on"]])
def test_http_body_mtp_field_refuses_the_rest(value):
    from coli.serve.openai_api import ApiError, parse_params
    with pytest.raises(ApiError, match=r"'mtp' must be one of off, on, auto, 1, 2, 3"):
        parse_params({"prompt": "x", "mtp": value})
