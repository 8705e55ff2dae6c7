"""A client that stops reading its tokens (a paused terminal, a stalled pipe): once its queue is full
(~2,000 tokens: the supervisor's and the client's ZeroMQ high-water marks), the supervisor stops the request
at the executor and, right after the tokens already queued, sends it a `client_too_slow` error — it used to
drop the client silently, which then waited its whole token timeout (300 s in `coli chat`) for nothing.
The client's connection survives: its next request is served."""

import time

import pytest

from coli.serve.client import Client, RequestError
from failures import long_stream
from oracles import load_oracle


@pytest.mark.slow
@pytest.mark.timeout(280)
def test_a_client_that_stops_reading_gets_a_clear_error_after_its_tokens(default_oracle, start_run):
    o = load_oracle(default_oracle)
    run = start_run(default_oracle)
    c, it = long_stream(run, o, max_tokens=3000)  # read nothing more for now
    with Client(run.name, base=str(run.run_base)) as watcher:
        base = watcher.status()["stats"].get("executor", {}).get("cancelled", 0)
        deadline = time.monotonic() + 240
        while watcher.status()["stats"].get("executor", {}).get("cancelled", 0) <= base:  # the run gave up on it
            assert time.monotonic() < deadline, "the executor never stopped the unread request"
            time.sleep(0.5)
    got, t0 = 1, time.monotonic()
    with pytest.raises(RequestError) as e:
        for _ in it:
            got += 1
    waited = time.monotonic() - t0
    assert e.value.code == "client_too_slow" and "stopped reading" in str(e.value)
    assert 1000 < got < 3000  # it got what was queued for it, and the request stopped early
    assert waited < 25, f"the error came only after {waited:.0f} s (the client's token timeout is 30 s)"
    r = c.generate(o["prompt_ids"], 8, greedy=True, ignore_eos=True)  # the same connection serves on
    assert r.tokens == o["greedy_tokens"][:8]
    c.close()
