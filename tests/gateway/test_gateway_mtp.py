"""The HTTP body field "mtp" through a real `coli serve` beside a run of the demo model: "off" is served as usual; "on"
and a draft count draft with the demo's trained MTP head inside the batched executor and give the same greedy tokens
as without; a value that is not one is a 400 naming 'mtp'. `coli serve --mtp` is the default of a request that does
not say, the request's own field wins, and a gateway without `--mtp` leaves the run's `coli up --mtp` in force: each
checked by the executor's MTP counters (`coli stats`), which move only for a request that really drafted."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from batch_streams import executor_stats
from gateway_proc import GatewayProc
from harness import Run

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


MTP_COUNTERS = ("mtp_rounds", "mtp_tokens", "mtp_drafted_1", "mtp_drafted_2", "mtp_drafted_3")


@pytest.fixture(scope="module")
def mtp3_run(gw_root, text_model_dir):
    """A run of the demo model started with `coli up --mtp 3`: a request that does not say drafts three tokens."""
    r = Run(text_model_dir, f"gm{os.getpid() % 10000}", gw_root / "runs", gw_root / "cache", ram_gb=1.0,
            args=("--mtp", "3"))
    try:
        r.wait_ready()
        yield r
    finally:
        r.stop()


def _served(run, gateway, **extra) -> tuple[list[int], dict]:
    """One greedy request through `gateway` -> (its token ids, how far the executor's MTP counters moved for it)."""
    before = executor_stats(run, want_steps=0, since=time.time())
    status, body = _post(gateway, **extra)
    assert status == 200, body
    after = executor_stats(run, since=time.time())
    return body["choices"][0]["token_ids"], {k: after.get(k, 0) - before.get(k, 0) for k in MTP_COUNTERS}


NOT_DRAFTED = dict.fromkeys(MTP_COUNTERS, 0)


def test_a_gateway_without_mtp_leaves_the_runs_coli_up_mtp_in_force(mtp3_run):
    g = GatewayProc(mtp3_run)
    try:
        plain, moved = _served(mtp3_run, g, mtp="off")
        assert moved == NOT_DRAFTED, moved
        tokens, moved = _served(mtp3_run, g)                        # no "mtp": the run's --mtp 3
        assert tokens == plain
        assert moved["mtp_drafted_3"] > 0 and moved["mtp_tokens"] == 23, moved    # 24 tokens, 1 from the prompt
    finally:
        g.stop()


def test_serve_mtp_is_the_default_of_a_request_that_does_not_say_and_its_own_field_wins(mtp3_run):
    on = GatewayProc(mtp3_run, "--mtp", "on")
    off = None
    try:
        off = GatewayProc(mtp3_run, "--mtp", "off")
        plain, moved = _served(mtp3_run, off)                       # serve's off over the run's 3
        assert moved == NOT_DRAFTED, moved
        tokens, moved = _served(mtp3_run, on)                       # serve's on (one draft) over the run's 3
        assert tokens == plain
        assert moved["mtp_drafted_1"] == moved["mtp_rounds"] > 0 and moved["mtp_drafted_2"] == 0, moved
        assert moved["mtp_tokens"] == 23, moved
        tokens, moved = _served(mtp3_run, on, mtp=2)               # the request's own field over serve's on
        assert tokens == plain and moved["mtp_drafted_2"] > 0 == moved["mtp_drafted_3"], moved
        tokens, moved = _served(mtp3_run, off, mtp="on")           # ... and over serve's off
        assert tokens == plain and moved["mtp_rounds"] > 0 == moved["mtp_drafted_2"], moved
    finally:
        on.stop()
        if off is not None:
            off.stop()


def test_serve_with_a_bad_mtp_is_a_one_line_error_before_the_run_is_asked(tmp_path):
    r = subprocess.run([sys.executable, "-m", "coli.cli.main", "serve", "--name", "no-such-run", "--mtp", "fast"],
                       capture_output=True, text=True, timeout=60, env={**os.environ, "COLI_RUN_DIR": str(tmp_path)})
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert "--mtp 'fast' is not off, on, auto or a draft count 1..3" in lines[0], r.stderr
