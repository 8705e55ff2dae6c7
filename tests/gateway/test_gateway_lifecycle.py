"""--api-key, the run going away and coming back while the gateway keeps serving, --exit-with-run, and a
small bounded version of scripts/load_test.py (concurrent streaming clients, nothing lost or mixed up)."""

from __future__ import annotations

import json
import os
import time

import pytest

from gateway_proc import GatewayProc
from harness import Run


@pytest.mark.timeout(120)
def test_api_key_is_mandatory_when_set(gw_run):
    from openai import AuthenticationError, OpenAI

    g = GatewayProc(gw_run, "--api-key", "s3cret")
    try:
        body = {"prompt": "Hi", "max_tokens": 2}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic s3cret"}):
            status, out = g.post("/v1/completions", body, headers=headers)
            assert status == 401 and out["error"]["code"] == "invalid_api_key"
        status, _, _ = g.request("GET", "/v1/models")
        assert status == 401
        status, _, _ = g.request("GET", "/metrics")
        assert status == 401
        status, _, _ = g.request("GET", "/health")  # liveness probes need no key
        assert status == 200
        status, out = g.post("/v1/completions", body, headers={"Authorization": "Bearer s3cret"})
        assert status == 200
        ok = OpenAI(base_url=g.url + "/v1", api_key="s3cret", max_retries=0)
        assert ok.completions.create(model=ok.models.list().data[0].id, prompt="Hi", max_tokens=2).usage
        with pytest.raises(AuthenticationError):
            OpenAI(base_url=g.url + "/v1", api_key="nope", max_retries=0).models.list()
    finally:
        g.stop()


@pytest.mark.timeout(180)
def test_run_down_gives_503_and_the_gateway_reconnects_when_it_is_back(gw_root, text_model_dir):
    name = f"gwr{os.getpid() % 10000}"
    run = Run(text_model_dir, name, gw_root / "runs", gw_root / "cache", ram_gb=1.0)
    run.wait_ready()
    g = GatewayProc(run)
    g_exit = GatewayProc(run, "--exit-with-run")
    try:
        body = {"prompt": "Hello", "max_tokens": 3, "temperature": 0}
        status, before = g.post("/v1/completions", body)
        assert status == 200
        assert run.coli("down", "--name", name).returncode == 0
        run.proc.wait(30)
        status, out = g.post("/v1/completions", body)
        assert status == 503 and out["error"]["code"] == "run_unavailable"
        status, _, data = g.request("GET", "/health")
        assert status == 503 and json.loads(data)["status"] == "unavailable"
        assert g_exit.proc.wait(10) == 0  # --exit-with-run: gone with the run
        run2 = Run(text_model_dir, name, gw_root / "runs", gw_root / "cache", ram_gb=1.0)
        try:
            run2.wait_ready()
            status, after = g.post("/v1/completions", body)
            assert status == 200 and after["choices"][0]["text"] == before["choices"][0]["text"]
            assert g.request("GET", "/health")[0] == 200
        finally:
            run2.stop()
    finally:
        g.stop()
        g_exit.stop()
        run.stop()


@pytest.mark.timeout(180)
def test_small_load_every_stream_complete_and_unmixed(gateway):
    from load_test import run_load

    s = run_load(gateway.url, clients=4, requests=3, max_tokens=8, prompts=["Hello", "What is a generator?",
                                                                           "Tell me about lists."])
    assert s["errors"] == [] and s["completed"] == s["expected"] == 12 and s["missing"] == 0
    assert s["distinct_prompts"] == 3 and s["latency_s"]["p99"] is not None
    assert s["inter_token_s"]["p99"] is not None      # the time between a stream's tokens is measured too


@pytest.mark.timeout(180)
def test_coli_up_http_starts_the_gateway_beside_the_run_and_it_exits_with_it(gw_run, text_model_dir):
    import re
    import subprocess
    import sys
    import urllib.request

    from harness import pid_gone

    name = f"gwh{os.getpid() % 10000}"
    r = subprocess.run([sys.executable, "-m", "coli.cli.main", "up", "--model", str(text_model_dir), "--name", name,
                        "--ram-gb", "0.5", "--http", "127.0.0.1:0", "--detach"], env=gw_run.env, capture_output=True,
                       text=True, timeout=150)
    assert r.returncode == 0, r.stderr + r.stdout
    pid = int(re.search(r"HTTP gateway starting on \S+ beside run '[^']+' \(pid (\d+)", r.stdout).group(1))
    log = gw_run.run_base / f"{name}.serve.log"
    try:
        deadline = time.monotonic() + 60
        while not (m := re.search(r"listening on (http://\S+)", log.read_text())) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert m, log.read_text()
        with urllib.request.urlopen(m.group(1) + "/health", timeout=10) as resp:
            assert resp.status == 200 and json.loads(resp.read())["run"] == name
    finally:
        subprocess.run([sys.executable, "-m", "coli.cli.main", "down", "--name", name], env=gw_run.env, timeout=60)
    deadline = time.monotonic() + 15
    while not pid_gone(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert pid_gone(pid), "the gateway outlived its run"
