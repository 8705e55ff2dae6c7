"""Concurrent HTTP requests share the executor's batch (continuous batching) and each gets exactly its answer
alone: a stop string ends one stream before it (the gateway cancels that sequence) while the others go on, and a
seeded sampled answer is the one it gets alone."""

from __future__ import annotations

import threading

import pytest

from test_gateway_cancel import _window, settle, stat


@pytest.mark.timeout(180)
def test_concurrent_requests_get_their_solo_answers_with_stop_strings_and_sampling_per_request(gateway):
    greedy = {"prompt": "Hello world", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    sampled = {"prompt": "What is a generator?", "max_tokens": 30, "temperature": 0.8, "top_p": 0.9, "seed": 5,
               "ignore_eos": True}
    other = {"prompt": "Tell me about the itertools module.", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    solo = {}
    for name, body in (("greedy", greedy), ("sampled", sampled), ("other", other)):
        status, out = gateway.post("/v1/completions", body)     # one at a time: each alone in the batch
        assert status == 200, out
        solo[name] = out["choices"][0]["text"]
    text = solo["greedy"]
    stop = _window(text, len(text) // 3)
    assert stop, f"no plain 3-character window in {text!r}"
    settle(gateway)
    steps0, rows0 = stat(gateway, "executor", "steps"), stat(gateway, "executor", "rows")
    got: dict[str, dict] = {}

    def ask(name: str, body: dict) -> None:
        status, out = gateway.post("/v1/completions", body, timeout=120)
        got[name] = out if status == 200 else {"status": status, "body": out}

    asks = {"stopped": {**greedy, "stop": [stop]}, "greedy": greedy, "sampled": sampled, "other": other}
    threads = [threading.Thread(target=ask, args=kv) for kv in asks.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(150)
    texts = {k: v["choices"][0]["text"] for k, v in got.items()}
    assert texts["stopped"] == text[:text.index(stop)] and got["stopped"]["choices"][0]["finish_reason"] == "stop"
    assert texts["greedy"] == solo["greedy"] and got["greedy"]["choices"][0]["finish_reason"] == "length"
    assert texts["sampled"] == solo["sampled"]
    assert texts["other"] == solo["other"]
    settle(gateway)
    steps, rows = stat(gateway, "executor", "steps") - steps0, stat(gateway, "executor", "rows") - rows0
    assert rows > steps > 0, (rows, steps)          # the four shared steps
