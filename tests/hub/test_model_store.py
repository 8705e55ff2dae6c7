"""`coli up --model <checkpoint>`: converted once with `coli convert`'s defaults (not f32), in the foreground
(also with --detach), into a cache keyed on the checkpoint's content; touching config.json reuses the entry, an
edit replaces the stale one; `coli models` lists the conversion with its source and `coli models rm` removes it;
a disk too small is refused with what is needed and free."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from hub_cli import coli, small_tmpfs
from coli.container.format import parse_manifest


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("COLI_CACHE", str(tmp_path / "coli-cache"))
    return tmp_path / "coli-cache"


@pytest.fixture
def ckpt(small_ckpt, tmp_path) -> Path:
    return Path(shutil.copytree(small_ckpt, tmp_path / "my-ckpt"))


def _convert(ckpt):
    from coli.model_store import resolve_container
    notes = []
    return resolve_container(ckpt, report=notes.append), notes


def test_checkpoint_converts_with_coli_convert_defaults_and_is_listed(cache, ckpt):
    dst, notes = _convert(ckpt)
    assert parse_manifest(dst / "coli-manifest.json").args["experts"] == "int4"
    assert parse_manifest(dst / "coli-manifest.json").args["dense"] == "int8"
    assert any("converting" in n and "--experts int4 --dense int8" in n for n in notes)
    r = coli(dict(os.environ), "models", "--json")
    rows = [json.loads(x) for x in r.stdout.splitlines()]
    assert [(m["name"], m["kind"], m["source"], m["format"]) for m in rows] == \
        [(dst.name, "converted", str(ckpt.resolve()), "experts int4, dense int8")]
    assert rows[0]["size"] > 0
    r = coli(dict(os.environ), "models", "rm", dst.name)
    assert r.returncode == 0, r.stderr
    assert not dst.exists() and coli(dict(os.environ), "models", "--json").stdout.strip() == ""


def test_touching_config_reuses_the_entry_and_an_edit_replaces_it(cache, ckpt):
    first, _ = _convert(ckpt)
    os.utime(ckpt / "config.json", (time.time() + 100, time.time() + 100))
    again, notes = _convert(ckpt)
    assert again == first and not any("converting" in n for n in notes)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["rope_theta"] = cfg.get("rope_theta", 10000.0) * 2
    (ckpt / "config.json").write_text(json.dumps(cfg))
    edited, notes = _convert(ckpt)
    assert edited != first and not first.exists()
    assert any("removed the stale conversion" in n for n in notes)
    assert [p.name for p in (cache / "containers").iterdir()] == [edited.name]


def test_detached_up_converts_in_the_foreground(ckpt, tmp_path):
    root = Path(tempfile.mkdtemp(prefix="colims-", dir="/tmp"))   # ipc:// paths must stay short
    env = {**os.environ, "COLI_CACHE": str(tmp_path / "cc"), "COLI_RUN_DIR": str(root), "OMP_NUM_THREADS": "1"}
    name = f"ms{os.getpid() % 10000}"
    try:
        r = coli(env, "up", "--model", ckpt, "--name", name, "--detach", "--ram-gb", "0.5", "--startup-timeout", "60")
        assert r.returncode == 0, r.stdout + r.stderr
        # the conversion's lines came from the foreground as it ran, not from the detached run's log at the end
        assert "converting" in r.stderr and "--experts int4 --dense int8" in r.stderr
        assert "converting" not in (root / f"{name}.up.log").read_text()
    finally:
        coli(env, "down", "--name", name)
        shutil.rmtree(root, ignore_errors=True)


def test_a_disk_too_small_is_refused_with_needed_and_free(ckpt, tmp_path):
    small = tmp_path / "small-disk"
    if not small_tmpfs(small, "256k"):
        pytest.skip("needs a small file system: root and mount(8) make a 256 KiB tmpfs")
    try:
        env = {**os.environ, "COLI_CACHE": str(small)}
        r = coli(env, "up", "--model", ckpt)
        assert r.returncode == 2, r.stderr
        line = r.stderr.strip().splitlines()[-1]
        assert line.startswith("error: ") and "needs" in line and "free" in line and "COLI_CACHE" in line, r.stderr
    finally:
        subprocess.run(["umount", str(small)], check=False)


def test_the_demo_model_named_by_its_path_stays_lossless(cache):
    from coli.model_store import DEMO_DIR, resolve_container

    if not (DEMO_DIR / "config.json").is_file():
        pytest.skip("the demo model (coli/demo/model) is not built")
    dst = resolve_container(DEMO_DIR, report=lambda m: None)
    args = parse_manifest(dst / "coli-manifest.json").args
    assert (args["experts"], args["dense"]) == ("f32", "f32")


def test_up_on_an_unfinished_hub_conversion_says_how_to_resume(small_ckpt, tmp_path):
    import signal

    from hub_cli import hub_env
    from hub_server import HubServer, repo_from_dir

    dst = tmp_path / "dst"
    with HubServer({"org/tiny": repo_from_dir(small_ckpt)}) as hub:
        hub.chunk_delay = 0.05
        env = hub_env(hub.url, tmp_path)
        p = subprocess.Popen([sys.executable, "-m", "coli.cli.main", "convert", "hf://org/tiny", str(dst),
                              "--no-progress"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while not (dst / "coli-hub.journal").is_file() and time.monotonic() < deadline:
            time.sleep(0.01)
        p.send_signal(signal.SIGKILL)
        p.wait()
    r = coli(env, "up", "--model", dst)
    assert r.returncode == 2
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith("error: ") and "unfinished conversion" in line and f"coli convert hf://org/tiny {dst}" in line
