"""Sessions: a turn reuses the cached KV of the conversation and prefills only its new tokens; the
cache is saved on `coli down` and a resumed session generates what an uninterrupted one does."""

import pytest

from coli.serve.client import Client, RequestError
from harness import Run, assert_run_gone
from oracles import load_oracle


def turn(run, ids, session, n=16, new=True):
    with Client(run.name, base=str(run.run_base)) as c:
        return c.generate(ids, n, greedy=True, ignore_eos=True, session=session, new_session=new)


@pytest.mark.timeout(300)
def test_session_resumes_after_down_and_up(default_oracle, start_run):
    o = load_oracle(default_oracle)
    p1 = o["prompt_ids"]
    extra = o["continuation"]["extra_ids"]

    # uninterrupted: two turns in one run, without a session (full prefill each time)
    run = start_run(default_oracle)
    r1 = turn(run, p1, None, 32)
    assert r1.tokens == o["greedy_tokens"]
    p2 = p1 + r1.tokens + extra
    ref2 = turn(run, p2, None, 32)
    assert ref2.tokens == o["continuation"]["greedy_tokens"]

    # with a session: turn 2 prefills only the new tokens
    s1 = turn(run, p1, "chat-a", 32)
    s2 = turn(run, p2, "chat-a", 32, new=False)
    assert s1.tokens == r1.tokens and s2.tokens == ref2.tokens
    assert s2.timing["reused_tokens"] == len(p1) + 31 and s2.timing["prefill_tokens"] == 1 + len(extra)

    # an unknown session is refused unless asked to create it
    with pytest.raises(RequestError, match="unknown session 'nope'"):
        turn(run, p1, "nope", 4, new=False)

    # resumed across down/up: turn 1 in one run, turn 2 in the next
    s1b = turn(run, p1, "chat-b", 32)
    assert run.coli("down", "--name", run.name).returncode == 0
    run.proc.wait(30)
    assert_run_gone(run)
    again = Run(default_oracle, run.name, run.run_base, run.run_base.parent / "cache")
    try:
        again.wait_ready()
        s2b = turn(again, p1 + s1b.tokens + extra, "chat-b", 32, new=False)
        assert s2b.tokens == ref2.tokens
        assert s2b.timing["reused_tokens"] == len(p1) + 31
    finally:
        again.stop()
