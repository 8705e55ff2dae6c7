"""The numpy engine against transformers' reference, computed in this test run: greedy tokens
identical for 32 new tokens, logits within 1e-4 of the logit scale."""

import json
import subprocess
import sys

import numpy as np
import pytest

from coli.generate import Generation
from coli.loader import load_model
from oracles import ORACLE_CONFIGS, assert_logits_close, load_oracle, oracle_dir


@pytest.fixture(scope="module")
def oracle_root(tmp_path_factory):
    return tmp_path_factory.mktemp("oracles")


@pytest.mark.parametrize("name", list(ORACLE_CONFIGS))
def test_greedy_tokens_and_logits_match_transformers(oracle_root, name):
    d = oracle_dir(oracle_root, name)
    o = load_oracle(d)
    model, cfg = load_model(d)
    n = len(o["greedy_tokens"])
    assert n == 32
    toks = list(Generation(model, o["prompt_ids"], n, ignore_eos=True))
    assert toks == o["greedy_tokens"]
    # teacher-forced logits of every generated step in one prefill call
    cache = model.new_cache()
    seq = o["prompt_ids"] + o["greedy_tokens"][:-1]
    logits = model.forward(seq, cache, all_logits=True)[len(o["prompt_ids"]) - 1:]
    assert_logits_close(logits, o["logits"], exact=o["logits_f64"])


def test_second_generation_continues_the_first_with_the_cache(oracle_root):
    d = oracle_dir(oracle_root, "default")
    o = load_oracle(d)
    model, _ = load_model(d)
    cache = model.new_cache(8)  # small on purpose: the cache must grow while in use
    first = list(Generation(model, o["prompt_ids"], 32, ignore_eos=True, cache=cache))
    assert first == o["greedy_tokens"]
    assert cache.length == len(o["prompt_ids"]) + 31  # the last sampled token is not fed yet
    extra = o["continuation"]["extra_ids"]
    second = list(Generation(model, [first[-1]] + extra, 32, ignore_eos=True, cache=cache))
    assert second == o["continuation"]["greedy_tokens"]


def test_decode_logits_step_by_step_match(oracle_root):
    d = oracle_dir(oracle_root, "long-prompt")
    o = load_oracle(d)
    model, _ = load_model(d)
    cache = model.new_cache()
    got = [model.forward(o["prompt_ids"], cache)[-1]]
    for t in o["greedy_tokens"][:-1]:
        got.append(model.forward([t], cache)[-1])
    assert_logits_close(np.stack(got), o["logits"], exact=o["logits_f64"])


def test_coli_run_json_cli(oracle_root):
    d = oracle_dir(oracle_root, "groups")
    o = load_oracle(d)
    ids = ",".join(map(str, o["prompt_ids"]))
    r = subprocess.run([sys.executable, "-m", "coli.cli.main", "run", "--model", str(d), "--prompt-ids", ids,
                        "--max-tokens", "32", "--greedy", "--ignore-eos", "--json"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["tokens"] == o["greedy_tokens"] and out["finish_reason"] == "length"
