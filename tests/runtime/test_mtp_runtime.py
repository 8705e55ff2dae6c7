"""MTP through the stage processes: a request asking for MTP drafts with the model's MTP head in the batched executor
(stages/executor/serving.py: its verify row [last, d1..dk] in the batched step), and its greedy tokens
are those it gets without MTP, concurrent with a request that does not draft (on an f32 container: transformers'; on
an int4 one: the numpy path's); max_tokens is honoured inside a round; a session drafts across its turns; a model
without the layer is a one-line bad_request and the run goes on; the HTTP body field `"mtp"` is parsed and checked
by the gateway."""

from __future__ import annotations

import time

import pytest

from batch_streams import Stream, alone, executor_stats
from checkpoints import with_mtp_layer
from coli.serve.client import Client, RequestError
from oracles import load_oracle, oracle_dir


def run_vocab(d) -> int:
    from coli.config import load_config
    return load_config(d).vocab_size


@pytest.fixture(scope="module")
def mtp_model(oracle_root, tmp_path_factory):
    src = oracle_dir(oracle_root, "default")
    return src, with_mtp_layer(src, tmp_path_factory.mktemp("rt-mtp") / "default-mtp", seed=11)


@pytest.mark.timeout(300)
def test_concurrent_requests_with_and_without_mtp_each_get_their_solo_tokens(start_run, mtp_model):
    src, d = mtp_model
    o = load_oracle(src)
    p = o["prompt_ids"]
    run = start_run(d, args=("--max-batch", "3"))
    drafting = Stream(run, p, 32, greedy=True, mtp="3")
    plain = Stream(run, p[2:14], 24, greedy=True)
    for s in (drafting, plain):
        s.start()
    for s in (drafting, plain):
        s.join(240)
        assert s.error is None, s.error
    assert drafting.tokens == o["greedy_tokens"]           # transformers' tokens, drafted and verified
    assert plain.tokens == alone(d, p[2:14], 24)
    st = executor_stats(run, since=time.time())
    assert st["mtp_rounds"] > 0 and st["mtp_drafted_1"] >= st["mtp_drafted_3"] > 0, st    # counted for `coli stats`
    assert st["mtp_tokens"] == 31 and st["mtp_accepted_1"] <= st["mtp_drafted_1"], st   # 32 tokens, 1 from the prompt
    with Client(run.name, base=str(run.run_base)) as c:
        for mode in ("on", "2", "auto"):
            assert c.generate(p, 32, greedy=True, ignore_eos=True, mtp=mode).tokens == o["greedy_tokens"], mode
        # max_tokens inside a round: exactly that many, the first of the plain run's
        for n in (1, 2, 5):
            assert c.generate(p, n, greedy=True, ignore_eos=True, mtp="3").tokens == o["greedy_tokens"][:n], n
        # sampled with drafts (speculative sampling): seeded, so the same answer twice; every token in the vocabulary
        kw = dict(greedy=False, temperature=0.8, top_k=20, top_p=0.9, seed=5, ignore_eos=True, mtp="2")
        first, again = c.generate(p, 12, **kw).tokens, c.generate(p, 12, **kw).tokens
        assert first == again and len(first) == 12 and all(0 <= t < run_vocab(d) for t in first)


@pytest.mark.timeout(300)
def test_an_int4_container_drafts_through_the_stages_with_the_tokens_without_mtp(start_run, mtp_model, tmp_path_factory):
    """int4 experts and an int8 dense core (the format users serve): a request with mtp on and one with 3, each sharing
    the batch with a request that does not draft, and each alone, get the tokens the numpy path gives without MTP."""
    import threading

    from coli.container.writer import ConvertOptions, convert

    src, d = mtp_model
    p = load_oracle(src)["prompt_ids"]
    c = tmp_path_factory.mktemp("rt-mtp-int4") / "int4"
    convert(d, c, ConvertOptions(experts="int4", dense="int8", group=32))
    want, want_plain = alone(c, p, 28), alone(c, p[2:14], 20)
    run = start_run(c, args=("--max-batch", "3"))
    for mode in ("on", "3"):
        started = threading.Event()
        drafting = Stream(run, p, 28, started=started, greedy=True, mtp=mode)
        plain = Stream(run, p[2:14], 20, after=started, greedy=True)    # joins while the drafting one decodes
        for s in (drafting, plain):
            s.start()
        for s in (drafting, plain):
            s.join(240)
            assert s.error is None, (mode, s.error)
        assert drafting.tokens == want and plain.tokens == want_plain, mode
    with Client(run.name, base=str(run.run_base)) as cl:
        for mode in ("on", "3"):
            assert cl.generate(p, 28, greedy=True, ignore_eos=True, mtp=mode).tokens == want, mode
    st = executor_stats(run, since=time.time())
    assert st["mtp_drafted_1"] > st["mtp_drafted_3"] > 0 and st["mtp_tokens"] == 4 * 27, st    # all four drafted


@pytest.mark.timeout(240)
def test_a_session_drafts_across_turns_and_a_turn_without_mtp_between_them_is_served(start_run, mtp_model):
    """Turn 2 continues turn 1's MTP cache (MtpCarry): the continuation's tokens are transformers', it reuses turn
    1's cache and it drafted; a turn without MTP in between grows the cache alone, and the turn after it runs
    without drafts (the same tokens) rather than drafting from a stale MTP cache."""
    src, d = mtp_model
    o = load_oracle(src)
    p, cont = o["prompt_ids"], o["continuation"]
    run = start_run(d)
    with Client(run.name, base=str(run.run_base)) as c:
        t1 = c.generate(p, 32, greedy=True, ignore_eos=True, session="conv", new_session=True, mtp="3")
        assert t1.tokens == o["greedy_tokens"]
        rounds_1 = executor_stats(run, 1, since=time.time())["mtp_rounds"]
        t2 = c.generate(p + t1.tokens + cont["extra_ids"], 32, greedy=True, ignore_eos=True, session="conv", mtp="3")
        assert t2.tokens == cont["greedy_tokens"]
        assert t2.timing["reused_tokens"] == len(p) + 31
        assert executor_stats(run, 1, since=time.time())["mtp_rounds"] > rounds_1                      # turn 2 drafted
        # the same conversation, once without MTP and once with: each the tokens of a plain run
        t3 = c.generate(p, 8, greedy=True, ignore_eos=True, session="conv2", new_session=True, mtp="off")
        t4 = c.generate(p + t3.tokens + [p[0]], 8, greedy=True, ignore_eos=True, session="conv2", mtp="3")
        assert t4.tokens == alone(d, p + t3.tokens + [p[0]], 8)
    logs = run.coli("logs", "--name", run.name, "--json").stdout
    assert "mtp_off_for_turn" in logs


@pytest.mark.timeout(240)
def test_mtp_where_it_cannot_draft_is_a_bad_request_and_the_run_goes_on(start_run, mtp_model):
    src, d = mtp_model
    o = load_oracle(src)
    p = o["prompt_ids"]
    run = start_run(src)                                   # the oracle without an MTP layer
    with Client(run.name, base=str(run.run_base)) as c:
        with pytest.raises(RequestError, match=r"--mtp: .* cannot draft: it has no MTP layer"):
            c.generate(p, 8, greedy=True, mtp="on")
        with pytest.raises(RequestError, match=r"--mtp: .* cannot draft: it has no MTP layer"):
            c.generate(p, 8, greedy=True, mtp="3", session="s1", new_session=True)
        assert c.generate(p, 32, greedy=True, ignore_eos=True, mtp="off").tokens == o["greedy_tokens"]
        assert c.generate(p, 32, greedy=True, ignore_eos=True).tokens == o["greedy_tokens"]


@pytest.mark.timeout(240)
def test_coli_up_mtp_is_the_default_of_a_request_that_does_not_say(start_run, mtp_model):
    src, _ = mtp_model
    o = load_oracle(src)
    p = o["prompt_ids"]
    run = start_run(src, args=("--mtp", "on"))            # a run that drafts by default, on a model that cannot
    with Client(run.name, base=str(run.run_base)) as c:
        with pytest.raises(RequestError, match=r"cannot draft: it has no MTP layer"):
            c.generate(p, 8, greedy=True)                  # the run's --mtp on applies
        assert c.generate(p, 32, greedy=True, ignore_eos=True, mtp="off").tokens == o["greedy_tokens"]
        with pytest.raises(RequestError, match=r"cannot draft: it has no MTP layer"):    # a session turn too
            c.generate(p, 8, greedy=True, session="s-default", new_session=True)
        t = c.generate(p, 32, greedy=True, ignore_eos=True, session="s-off", new_session=True, mtp="off")
        assert t.tokens == o["greedy_tokens"]


def test_coli_up_with_a_bad_mtp_is_a_one_line_error(tmp_path):
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "coli.cli.main", "up", "--name", "bad-mtp", "--mtp", "fast"],
                       capture_output=True, text=True, timeout=60, env={**__import__("os").environ,
                                                                        "COLI_RUN_DIR": str(tmp_path)})
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "--mtp 'fast' is not off, on, auto or a draft count 1..3" in lines[0], r.stderr


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


@pytest.mark.timeout(240)
def test_a_bad_mtp_value_on_the_wire_is_a_one_line_error_naming_the_field_and_the_run_goes_on(start_run, mtp_model):
    """A peer that skips the client's check (a raw GenerateRequest with mtp "fast"): the supervisor answers one line
    naming `mtp`, that connection's next request and the run go on."""
    import os

    import msgpack
    import zmq

    from coli.protocol.codec import decode, encode
    from coli.protocol.messages import PROTOCOL_VERSION, Error, GenerateRequest, Hello

    src, d = mtp_model
    o = load_oracle(src)
    run = start_run(d)
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVTIMEO, 30_000)
    try:
        s.connect(f"ipc://{run.run_base / run.name / 'client.sock'}")
        s.send_multipart(encode(Hello("client", os.getpid(), PROTOCOL_VERSION)))
        decode(s.recv_multipart())                                   # Ready
        kind, body = encode(GenerateRequest("raw-1", o["prompt_ids"], 4, 1.0, 1.0, 0, None, True, False, mtp="on"))
        fields = msgpack.unpackb(body)
        fields["mtp"] = "fast"
        s.send_multipart([kind, msgpack.packb(fields)])
        err = decode(s.recv_multipart())
        assert isinstance(err, Error), err
        assert "mtp must be one of off, on, auto, 1, 2, 3, got 'fast'" in err.message and "\n" not in err.message
    finally:
        s.close()
        ctx.term()
    with Client(run.name, base=str(run.run_base)) as c:
        assert c.generate(o["prompt_ids"], 32, greedy=True, ignore_eos=True, mtp="2").tokens == o["greedy_tokens"]
