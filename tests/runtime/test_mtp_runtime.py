"""MTP through the stage processes: the batched executor does not draft yet, so a request asking for MTP is a
`bad_request` saying so (never silently decoded without), `"off"` is served as usual, and the run goes on; the HTTP
body field `"mtp"` is parsed and checked by the gateway."""

from __future__ import annotations

import pytest

from checkpoints import with_mtp_layer
from coli.serve.client import Client, RequestError
from oracles import load_oracle, oracle_dir


@pytest.fixture(scope="module")
def mtp_model(oracle_root, tmp_path_factory):
    src = oracle_dir(oracle_root, "default")
    return src, with_mtp_layer(src, tmp_path_factory.mktemp("rt-mtp") / "default-mtp", seed=11)


def test_a_request_for_mtp_is_refused_by_the_batched_executor_and_the_run_goes_on(start_run, mtp_model):
    src, d = mtp_model
    o = load_oracle(src)
    run = start_run(d)
    with Client(run.name, base=str(run.run_base)) as c:
        for mode in ("on", "3", "auto"):
            with pytest.raises(RequestError, match=r"does not draft with the MTP head yet; `coli run --mtp` does"):
                c.generate(o["prompt_ids"], 8, greedy=True, mtp=mode)
        assert c.generate(o["prompt_ids"], 32, greedy=True, ignore_eos=True, mtp="off").tokens == o["greedy_tokens"]
        assert c.generate(o["prompt_ids"], 32, greedy=True, ignore_eos=True).tokens == o["greedy_tokens"]


def test_a_bad_mtp_value_is_refused_by_the_client_before_it_is_sent():
    from coli.protocol.messages import GenerateRequest
    with pytest.raises(ValueError, match=r"mtp must be one of off, on, auto, 1, 2, 3"):
        GenerateRequest("r1", [1, 2], 4, 1.0, 1.0, 0, None, True, False, mtp="fast")


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
