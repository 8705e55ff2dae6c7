"""The executor's batching policy (stages/executor/scheduler.py), pure: who joins, what each step feeds, how
prefill is chunked, and how sequences finish. The tokens "sampled" here are given by the test; that a batched
step gives every sequence its solo tokens is tests/stages/test_batch_exact.py, with the real model."""

import pytest

from coli.model.sampling import SamplingParams
from coli.stages.executor.scheduler import Scheduler, Sequence

EOS = frozenset({99})


def seq(rid, n_prompt=4, max_tokens=8, session=None, eos=EOS):
    return Sequence(rid, list(range(1, n_prompt + 1)), max_tokens, SamplingParams(), eos, session)


def start(s: Scheduler, *seqs):
    """Submit and admit; each begins with an empty cache (a stand-in object: the core never touches it)."""
    for q in seqs:
        s.submit(q)
    joined = s.admit()
    for q in joined:
        s.begin(q, object(), q.prompt, now=0.0)
    return joined


def step(s: Scheduler, tok=7, now=1.0):
    rows = s.plan()
    out = s.commit(rows, [tok if r.samples else None for r in rows], now)
    return rows, out


def test_admission_is_first_come_first_served_up_to_max_batch():
    s = Scheduler(max_batch=2, step_tokens=64)
    joined = start(s, seq("a"), seq("b"), seq("c"))
    assert [q.request_id for q in joined] == ["a", "b"]
    assert [q.request_id for q in s.waiting] == ["c"]
    for _ in range(8):          # a and b run to max_tokens = 8
        step(s)
    assert [q.request_id for q in s.admit()] == ["c"]


def test_every_decoding_sequence_gets_a_row_and_a_newcomers_prompt_is_chunked_into_the_rest_of_the_budget():
    s = Scheduler(max_batch=4, step_tokens=8)
    start(s, seq("a", 2), seq("b", 3))
    rows, out = step(s)                         # both prompts fit one step (5 <= 8): each samples its first token
    assert [(r.seq.request_id, len(r.ids), r.samples) for r in rows] == [("a", 2, True), ("b", 3, True)]
    assert [(q.request_id, i) for q, _, i in out.tokens] == [("a", 0), ("b", 0)]
    start(s, seq("long", 20))
    chunks = []
    while s.find("long").prefilling:
        rows, _ = step(s)
        decode = [r for r in rows if r.seq.request_id in ("a", "b")]
        assert [len(r.ids) for r in decode] == [1, 1]       # the running streams never pause for the prompt
        assert sum(len(r.ids) for r in rows) <= 8
        chunks += [(len(r.ids), r.samples) for r in rows if r.seq.request_id == "long"]
    assert chunks == [(6, False), (6, False), (6, False), (2, True)]   # 8 - 2 decode rows per step; the last samples


def test_prefill_always_gets_a_token_even_when_decode_rows_fill_the_budget():
    s = Scheduler(max_batch=4, step_tokens=2)
    start(s, seq("a", 1), seq("b", 1))
    step(s)
    start(s, seq("c", 3))
    rows, _ = step(s)
    assert [(r.seq.request_id, len(r.ids)) for r in rows] == [("a", 1), ("b", 1), ("c", 1)]


def test_prompts_are_prefilled_oldest_first_and_a_second_one_takes_what_the_first_leaves():
    s = Scheduler(max_batch=4, step_tokens=10)
    start(s, seq("old", 7), seq("new", 7))
    rows, _ = step(s)
    assert [(r.seq.request_id, len(r.ids), r.samples) for r in rows] == [("old", 7, True), ("new", 3, False)]


def test_eos_stops_with_the_token_included_and_max_tokens_gives_length():
    s = Scheduler(max_batch=4, step_tokens=64)
    start(s, seq("e", max_tokens=5), seq("n", max_tokens=3, eos=frozenset()))
    _, out = step(s, tok=7)
    assert not out.finished
    _, out = step(s, tok=99)        # "e" meets eos; "n" ignores it (ignore_eos: no eos ids)
    assert [(q.request_id, q.finish, q.out) for q in out.finished] == [("e", "stop", [7, 99])]
    _, out = step(s, tok=99)
    assert [(q.request_id, q.finish, q.out) for q in out.finished] == [("n", "length", [7, 99, 99])]
    assert not s.running


def test_a_cancelled_sequence_leaves_at_the_next_boundary_and_its_in_flight_token_is_dropped():
    s = Scheduler(max_batch=4, step_tokens=64)
    start(s, seq("a"), seq("b"))
    s.submit(seq("queued"))
    step(s)
    rows = s.plan()                       # a step is in flight when the cancels arrive
    assert s.cancel("a") and s.cancel("queued")
    out = s.commit(rows, [7 for _ in rows], 2.0)
    assert [q.request_id for q, _, _ in out.tokens] == ["b"]
    gone = s.reap()
    assert sorted((q.request_id, q.finish) for q in gone) == [("a", "cancelled"), ("queued", "cancelled")]
    assert next(q for q in gone if q.request_id == "a").out == [7]     # what it was sent before the cancel
    assert [q.request_id for q in s.running] == ["b"] and not s.waiting
    assert not s.cancel("a") and not s.cancel("unknown")


def test_a_sessions_next_turn_waits_for_its_running_turn_without_holding_up_others():
    s = Scheduler(max_batch=4, step_tokens=64)
    start(s, seq("t1", session="chat", max_tokens=2))
    s.submit(seq("t2", session="chat"))
    s.submit(seq("other"))
    assert [q.request_id for q in s.admit()] == ["other"]
    s.begin(s.find("other"), object(), [1, 2], 0.0)
    step(s)
    step(s)                              # t1 finishes (max_tokens 2)
    assert [q.request_id for q in s.admit()] == ["t2"]


def test_a_failed_sequence_leaves_and_the_others_go_on():
    s = Scheduler(max_batch=4, step_tokens=64)
    a, b = start(s, seq("a"), seq("b"))
    rows = s.plan()
    s.fail(a)                            # e.g. its row failed by itself
    out = s.commit(rows, [7, 7], 1.0)
    assert [q.request_id for q, _, _ in out.tokens] == ["b"] and a.finish == "failed"
    assert s.running == [b]


def test_a_restarted_sequence_feeds_its_prompt_and_tokens_again_and_goes_on_from_its_last_token():
    s = Scheduler(max_batch=4, step_tokens=64)
    (a,) = start(s, seq("a", 3, max_tokens=4))
    step(s, tok=7)
    step(s, tok=8)
    s.restart(a, object(), a.prompt + a.out)      # the cache is lost: everything again on a new one
    rows, out = step(s, tok=9)
    assert [(len(r.ids), r.samples) for r in rows] == [(5, True)]
    assert [(t, i) for _, t, i in out.tokens] == [(9, 2)]


def test_counters_say_steps_rows_and_the_prefill_and_decode_tokens_fed():
    s = Scheduler(max_batch=4, step_tokens=64)
    start(s, seq("a", 5, max_tokens=3), seq("b", 2, max_tokens=3))
    for _ in range(3):
        step(s)
    snap = s.snapshot()
    assert snap["steps"] == 3 and snap["rows"] == 6
    assert snap["prefill_tokens_fed"] == 7 and snap["decode_tokens_fed"] == 4
    assert snap["batch_running"] == 0 and snap["max_batch"] == 4


def test_bad_settings_and_misuse_are_refused_by_name():
    with pytest.raises(ValueError, match="max_batch must be >= 1"):
        Scheduler(0, 64)
    with pytest.raises(ValueError, match="step_tokens must be >= 1"):
        Scheduler(4, 0)
    s = Scheduler(2, 8)
    s.submit(seq("a"))
    with pytest.raises(ValueError, match="request id 'a' is already scheduled"):
        s.submit(seq("a"))
    with pytest.raises(ValueError, match="temperature must be > 0"):
        Sequence("t", [1], 4, SamplingParams(greedy=False, temperature=0.0))
    start(s)
    with pytest.raises(ValueError, match="1 tokens for 0 rows"):
        s.commit([], [1], 0.0)


def test_an_external_sequence_rides_beside_the_batch_and_its_round_stops_at_eos_or_max_tokens():
    """An MTP sequence (external) gets no row of the batched step; a round's tokens are taken up to the first that
    finishes it, none past it."""
    s = Scheduler(max_batch=4, step_tokens=16)
    plain = seq("plain")
    mtp_eos = Sequence("eos", [1, 2, 3], 8, SamplingParams(), EOS, external=True)
    mtp_len = Sequence("len", [1, 2, 3], 3, SamplingParams(), EOS, external=True)
    start(s, plain, mtp_eos, mtp_len)
    rows, _ = step(s)
    assert [r.seq.request_id for r in rows] == ["plain"]
    out = s.commit_tokens(mtp_eos, [5], 1.0)                           # its prompt's round: one token
    assert [t for _, t, _ in out.tokens] == [5] and mtp_eos.pending == [5] and not out.finished
    out = s.commit_tokens(mtp_eos, [6, 99, 7, 8], 2.0)                 # eos inside the round
    assert [(t, i) for _, t, i in out.tokens] == [(6, 1), (99, 2)] and out.finished == [mtp_eos]
    assert mtp_eos.finish == "stop" and mtp_eos not in s.running
    out = s.commit_tokens(mtp_len, [4, 5, 6, 7], 1.0)                  # max_tokens 3 inside the round
    assert mtp_len.out == [4, 5, 6] and mtp_len.finish == "length" and out.finished == [mtp_len]
    assert s.running == [plain]


def test_a_round_of_a_sequence_cancelled_meanwhile_is_dropped():
    s = Scheduler(max_batch=2, step_tokens=16)
    q = Sequence("q", [1, 2], 8, SamplingParams(), EOS, external=True)
    start(s, q)
    assert s.cancel("q")
    assert s.commit_tokens(q, [3, 4], 1.0).tokens == [] and q.out == []


# ---- while the experts stream: one large prefill chunk (the step copies the union of experts anyway) ------------

def test_while_experts_stream_a_prompt_is_fed_in_prefill_chunks_and_decode_rows_ride_along():
    s = Scheduler(max_batch=4, step_tokens=8, prefill_chunk=100, streaming=True)
    start(s, seq("a", 2), seq("b", 3))
    step(s)                                     # a and b decode from here on
    start(s, seq("long", 250))
    chunks = []
    while s.find("long").prefilling:
        rows, _ = step(s)
        assert [len(r.ids) for r in rows if r.seq.request_id in ("a", "b")] == [1, 1]   # fed every step
        assert sum(len(r.ids) for r in rows) <= 100                                    # still bounded
        chunks += [(len(r.ids), r.samples) for r in rows if r.seq.request_id == "long"]
    assert chunks == [(98, False), (98, False), (54, True)]     # 100 - 2 decode rows, not 8 - 2


def test_with_every_expert_resident_the_small_step_budget_stays():
    s = Scheduler(max_batch=4, step_tokens=8, prefill_chunk=100, streaming=False)
    start(s, seq("long", 20))
    rows, _ = step(s)
    assert [len(r.ids) for r in rows] == [8]
    s.streaming = True                          # the source changed (e.g. the GPU was lost): the next step follows
    rows, _ = step(s)
    assert [(len(r.ids), r.samples) for r in rows] == [(12, True)]


def test_while_experts_stream_a_prompt_still_gets_a_token_when_decode_rows_fill_the_chunk():
    s = Scheduler(max_batch=4, step_tokens=64, prefill_chunk=2, streaming=True)
    start(s, seq("a", 1), seq("b", 1))
    step(s)
    start(s, seq("c", 3))
    rows, _ = step(s)
    assert [(r.seq.request_id, len(r.ids)) for r in rows] == [("a", 1), ("b", 1), ("c", 1)]


def test_prefill_chunk_defaults_to_the_step_budget_and_must_be_positive():
    s = Scheduler(max_batch=1, step_tokens=8, streaming=True)
    assert s.budget == 8 and s.snapshot()["prefill_chunk"] == 8 and s.snapshot()["experts_stream"] == 1
    with pytest.raises(ValueError, match="prefill_chunk must be >= 1"):
        Scheduler(max_batch=1, step_tokens=8, prefill_chunk=0)
