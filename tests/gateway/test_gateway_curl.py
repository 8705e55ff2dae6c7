"""Plain `curl` against the gateway (what a shell user or a script does), and the /metrics exposition."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest

pytestmark = pytest.mark.skipif(shutil.which("curl") is None, reason="needs curl")


def curl(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(["curl", "-sS", *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.timeout(120)
def test_curl_chat_completions_plain_and_streaming(gateway):
    body = {"messages": [{"role": "user", "content": "Hello! Who are you?"}], "max_tokens": 16, "temperature": 0}
    r = curl(f"{gateway.url}/v1/chat/completions", "-H", "Content-Type: application/json", "-d", json.dumps(body))
    assert r.returncode == 0, r.stderr
    full = json.loads(r.stdout)
    assert full["object"] == "chat.completion" and full["usage"]["completion_tokens"] >= 1
    r = curl("-N", f"{gateway.url}/v1/chat/completions", "-H", "Content-Type: application/json",
             "-d", json.dumps({**body, "stream": True}))
    assert r.returncode == 0, r.stderr
    events = [ln[len("data: "):] for ln in r.stdout.splitlines() if ln.strip()]
    assert all(ln.startswith("data: ") for ln in r.stdout.splitlines() if ln.strip())
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert {c["id"] for c in chunks} == {chunks[0]["id"]}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == full["choices"][0]["message"]["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == full["choices"][0]["finish_reason"]


@pytest.mark.timeout(60)
def test_curl_completions_models_health(gateway):
    r = curl(f"{gateway.url}/v1/completions", "-d", '{"prompt": "Hello", "max_tokens": 5, "temperature": 0}')
    out = json.loads(r.stdout)
    assert out["object"] == "text_completion" and out["usage"]["prompt_tokens"] >= 1
    models = json.loads(curl(f"{gateway.url}/v1/models").stdout)
    assert models["object"] == "list" and models["data"][0]["object"] == "model"
    r = curl("-w", "%{http_code}", "-o", "/dev/null", f"{gateway.url}/health")
    assert r.stdout == "200"
    health = json.loads(curl(f"{gateway.url}/health").stdout)
    assert health["status"] == "ok" and set(health["stages"].values()) == {"ready"}


_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\]|\\.)*"'
                     r'(?:,[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\]|\\.)*")*\})? (-?[0-9.e+-]+|NaN|[+-]Inf)$')


@pytest.mark.timeout(60)
def test_metrics_is_prometheus_text_with_gateway_and_stage_series(gateway):
    gateway.post("/v1/completions", {"prompt": "Hi", "max_tokens": 3})
    r = curl("-i", f"{gateway.url}/metrics")
    head, _, text = r.stdout.partition("\n\n")  # text=True turned CRLF into LF
    assert text.strip()
    assert "text/plain; version=0.0.4" in head
    typed: dict[str, str] = {}
    helped = set()
    for line in text.splitlines():
        if line.startswith("# HELP "):
            helped.add(line.split()[2])
        elif line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            assert kind in ("counter", "gauge", "histogram") and name in helped
            typed[name] = kind
        else:
            m = _SAMPLE.match(line)
            assert m, f"not a Prometheus sample line: {line!r}"
            name = m.group(1)
            family = re.sub(r"_(bucket|sum|count)$", "", name) if name not in typed else name
            assert family in typed, f"{name} has no TYPE line before it"
    assert typed["coli_gateway_requests_total"] == "counter"
    assert typed["coli_gateway_request_duration_seconds"] == "histogram"
    assert 'coli_gateway_requests_total{code="200",endpoint="/v1/completions"}' in text
    assert re.search(r'^coli_stage_tokens\{stage="executor"\} \d+', text, re.M)
    assert re.search(r'^coli_stage_requests\{stage="supervisor"\} \d+', text, re.M)
