"""The RAM tier's answer and lease books: an entry lives exactly as long as answers are owed."""

from coli.stages.ramtier.answers import PREFETCH_TAG, AnswerBook, LeaseBook


def test_entry_goes_with_the_last_answer():
    book = AnswerBook()
    tag = book.expect(b"executor", 41, 3)
    assert tag != PREFETCH_TAG and len(book) == 1
    assert book.answered(tag, 2) == (b"executor", 41)
    assert book.answered(tag, 1) == (b"executor", 41)
    assert len(book) == 0 and book.answered(tag, 1) is None
    assert book.answered(PREFETCH_TAG, 1) is None


def test_same_request_id_from_two_peers_never_crosses():
    book = AnswerBook()
    a, b = book.expect(b"executor", 7, 1), book.expect(b"intruder", 7, 1)
    assert a != b
    assert book.answered(b, 1) == (b"intruder", 7) and book.answered(a, 1) == (b"executor", 7)


def test_many_requests_leave_nothing_behind():
    book = AnswerBook()
    for rid in range(10_000):
        tag = book.expect(b"executor", rid, 8)
        for _ in range(8):
            book.answered(tag, 1)
    assert len(book) == 0


def test_only_the_holder_gives_a_lease_back():
    leases = LeaseBook()
    leases.granted(b"executor", 3, 9)
    leases.granted(b"executor", 3, 9)
    assert not leases.give_back(b"intruder", 3, 9)
    assert not leases.give_back(b"executor", 3, 8)  # another generation of the slot
    assert leases.give_back(b"executor", 3, 9) and leases.give_back(b"executor", 3, 9)
    assert not leases.give_back(b"executor", 3, 9) and len(leases) == 0


def test_a_gone_peer_gives_back_every_lease_and_owes_nothing():
    leases, book = LeaseBook(), AnswerBook()
    leases.granted(b"gone", 1, 5)
    leases.granted(b"gone", 1, 5)
    leases.granted(b"gone", 2, 7)
    leases.granted(b"executor", 3, 1)
    tag = book.expect(b"gone", 9, 4)
    keep = book.expect(b"executor", 9, 1)
    assert sorted(leases.drop_peer(b"gone")) == [(1, 5), (1, 5), (2, 7)]
    assert book.drop_peer(b"gone") == 1 and book.answered(tag, 1) is None
    assert len(leases) == 1 and book.answered(keep, 1) == (b"executor", 9)


def test_counts_of_what_other_peers_hold_and_are_owed():
    leases, book = LeaseBook(), AnswerBook()
    leases.granted(b"executor", 1, 1)
    leases.granted(b"a", 2, 1)
    leases.granted(b"b", 3, 1)
    book.expect(b"executor", 1, 8)
    book.expect(b"a", 2, 3)
    assert leases.held_by_others(b"executor") == 2 and book.owed_to_others(b"executor") == 3


def test_run_identity_carries_the_runs_secret():
    from coli.protocol.handshake import run_identity
    assert run_identity("executor", b"supervisor-0123abcd") == b"executor-0123abcd"
    assert run_identity("executor", None) == b"executor"
