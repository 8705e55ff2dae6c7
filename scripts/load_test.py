#!/usr/bin/env python3
"""Bounded load test of the HTTP gateway (`coli serve`), loopback only.

N concurrent clients each send R streaming requests one after another (greedy, so a prompt always gives
the same tokens) and check every stream: each `data:` line is JSON, every chunk carries the request's
own id (unique across all requests), the stream ends with a finish_reason chunk, a usage chunk and
`[DONE]`, the token ids in the chunks number usage.completion_tokens, and every answer to the same
prompt is identical (a stream mixed up with another request's would differ). It reports latency
(request sent -> [DONE]) and time to first token at p50/p99, and tokens/s over the whole run.

    coli up -d && coli serve --http 127.0.0.1:8000 &
    .venv/bin/python scripts/load_test.py --url http://127.0.0.1:8000 --clients 16 --requests 20

Only the standard library (http.client in threads: the client side must not be the bottleneck of the
server, which batches up to --max-batch requests at once). Figures: docs/performance.md, "Continuous batching"."""

from __future__ import annotations

import argparse
import http.client
import ipaddress
import json
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from urllib.parse import urlparse

PROMPTS = [
    "What does os.path.join do?",
    "Hello! Who are you?",
    "Explain what a list comprehension is.",
    "What is the difference between a tuple and a list?",
    "How do I read a file line by line?",
    "What does the math.sqrt function return?",
    "Tell me about the itertools module.",
    "What is a generator?",
]


@dataclass
class Result:
    client: int
    index: int
    prompt: int
    ok: bool
    error: str | None = None
    request_id: str | None = None
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    usage: dict | None = None
    latency_s: float = 0.0
    ttft_s: float | None = None
    gaps_s: list[float] = field(default_factory=list)   # between consecutive token chunks (inter-token latency)


def _check_loopback(url: str) -> tuple[str, int]:
    u = urlparse(url)
    host = u.hostname or ""
    ok = host == "localhost"
    try:
        ok = ok or ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    if not ok or u.scheme != "http":
        raise SystemExit(f"--url {url}: this load test only targets http:// on a loopback address")
    return host, u.port or 80


def one_request(host: str, port: int, endpoint: str, prompt: str, max_tokens: int, model: str | None,
                api_key: str | None, timeout: float, r: Result) -> Result:
    body = {"max_tokens": max_tokens, "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
            "return_token_ids": True}
    if model:
        body["model"] = model
    if endpoint == "chat":
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": prompt}]
    else:
        path, body["prompt"] = "/v1/completions", prompt
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    t0 = time.monotonic()
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("POST", path, json.dumps(body), headers)
        resp = conn.getresponse()
        if resp.status != 200:
            r.error = f"HTTP {resp.status}: {resp.read()[:300]!r}"
            return r
        if not resp.getheader("content-type", "").startswith("text/event-stream"):
            r.error = f"content-type {resp.getheader('content-type')!r}"
            return r
        done = False
        texts = []
        while True:
            line = resp.readline()
            if not line:
                break
            line = line.rstrip(b"\r\n")
            if not line:
                continue
            if not line.startswith(b"data: "):
                r.error = f"not an SSE data line: {line[:100]!r}"
                return r
            data = line[6:]
            if data == b"[DONE]":
                done = True
                break
            if r.usage is not None:
                r.error = "a chunk after the usage chunk"
                return r
            obj = json.loads(data)
            if "error" in obj:
                r.error = f"error in stream: {obj['error']}"
                return r
            if r.request_id is None:
                r.request_id = obj["id"]
            elif obj["id"] != r.request_id:
                r.error = f"chunk of {obj['id']} inside the stream of {r.request_id}"
                return r
            if obj.get("usage"):
                r.usage = obj["usage"]
                continue
            ch = obj["choices"][0]
            ids = ch.get("token_ids") or []
            if ids:
                now = time.monotonic()
                if r.ttft_s is None:
                    r.ttft_s = now - t0
                else:
                    r.gaps_s.append(now - last)
                last = now
            r.token_ids.extend(ids)
            texts.append((ch["delta"].get("content") or "") if endpoint == "chat" else (ch.get("text") or ""))
            if ch.get("finish_reason"):
                if r.finish_reason is not None:
                    r.error = "two finish_reason chunks"
                    return r
                r.finish_reason = ch["finish_reason"]
        r.latency_s = time.monotonic() - t0
        r.text = "".join(texts)
        if not done:
            r.error = "stream ended without [DONE]"
        elif r.finish_reason not in ("stop", "length"):
            r.error = f"finish_reason {r.finish_reason!r}"
        elif r.usage is None:
            r.error = "no usage chunk"
        elif r.usage["completion_tokens"] != len(r.token_ids):
            r.error = f"usage says {r.usage['completion_tokens']} tokens, the chunks carried {len(r.token_ids)}"
        else:
            r.ok = True
        return r
    except (OSError, http.client.HTTPException, ValueError, KeyError, IndexError) as e:
        r.error = f"{type(e).__name__}: {e}"
        return r
    finally:
        conn.close()


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    k = min(len(v) - 1, max(0, round(q / 100 * (len(v) - 1))))
    return v[k]


def run_load(url: str, clients: int = 16, requests: int = 20, max_tokens: int = 32, endpoint: str = "chat",
             model: str | None = None, api_key: str | None = None, timeout: float = 600.0,
             deadline_s: float = 1800.0, prompts: list[str] = PROMPTS) -> dict:
    """Run the load; returns a summary dict (see `summarize`). Bounded by clients x requests and deadline_s."""
    host, port = _check_loopback(url)
    results: list[Result] = []
    lock = threading.Lock()
    stop_at = time.monotonic() + deadline_s

    def client(i: int) -> None:
        for j in range(requests):
            if time.monotonic() > stop_at:
                break
            k = (i * requests + j) % len(prompts)
            r = one_request(host, port, endpoint, prompts[k], max_tokens, model, api_key, timeout,
                            Result(i, j, k, False))
            with lock:
                results.append(r)

    t0 = time.monotonic()
    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, stop_at - time.monotonic()) + timeout)
    wall = time.monotonic() - t0
    return summarize(results, wall, clients, requests, max_tokens, endpoint)


def summarize(results: list[Result], wall: float, clients: int, requests: int, max_tokens: int,
              endpoint: str) -> dict:
    errors = [f"client {r.client} request {r.index}: {r.error}" for r in results if not r.ok]
    ids = [r.request_id for r in results if r.request_id]
    if len(set(ids)) != len(ids):
        errors.append("a request id was used by two streams")
    by_prompt: dict[int, set] = {}
    for r in results:
        if r.ok:
            by_prompt.setdefault(r.prompt, set()).add(tuple(r.token_ids))
    for k, outs in by_prompt.items():
        if len(outs) > 1:
            errors.append(f"prompt {k} got {len(outs)} different greedy answers (streams mixed up?)")
    ok = [r for r in results if r.ok]
    lat = [r.latency_s for r in ok]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    gaps = [g for r in ok for g in r.gaps_s]
    tokens = sum(len(r.token_ids) for r in ok)
    return {
        "clients": clients, "requests_per_client": requests, "max_tokens": max_tokens, "endpoint": endpoint,
        "expected": clients * requests, "completed": len(ok), "failed": len(results) - len(ok),
        "missing": clients * requests - len(results), "errors": errors[:50],
        "wall_s": round(wall, 3), "tokens": tokens, "tokens_per_s": round(tokens / wall, 2) if wall else None,
        "requests_per_s": round(len(ok) / wall, 3) if wall else None,
        "latency_s": {"p50": _round(_pct(lat, 50)), "p99": _round(_pct(lat, 99)), "max": _round(max(lat, default=None))},
        "ttft_s": {"p50": _round(_pct(ttft, 50)), "p99": _round(_pct(ttft, 99)), "max": _round(max(ttft, default=None))},
        "inter_token_s": {"p50": _round(_pct(gaps, 50)), "p99": _round(_pct(gaps, 99)),
                          "max": _round(max(gaps, default=None))},
        "distinct_prompts": len(by_prompt),
    }


def _round(v):
    return None if v is None else round(v, 3)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=20, help="requests per client, one after another")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--endpoint", choices=("chat", "completions"), default="chat")
    ap.add_argument("--model", default=None)
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    ap.add_argument("--deadline", type=float, default=1800.0, help="stop issuing requests after this many seconds")
    ap.add_argument("--json", action="store_true", help="print the summary as JSON")
    a = ap.parse_args(argv)
    if not (1 <= a.clients <= 256 and 1 <= a.requests <= 1000):
        ap.error("--clients must be 1..256 and --requests 1..1000")
    s = run_load(a.url, a.clients, a.requests, a.max_tokens, a.endpoint, a.model, a.api_key, a.timeout, a.deadline)
    if a.json:
        print(json.dumps(s, indent=1))
    else:
        print(f"{s['completed']}/{s['expected']} requests completed ({s['failed']} failed, {s['missing']} not sent) "
              f"by {s['clients']} clients in {s['wall_s']} s")
        print(f"latency p50 {s['latency_s']['p50']} s, p99 {s['latency_s']['p99']} s; time to first token "
              f"p50 {s['ttft_s']['p50']} s, p99 {s['ttft_s']['p99']} s; between tokens p50 "
              f"{s['inter_token_s']['p50']} s, p99 {s['inter_token_s']['p99']} s")
        print(f"{s['tokens']} tokens, {s['tokens_per_s']} tokens/s, {s['requests_per_s']} requests/s")
        for e in s["errors"]:
            print("error:", e)
    return 0 if not s["errors"] and s["completed"] == s["expected"] else 1


if __name__ == "__main__":
    sys.exit(main())
