"""The HTTP body field "mtp" through a real `coli serve` beside a run of the demo model: "off" is served as usual; "on"
and a draft count draft with the demo's trained MTP head inside the batched executor and give the same greedy tokens
as without; a value that is not one is a 400 naming 'mtp'."""

from __future__ import annotations

PROMPT = [4089, 4090, 4094, 198, 3527, 1018, 311, 13]     # [gMASK]<sop><|user|> and a few words


def _post(gateway, **extra):
    return gateway.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 24, "temperature": 0,
                                            "ignore_eos": True, "return_token_ids": True, **extra})


def test_mtp_off_is_served_as_without_it(gateway):
    s0, plain = _post(gateway)
    s1, off = _post(gateway, mtp="off")
    assert s0 == s1 == 200 and off["choices"][0]["token_ids"] == plain["choices"][0]["token_ids"]


def test_mtp_on_and_three_drafts_give_the_tokens_without_it(gateway):
    s0, plain = _post(gateway)
    s1, on = _post(gateway, mtp="on")
    s3, three = _post(gateway, mtp=3)
    assert s0 == s1 == s3 == 200, (on, three)
    want = plain["choices"][0]["token_ids"]
    assert on["choices"][0]["token_ids"] == want and three["choices"][0]["token_ids"] == want


def test_a_bad_mtp_field_is_a_400_naming_it(gateway):
    status, body = gateway.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "mtp": "fast"})
    assert status == 400 and body["error"]["param"] == "mtp" and "'mtp' must be one of" in body["error"]["message"]
