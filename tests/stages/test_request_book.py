"""The supervisor's request book (stages/supervisor/core.py), pure: up to max_batch requests run at the executor at
once, the rest wait per client and join round-robin across clients, one client's in order."""

import pytest

from coli.stages.supervisor.core import Pending, RequestBook


def submit(book, client, rid):
    book.submit(Pending(client, rid, None, 0.0))


def started(book):
    out = []
    while (p := book.next()) is not None:
        out.append(p.request_id)
    return out


def test_up_to_max_batch_run_and_the_rest_join_round_robin_as_slots_free():
    book = RequestBook(max_batch=2)
    for rid in ("a1", "a2", "a3"):
        submit(book, b"alice", rid)
    submit(book, b"bob", "b1")
    assert started(book) == ["a1", "b1"]            # round-robin across clients, not alice's burst first
    assert book.waiting == 2 and set(book.running) == {"a1", "b1"}
    book.finish("a1")
    assert started(book) == ["a2"]                   # one slot freed: one joins
    book.finish("b1")
    book.finish("a2")
    assert started(book) == ["a3"] and book.waiting == 0


def test_cancel_tells_a_running_request_from_a_queued_one_and_a_gone_client_keeps_its_running_ones():
    book = RequestBook(max_batch=1)
    submit(book, b"c", "r1")
    submit(book, b"c", "r2")
    assert started(book) == ["r1"]
    p, running = book.cancel("r2")
    assert p.request_id == "r2" and not running and "r2" not in book.by_id     # queued: simply gone
    p, running = book.cancel("r1")
    assert running and p.request_id == "r1"          # the caller cancels it at the executor; it stays until Done
    submit(book, b"c", "r3")
    assert [q.request_id for q in book.drop_client(b"c")] == ["r3"]
    assert list(book.running) == ["r1"]
    assert [q.request_id for q in book.clear()] == ["r1"] and not book.running


def test_max_batch_below_one_is_refused():
    with pytest.raises(ValueError, match="max_batch must be >= 1"):
        RequestBook(max_batch=0)
