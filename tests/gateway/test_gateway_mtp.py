"""MTP over HTTP (a real `coli serve` beside a run of the demo model, whose container keeps its trained MTP head):
the body field "mtp" gives the same token ids as without it; a bad value is a 400 naming 'mtp'; `coli serve --mtp`
sets it for requests without the field, and a bad `--mtp` is refused before anything listens."""

from __future__ import annotations

import pytest

from gateway_proc import GatewayProc

PROMPT = [4089, 4090, 4094, 198, 3527, 1018, 311, 13]     # [gMASK]<sop><|user|> and a few words


def _ids(gateway, **extra):
    status, body = gateway.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 24, "temperature": 0,
                                                     "ignore_eos": True, "return_token_ids": True, **extra})
    assert status == 200, body
    return body["choices"][0]["token_ids"]


@pytest.mark.parametrize("mtp", ["on", "3", 2, "auto", "off"])
def test_the_mtp_field_gives_the_same_tokens(gateway, mtp):
    assert _ids(gateway, mtp=mtp) == _ids(gateway)


def test_a_bad_mtp_field_is_a_400_naming_it(gateway):
    status, body = gateway.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "mtp": "fast"})
    assert status == 400 and body["error"]["param"] == "mtp" and "'mtp' must be one of" in body["error"]["message"]


def test_coli_serve_mtp_default_and_a_bad_value(gw_run, gateway):
    g = GatewayProc(gw_run, "--mtp", "2")
    try:
        status, body = g.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 24, "temperature": 0,
                                                  "ignore_eos": True, "return_token_ids": True})
        assert status == 200 and body["choices"][0]["token_ids"] == _ids(gateway)
    finally:
        g.stop()
    r = gw_run.coli("serve", "--name", gw_run.name, "--http", "127.0.0.1:0", "--mtp", "9", timeout=60)
    assert r.returncode == 2 and "--mtp '9' is not off, on, auto or a draft count 1..3" in r.stderr
