"""Cancellation is per request: a client that hangs up mid-stream, or while its request is still queued,
cancels that request at the run (the executor stops, a queued request never runs), and a `stop` string
ends the answer just before it with finish_reason "stop" and stops the executor too."""

from __future__ import annotations

import http.client
import json
import socket
import time

import pytest


def stat(gateway, stage: str, name: str) -> float:
    return gateway.metrics().get(f'coli_stage_{name}{{stage="{stage}"}}', 0.0)


def wait_stat(gateway, stage: str, name: str, at_least: float, timeout: float = 10.0) -> float:
    deadline = time.monotonic() + timeout
    while True:  # stages republish stats every 0.5 s
        v = stat(gateway, stage, name)
        if v >= at_least or time.monotonic() > deadline:
            return v
        time.sleep(0.2)


def settle(gateway) -> None:
    """Wait until stage stats are current (nothing running, last counters published)."""
    time.sleep(1.2)


def open_stream(gateway, body: dict) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    c = http.client.HTTPConnection(gateway.host, gateway.port, timeout=60)
    c.request("POST", "/v1/completions", json.dumps({**body, "stream": True}), {"Content-Type": "application/json"})
    r = c.getresponse()
    assert r.status == 200
    return c, r


def hang_up(c: http.client.HTTPConnection) -> None:
    c.sock.shutdown(socket.SHUT_RDWR)
    c.close()


def hold_every_slot(gateway, **extra) -> list[tuple[http.client.HTTPConnection, http.client.HTTPResponse]]:
    """A long stream in each of the executor's batch slots (--max-batch of them, as its stats say), each past its
    first token: whatever is asked next queues at the supervisor."""
    n = int(wait_stat(gateway, "executor", "max_batch", 1))
    held = [open_stream(gateway, {"prompt": [5, 6, 7], "max_tokens": 3000, "ignore_eos": True, **extra})
            for _ in range(n)]
    for _, r in held:
        r.readline()
    return held


@pytest.mark.timeout(120)
def test_disconnect_mid_stream_cancels_at_the_executor(gateway):
    settle(gateway)
    cancelled0 = stat(gateway, "executor", "cancelled")
    disc0 = gateway.metrics().get("coli_gateway_client_disconnects_total", 0)
    c, r = open_stream(gateway, {"prompt": [5, 6, 7], "max_tokens": 3000, "ignore_eos": True})
    for _ in range(3):
        assert r.readline().startswith(b"data: ")
        r.readline()
    hang_up(c)
    assert wait_stat(gateway, "executor", "cancelled", cancelled0 + 1) == cancelled0 + 1
    assert gateway.metrics()["coli_gateway_client_disconnects_total"] == disc0 + 1
    t0 = time.monotonic()  # the executor is free again: a short request answers at once
    status, out = gateway.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2, "temperature": 0})
    assert status == 200 and time.monotonic() - t0 < 10


@pytest.mark.timeout(120)
def test_disconnect_while_queued_cancels_before_it_runs(gateway):
    settle(gateway)
    ran0 = stat(gateway, "executor", "requests")
    sup_cancelled0 = stat(gateway, "supervisor", "cancelled")
    held = hold_every_slot(gateway)  # every batch slot of the executor is taken
    q = http.client.HTTPConnection(gateway.host, gateway.port, timeout=1.5)  # queued behind them, then gives up
    q.request("POST", "/v1/completions", json.dumps({"prompt": [8, 9], "max_tokens": 50}),
              {"Content-Type": "application/json"})
    with pytest.raises(socket.timeout):
        q.getresponse()
    hang_up(q)
    time.sleep(1.0)  # the gateway notices the hang-up and cancels the queued request
    for c, _ in held:
        hang_up(c)
    n = len(held) + 1
    assert wait_stat(gateway, "supervisor", "cancelled", sup_cancelled0 + n) == sup_cancelled0 + n
    settle(gateway)
    assert stat(gateway, "executor", "requests") == ran0 + len(held)  # the queued one never reached the executor


def _window(text: str, start: int, n: int = 3) -> str | None:
    for i in range(start, len(text) - n):
        w = text[i:i + n]
        if w.isprintable() and "\ufffd" not in w and w.strip() == w:
            return w
    return None


@pytest.mark.timeout(120)
def test_stop_string_ends_the_text_before_it_and_cancels_the_rest(gateway):
    base = {"prompt": "Hello world", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    status, full = gateway.post("/v1/completions", base)
    assert status == 200 and full["usage"]["completion_tokens"] == 40
    text = full["choices"][0]["text"]
    stop = _window(text, len(text) // 3)
    assert stop, f"no plain 3-character window in {text!r}"
    want = text[:text.index(stop)]
    settle(gateway)
    cancelled0 = stat(gateway, "executor", "cancelled")
    status, out = gateway.post("/v1/completions", {**base, "stop": ["\u0000never", stop]})
    assert status == 200, out
    assert out["choices"][0]["text"] == want and out["choices"][0]["finish_reason"] == "stop"
    assert out["usage"]["completion_tokens"] < 40
    assert wait_stat(gateway, "executor", "cancelled", cancelled0 + 1) == cancelled0 + 1
    # streaming: the same text, never a piece of the stop string
    c, r = open_stream(gateway, {**base, "stop": stop})
    chunks = []
    for line in r:
        if line.startswith(b"data: {"):
            chunks.append(json.loads(line[6:]))
    c.close()
    assert "".join(ch["choices"][0]["text"] for ch in chunks) == want
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
