"""Continuous batching through the running stages (supervisor, executor, RAM tier, reader as processes): requests
that join and leave a running batch each get exactly the tokens they get alone (greedy: transformers' for the
oracle prompt; sampled: the same seed alone), a cancelled one stops at a token boundary while the others go on, a
session's turn continues from its cache, and a request that fails in a batch fails alone."""

import threading
import time

import pytest

from batch_streams import Stream, alone, executor_stats
from failures import inject_seed_for
from coli.model.sampling import SamplingParams
from coli.serve.client import Client, RequestError
from oracles import load_oracle


@pytest.mark.timeout(300)
def test_requests_joining_and_leaving_a_batch_get_their_solo_tokens(default_oracle, start_run):
    o = load_oracle(default_oracle)
    p = o["prompt_ids"]
    run = start_run(default_oracle, args=("--max-batch", "3", "--step-tokens", "8"))
    long_started = threading.Event()
    a = Stream(run, p, 32, started=long_started, session="batch-a", new_session=True)
    b = Stream(run, p[:5], 24, after=long_started)
    cut = Stream(run, p[3:17], 200, after=long_started, stop_after=6)
    sampled = Stream(run, p[2:12], 20, after=long_started, greedy=False, temperature=0.7, top_k=10, top_p=0.9, seed=77)
    late = Stream(run, p[1:20], 16, after=b.finished)      # joins once b has left
    streams = (a, b, cut, sampled, late)
    for s in streams:
        s.start()
    for s in streams:
        s.join(240)
    for s in streams:
        assert s.error is None, s.error
    assert a.tokens == o["greedy_tokens"]                  # transformers' tokens, served in a batch
    assert a.done.timing["prefill_tokens"] == len(p)
    assert b.tokens == alone(default_oracle, p[:5], 24)
    assert late.tokens == alone(default_oracle, p[1:20], 16)
    assert sampled.tokens == alone(default_oracle, p[2:12], 20, SamplingParams(False, 0.7, 0.9, 10, 77))
    assert cut.tokens == alone(default_oracle, p[3:17], 6)
    st = executor_stats(run)
    assert st["rows"] > st["steps"], st                    # several sequences shared steps
    assert st["cancelled"] == 1 and st["failed"] == 0 and st["max_batch"] == 3
    # the session's next turn reuses the cache the batched turn left
    with Client(run.name, base=str(run.run_base)) as c:
        t2 = c.generate(p + a.tokens + o["continuation"]["extra_ids"], 32, greedy=True, ignore_eos=True,
                        session="batch-a")
    assert t2.tokens == o["continuation"]["greedy_tokens"]
    assert t2.timing["reused_tokens"] == len(p) + 31


@pytest.mark.timeout(240)
def test_a_request_that_fails_in_a_batch_fails_alone(default_oracle, start_run):
    o = load_oracle(default_oracle)
    p = o["prompt_ids"]
    # the fault is drawn at each request's first token: the long one passes, the one joining it fails
    seed = inject_seed_for([False, True, False])
    run = start_run(default_oracle, extra_env={"COLI_INJECT": "request_error:0.5", "COLI_INJECT_SEED": str(seed)})
    started = threading.Event()
    a = Stream(run, p, 32, started=started)
    b = Stream(run, p[:7], 16, after=started)
    a.start()
    b.start()
    a.join(200)
    b.join(200)
    assert isinstance(b.error, RequestError) and "injected request failure" in str(b.error), b.error
    assert a.error is None and a.tokens == o["greedy_tokens"]
    st = executor_stats(run)
    assert st["failed"] == 1 and st["rows"] > st["steps"]
    with Client(run.name, base=str(run.run_base)) as c:        # and the executor serves the next one
        assert c.generate(p, 32, greedy=True, ignore_eos=True).tokens == o["greedy_tokens"]


@pytest.mark.timeout(240)
def test_a_sessions_second_turn_sent_while_its_first_runs_waits_for_it_and_reuses_its_cache(default_oracle, start_run):
    o = load_oracle(default_oracle)
    p = o["prompt_ids"]
    run = start_run(default_oracle)
    started = threading.Event()
    first = Stream(run, p, 32, started=started, session="twice", new_session=True)
    # the same conversation sent again (a second tab, a retry) while the first turn still decodes
    again = Stream(run, p + [5, 6], 8, after=started, session="twice")
    other = Stream(run, p[:9], 12, after=started)      # another request is not held up by the session's queue
    for s in (first, again, other):
        s.start()
    for s in (first, again, other):
        s.join(200)
    for s in (first, again, other):
        assert s.error is None, s.error
    assert first.tokens == o["greedy_tokens"]
    assert again.tokens == alone(default_oracle, p + [5, 6], 8)
    # it ran after the first turn was committed: the prompt it shares with it (all 20 tokens) came from the cache
    assert again.done.timing["reused_tokens"] == len(p) and again.done.timing["prefill_tokens"] == 2
    assert other.tokens == alone(default_oracle, p[:9], 12)
    # at the executor the second turn waited for the first; the other request, sent with it, did not
    assert other.done.timing["queued_s"] < again.done.timing["queued_s"]


@pytest.mark.timeout(240)
def test_with_a_prefill_chunk_a_prompt_goes_in_one_step_beside_a_running_stream_and_tokens_stay_solo(default_oracle,
                                                                                                      start_run):
    o = load_oracle(default_oracle)
    p = o["prompt_ids"]
    # the numpy executor decodes every expert from its RAM-tier record each step: its experts stream, so the step's
    # budget is --prefill-chunk, not --step-tokens (2 would cut a 20-token prompt into 10 steps)
    run = start_run(default_oracle, args=("--max-batch", "2", "--step-tokens", "2", "--prefill-chunk", "64"))
    started = threading.Event()
    a = Stream(run, p, 32, started=started)
    b = Stream(run, p[1:20], 4, after=started)      # joins a's decode: its 19 prompt tokens ride one step with it
    for s in (a, b):
        s.start()
    for s in (a, b):
        s.join(200)
    for s in (a, b):
        assert s.error is None, s.error
    assert a.tokens == o["greedy_tokens"]
    assert b.tokens == alone(default_oracle, p[1:20], 4)
    st = executor_stats(run, since=time.time())
    assert st["prefill_chunk"] == 64 and st["step_tokens"] == 2 and st["experts_stream"] == 1, st
    # one step per token of a, its whole prompt in its first; b's prompt rides one of them (+4 at most, should b
    # join after a has left). With the 2-token budget a's prompt alone would take 10 steps: 41 at least.
    assert st["steps"] <= 32 + 4, st
