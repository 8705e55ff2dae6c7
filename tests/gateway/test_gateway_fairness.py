"""Fairness across end users: the gateway gives each `user` (else each client address) its own connection
to the run, and the supervisor serves connections round-robin — so a user who queued several requests
does not make another user's single request wait for all of them."""

from __future__ import annotations

import json
import threading
import time

import pytest

from test_gateway_cancel import hang_up, hold_every_slot, wait_stat


@pytest.mark.timeout(120)
def test_a_second_user_is_not_queued_behind_the_first_users_burst(gateway):
    # alice's long requests hold every batch slot of the executor; everything below queues behind them
    held = hold_every_slot(gateway, user="alice")
    done: list[str] = []
    lock = threading.Lock()

    def ask(tag: str, user: str) -> None:
        status, out = gateway.post("/v1/completions", {"prompt": "Hello", "max_tokens": 8, "ignore_eos": True,
                                                       "temperature": 0, "user": user})
        assert status == 200, out
        with lock:
            done.append(tag)

    threads = []
    for tag, user in (("a1", "alice"), ("a2", "alice"), ("a3", "alice"), ("b1", "bob")):
        t = threading.Thread(target=ask, args=(tag, user))
        t.start()
        threads.append(t)
        time.sleep(0.3)  # a fixed arrival order
    # all four wait at the supervisor before a slot frees (bob's first request opens a new connection to the run,
    # which takes a while on a machine busy with the holders' streams)
    assert wait_stat(gateway, "supervisor", "queued", 4, timeout=20) >= 4
    hang_up(held[0][0])  # one batch slot frees: the queue drains through it, one request at a time
    for t in threads:
        t.join(60)
    for c, _ in held[1:]:
        hang_up(c)
    assert sorted(done) == ["a1", "a2", "a3", "b1"]
    assert done.index("b1") < done.index("a2"), f"bob waited behind alice's burst: {done}"
    assert done.index("a1") < done.index("a2") < done.index("a3")  # one user's requests stay in order
