"""The API key can come from a file (--api-key-file) or the environment (COLI_API_KEY) so that it is not on the
command line, where `ps` shows it to every local user; bearer and x-api-key headers both carry it; a bad key
source is a one-line error naming it; `coli up --http` passes only the file's path to its gateway."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from gateway_proc import GatewayProc

KEY = "k3y-from-elsewhere-0123456789"
BODY = {"prompt": "Hi", "max_tokens": 2}


def _help(run, cmd: str) -> str:
    """`coli CMD --help` as plain words (rich draws boxes around the options)."""
    out = run.coli(cmd, "--help", timeout=30).stdout
    return " ".join(re.sub(r"[│╭╮╰╯─]", " ", out).split())


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def _check_auth(g: GatewayProc) -> None:
    status, out = g.post("/v1/completions", BODY)
    assert status == 401 and out["error"]["code"] == "invalid_api_key"
    status, _ = g.post("/v1/completions", BODY, headers={"x-api-key": "wrong"})
    assert status == 401
    status, _ = g.post("/v1/completions", BODY, headers={"Authorization": f"Bearer {KEY}"})
    assert status == 200
    status, _ = g.post("/v1/completions", BODY, headers={"x-api-key": KEY})
    assert status == 200


@pytest.mark.timeout(120)
def test_key_from_a_file_is_not_on_the_command_line(gw_run, tmp_path):
    f = tmp_path / "key"
    f.write_text(KEY + "\n")
    f.chmod(0o600)
    g = GatewayProc(gw_run, "--api-key-file", str(f))
    try:
        assert KEY not in _cmdline(g.proc.pid)
        _check_auth(g)
        assert "readable by other users" not in g.log.read_text()
    finally:
        g.stop()


@pytest.mark.timeout(120)
def test_key_from_the_environment(gw_run):
    env = {**gw_run.env, "COLI_API_KEY": KEY}
    g = GatewayProc(gw_run, env=env)
    try:
        assert KEY not in _cmdline(g.proc.pid)
        _check_auth(g)
    finally:
        g.stop()


@pytest.mark.timeout(120)
def test_bad_key_sources_are_one_line_errors(gw_run, tmp_path):
    empty = tmp_path / "empty"
    empty.write_text("\n")
    two = tmp_path / "two"
    two.write_text("a\nb\n")
    cases = [
        (("--api-key-file", str(tmp_path / "missing")), "cannot read it"),
        (("--api-key-file", str(empty)), "the file is empty"),
        (("--api-key-file", str(two)), "more than one line"),
        (("--api-key-file", str(two), "--api-key", "x"), "not both"),
        (("--api-key", " "), "is empty"),
    ]
    for args, why in cases:
        r = gw_run.coli("serve", "--name", gw_run.name, "--http", "127.0.0.1:0", *args, timeout=60)
        lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
        assert r.returncode != 0 and len(lines) == 1 and why in lines[0], (args, r.stderr)
    world = tmp_path / "world"
    world.write_text(KEY)
    world.chmod(0o644)
    g = GatewayProc(gw_run, "--api-key-file", str(world))
    try:
        _check_auth(g)
        assert "readable by other users (chmod 600 it)" in g.log.read_text()
    finally:
        g.stop()


@pytest.mark.timeout(60)
def test_up_takes_a_key_file_for_its_gateway_and_help_says_where_keys_come_from(gw_run, tmp_path):
    r = gw_run.coli("up", "--name", "nokeyrun", "--api-key-file", str(tmp_path / "k"), timeout=30)
    assert r.returncode != 0 and "give --http too" in r.stderr
    r = gw_run.coli("up", "--name", "nokeyrun", "--http", "127.0.0.1:0", "--api-key-file", str(tmp_path / "k"),
                    timeout=30)
    assert r.returncode != 0 and "cannot read it" in r.stderr  # refused before any stage starts
    assert not (Path(gw_run.env["COLI_RUN_DIR"]) / "nokeyrun" / "state.json").exists()
    for cmd in ("serve", "up"):
        text = _help(gw_run, cmd)
        assert "--api-key-file" in text and "COLI_API_KEY" in text, cmd
    assert "visible to every local user in `ps`" in _help(gw_run, "serve")


@pytest.mark.timeout(180)
def test_up_http_with_a_key_file_gives_its_gateway_the_path_not_the_key(gw_run, text_model_dir, tmp_path):
    import subprocess
    import sys
    import time
    import urllib.error
    import urllib.request

    f = tmp_path / "key"
    f.write_text(KEY)
    f.chmod(0o600)
    name = f"gwk{os.getpid() % 10000}"
    r = subprocess.run([sys.executable, "-m", "coli.cli.main", "up", "--model", str(text_model_dir), "--name", name,
                        "--ram-gb", "0.5", "--http", "127.0.0.1:0", "--api-key-file", str(f), "--detach"],
                       env=gw_run.env, capture_output=True, text=True, timeout=150)
    assert r.returncode == 0, r.stderr + r.stdout
    pid = int(re.search(r"HTTP gateway starting on \S+ beside run '[^']+' \(pid (\d+)", r.stdout).group(1))
    log = gw_run.run_base / f"{name}.serve.log"
    try:
        assert KEY not in _cmdline(pid) and str(f) in _cmdline(pid)
        deadline = time.monotonic() + 60
        while not (m := re.search(r"listening on (http://\S+)", log.read_text())) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert m, log.read_text()
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(m.group(1) + "/v1/models", timeout=10)
        assert e.value.code == 401
        req = urllib.request.Request(m.group(1) + "/v1/models", headers={"x-api-key": KEY})
        with urllib.request.urlopen(req, timeout=10) as resp:
            assert resp.status == 200
    finally:
        subprocess.run([sys.executable, "-m", "coli.cli.main", "down", "--name", name], env=gw_run.env, timeout=60)
