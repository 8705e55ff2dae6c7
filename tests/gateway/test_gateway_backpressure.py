"""A slow or huge client costs its own request, never the others': a big prompt is tokenised off the event
loop (streams and /health keep answering), a streaming client that stops reading is stopped with a
client_too_slow error it sees as soon as it reads again (and the executor is freed), and a body over the
limit is a 413 naming the setting."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
import time
from pathlib import Path

import pytest

from gateway_proc import GatewayProc
from test_gateway_cancel import stat, wait_stat

CHAT = "/v1/chat/completions"


@pytest.mark.timeout(180)
def test_a_huge_prompt_does_not_stall_health_or_other_streams(gateway):
    text = ("hello world, this is a long prompt that no context can hold. " * 70000)[:3_900_000]
    result: dict = {}

    def big() -> None:
        result["status"], result["body"] = gateway.post(CHAT, {"messages": [{"role": "user", "content": text}]})
        result["t_end"] = time.monotonic()

    t = threading.Thread(target=big)
    t.start()
    time.sleep(0.5)  # the body is sent and tokenising has begun
    # while it is being tokenised: /health answers, and a short stream runs to its end
    answered = []
    for _ in range(3):
        status, _, _ = gateway.request("GET", "/health", timeout=30)
        answered.append((status, time.monotonic()))
    status, out = gateway.post("/v1/completions", {"prompt": "Hello", "max_tokens": 4, "temperature": 0},
                               timeout=60)
    assert status == 200 and out["usage"]["completion_tokens"] >= 1
    t_small = time.monotonic()
    t.join(170)
    assert all(s == 200 for s, _ in answered)
    assert answered[-1][1] < result["t_end"] and t_small < result["t_end"], \
        "the other requests waited for the huge prompt's tokenisation"
    assert result["status"] == 400 and result["body"]["error"]["code"] == "context_length_exceeded"
    assert result["body"]["error"]["param"] == "messages"


def _stalled_stream(g: GatewayProc, body: dict) -> socket.socket:
    """A raw HTTP client with a tiny receive buffer that sends a streaming request and then reads nothing."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect((g.host, g.port))
    data = json.dumps({**body, "stream": True}).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
    return s


def _read_all(s: socket.socket, timeout: float = 60.0) -> bytes:
    s.settimeout(timeout)
    out = b""
    while not out.endswith(b"data: [DONE]\n\n") and b"0\r\n\r\n" not in out[-16:]:
        chunk = s.recv(1 << 16)
        if not chunk:
            break
        out += chunk
    return out


@pytest.mark.timeout(180)
def test_a_stream_reader_that_stops_reading_is_stopped_with_a_clear_error(gw_run):
    g = GatewayProc(gw_run, "--max-stream-backlog", "16")
    try:
        cancelled0 = stat(g, "executor", "cancelled")
        s = _stalled_stream(g, {"prompt": [5, 6, 7], "max_tokens": 3900, "ignore_eos": True,
                                "return_token_ids": True})
        # the executor stops once the socket buffers are full and 16 more tokens wait unread
        assert wait_stat(g, "executor", "cancelled", cancelled0 + 1, timeout=150) >= cancelled0 + 1
        raw = _read_all(s).decode()
        s.close()
        events = [line[6:] for line in raw.split("\n") if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        err = json.loads(events[-2])["error"]
        assert err["code"] == "stream_backlog_full" and "--max-stream-backlog" in err["message"]
        tokens = sum(len(json.loads(e)["choices"][0].get("token_ids") or []) for e in events[:-2])
        assert 16 <= tokens < 3900  # it got everything generated before the stop, and the stop came early
        status, out = g.post("/v1/completions", {"prompt": "Hello", "max_tokens": 3, "temperature": 0})
        assert status == 200  # the run serves on
    finally:
        g.stop()


@pytest.mark.timeout(60)
def test_async_client_backlog_stops_the_request_at_the_run(gw_run):
    """The mechanism under the HTTP test, without sockets' buffering in between: a consumer that takes
    nothing for a while gets the queued tokens, then ClientTooSlow; the run is free for the next request."""
    from coli.serve.aclient import AsyncClient, ClientTooSlow
    from coli.protocol.messages import Done

    async def go():
        c = await AsyncClient.connect(gw_run.name, gw_run.env["COLI_RUN_DIR"])
        try:
            st = await c.submit([5, 6, 7], 3000, ignore_eos=True, max_backlog=8)
            await asyncio.sleep(2.0)  # generating at tens of tokens/s: far more than 8 arrive unread
            got = []
            with pytest.raises(ClientTooSlow) as e:
                while True:
                    got.append(await st.next(timeout=30))
            assert len(got) == 8 and all(isinstance(t, int) for t in got)
            assert "8 tokens behind" in str(e.value)
            nxt = await c.submit([5, 6, 7], 3, ignore_eos=True)
            items = [await nxt.next(timeout=30) for _ in range(4)]
            assert isinstance(items[-1], Done) and items[-1].finish_reason == "length"
        finally:
            await c.close()

    asyncio.run(go())


@pytest.mark.timeout(60)
def test_body_over_the_limit_is_413_naming_the_setting(gw_run):
    g = GatewayProc(gw_run, "--max-request-mb", "0.01")
    try:
        big = {"prompt": "a" * 20000, "max_tokens": 1}
        status, out = g.post("/v1/completions", big)
        assert status == 413 and out["error"]["code"] == "body_too_large"
        assert "--max-request-mb" in out["error"]["message"] and "10485" in out["error"]["message"]
        # without a Content-Length (chunked), the limit holds as the body streams in
        c = socket.create_connection((g.host, g.port), timeout=30)
        data = json.dumps(big).encode()
        c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Transfer-Encoding: chunked\r\n\r\n" + f"{len(data):x}\r\n".encode() + data + b"\r\n0\r\n\r\n")
        head = c.recv(4096).decode("latin-1")
        c.close()
        assert head.startswith("HTTP/1.1 413")
        status, out = g.post("/v1/completions", {"prompt": "Hello", "max_tokens": 2})
        assert status == 200
    finally:
        g.stop()


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def _gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z":
                return True  # a zombie: dead, waiting for its parent to collect it
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["sigterm", "sigkill"])
def test_the_tokeniser_process_never_outlives_the_gateway(gw_run, how):
    import signal

    g = GatewayProc(gw_run)
    try:
        status, out = g.post("/v1/completions", {"prompt": "word " * 20000, "max_tokens": 1})
        assert status == 400 and out["error"]["code"] == "context_length_exceeded"  # encoded by the worker
        workers = _children(g.proc.pid)
        assert len(workers) >= 1
        g.proc.send_signal(signal.SIGTERM if how == "sigterm" else signal.SIGKILL)
        g.proc.wait(30)
        assert all(_gone(w) for w in workers), f"tokeniser workers {workers} outlived the gateway ({how})"
    finally:
        g.stop()


@pytest.mark.timeout(120)
def test_a_dead_tokeniser_costs_one_request_and_the_next_gets_a_fresh_one(gw_run):
    import signal

    g = GatewayProc(gw_run)
    try:
        result: dict = {}
        body = {"messages": [{"role": "user", "content": "many words here " * 150000}]}  # ~2.4 MB: seconds
        t = threading.Thread(target=lambda: result.update(zip(("status", "body"), g.post(CHAT, body))))
        t.start()
        deadline = time.monotonic() + 30
        def workers():  # spawn also starts multiprocessing's resource tracker: not that one
            return [c for c in _children(g.proc.pid) if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]

        while not workers() and time.monotonic() < deadline:
            time.sleep(0.02)
        (worker,) = workers()
        os.kill(worker, signal.SIGKILL)
        t.join(60)
        assert result["status"] == 503 and result["body"]["error"]["code"] == "tokenizer_died"
        status, out = g.post("/v1/completions", {"prompt": "word " * 20000, "max_tokens": 1})
        assert status == 400 and out["error"]["code"] == "context_length_exceeded"
        status, out = g.post("/v1/completions", {"prompt": "Hello", "max_tokens": 2})
        assert status == 200
    finally:
        g.stop()
