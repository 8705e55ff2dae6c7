"""What a downloader meets, each a one-line error that says what to do, and nothing finished is lost: no network,
a gated repo without/with a wrong token, a missing repo or revision, a shard whose size or hash disagrees with the
index, and the disk filling up half-way (then the same command resumes to the same bytes)."""

from __future__ import annotations

import os
import resource
import signal
import socket
from pathlib import Path

import pytest

from hub_cli import coli, hub_env, small_tmpfs
from hub_server import HubServer, repo_from_dir

ARGS = ["--experts", "int4", "--dense", "int8", "--no-progress"]
SHARD = "model-00002-of-00003.safetensors"


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def _one_line_error(r) -> str:
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("error: ")]
    # the error is one line, the last; notes before it (the disk the run needs) are fine; no traceback
    assert len(errors) == 1 and lines[-1] == errors[0] and "Traceback" not in r.stderr, r.stderr
    return errors[0]


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_no_network(tmp_path):
    env = hub_env(f"http://127.0.0.1:{_closed_port()}", tmp_path)
    line = _one_line_error(coli(env, "convert", "hf://org/tiny", tmp_path / "dst", *ARGS))
    assert "cannot reach the Hub" in line and "HF_ENDPOINT" in line and "rerun" in line


@pytest.mark.parametrize("command", ["convert", "pull"])
def test_endpoint_answering_503(hub, tmp_path, command):
    hub.fail_status = 503
    args = ("convert", "hf://org/tiny", tmp_path / "d", *ARGS) if command == "convert" else ("pull", "org/tiny")
    line = _one_line_error(coli(hub_env(hub.url, tmp_path), *args))
    assert "answered 503" in line and "down or busy" in line and "rerun" in line


def test_pull_from_a_gated_repo_says_how_to_log_in(small_ckpt, tmp_path):
    with HubServer({"org/gated": repo_from_dir(small_ckpt, token="hf_right")}) as hub:
        line = _one_line_error(coli(hub_env(hub.url, tmp_path), "pull", "org/gated", "--no-progress"))
    assert "org/gated is gated" in line and "hf auth login" in line


@pytest.mark.parametrize("token", [None, "hf_wrong"])
def test_gated_repo_says_how_to_log_in(small_ckpt, tmp_path, token):
    with HubServer({"org/gated": repo_from_dir(small_ckpt, token="hf_right")}) as hub:
        line = _one_line_error(coli(hub_env(hub.url, tmp_path, token), "convert", "hf://org/gated", tmp_path / "d",
                                    *ARGS))
    assert "org/gated is gated" in line and "hf auth login" in line and "HF_TOKEN" in line


def test_gated_repo_with_the_right_token_converts(small_ckpt, tmp_path):
    with HubServer({"org/gated": repo_from_dir(small_ckpt, token="hf_right")}) as hub:
        r = coli(hub_env(hub.url, tmp_path, "hf_right"), "convert", "hf://org/gated", tmp_path / "d", *ARGS)
    assert r.returncode == 0, r.stderr


def test_missing_repo(hub, tmp_path):
    line = _one_line_error(coli(hub_env(hub.url, tmp_path), "convert", "hf://org/nope", tmp_path / "d", *ARGS))
    assert "org/nope: repository not found" in line and "ORG/REPO" in line


def test_missing_revision(hub, tmp_path):
    line = _one_line_error(coli(hub_env(hub.url, tmp_path), "convert", "hf://org/tiny@v9", tmp_path / "d", *ARGS))
    assert "no revision 'v9'" in line


def test_bad_repo_name(tmp_path):
    line = _one_line_error(coli(os.environ, "convert", "hf://just-a-name", tmp_path / "d", *ARGS))
    assert "ORG/REPO" in line


def test_shard_whose_hash_disagrees_is_refused_then_refetched(small_ckpt, hub, tmp_path):
    env = hub_env(hub.url, tmp_path)
    hub.corrupt[("org/tiny", SHARD)] = 5000
    line = _one_line_error(coli(env, "convert", "hf://org/tiny", tmp_path / "hub", *ARGS))
    assert SHARD in line and "sha256" in line and "disagrees with the Hub's index" in line and "rerun" in line
    blobs = Path(env["HF_HUB_CACHE"]) / "models--org--tiny" / "blobs"
    assert len([p for p in blobs.iterdir() if p.stat().st_size > 100_000]) <= 1   # the damaged one is gone
    del hub.corrupt[("org/tiny", SHARD)]
    r = coli(env, "convert", "hf://org/tiny", tmp_path / "hub", *ARGS)
    assert r.returncode == 0, r.stderr
    assert coli(os.environ, "convert", small_ckpt, tmp_path / "local", *ARGS).returncode == 0
    assert _files(tmp_path / "hub") == _files(tmp_path / "local")


def test_shard_whose_size_disagrees_is_refused(small_ckpt, tmp_path):
    repo = repo_from_dir(small_ckpt)
    repo.listed_size = {SHARD: len(repo.files[SHARD]) + 8}
    with HubServer({"org/tiny": repo}) as hub:
        line = _one_line_error(coli(hub_env(hub.url, tmp_path), "convert", "hf://org/tiny", tmp_path / "d", *ARGS))
    assert SHARD in line and f"the Hub's index says {len(repo.files[SHARD]) + 8}" in line


def _file_size_limit(limit: int):
    def pre():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # writes past the limit fail with EFBIG, as on a full disk
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return pre


def test_disk_filling_mid_way_stops_cleanly_and_resumes(small_ckpt, hub, tmp_path):
    env = hub_env(hub.url, tmp_path)
    biggest = max(p.stat().st_size for p in small_ckpt.glob("*.safetensors"))
    r = coli(env, "convert", "hf://org/tiny", tmp_path / "hub", *ARGS, preexec_fn=_file_size_limit(biggest // 2))
    line = _one_line_error(r)
    assert "disk" in line and "free space and rerun the same command" in line
    r = coli(env, "convert", "hf://org/tiny", tmp_path / "hub", *ARGS)
    assert r.returncode == 0, r.stderr
    assert coli(os.environ, "convert", small_ckpt, tmp_path / "local", *ARGS).returncode == 0
    assert _files(tmp_path / "hub") == _files(tmp_path / "local")


def test_not_enough_disk_is_refused_with_what_is_needed_and_free(tmp_path):
    from coli.hub.stream import disk_shortfall

    GB = 10**9
    same = disk_shortfall(tmp_path / "d", tmp_path / "c", 385 * GB, 10 * GB, 2, 390 * GB, None)
    assert "395.00 GB needed" in same and "390.00 GB free" in same and "--max-shards-on-disk" in same
    assert disk_shortfall(tmp_path / "d", tmp_path / "c", 385 * GB, 10 * GB, 2, 400 * GB, None) is None
    cache = disk_shortfall(tmp_path / "d", tmp_path / "c", 385 * GB, 10 * GB, 2, 400 * GB, 5 * GB)
    assert "download cache" in cache and "HF_HUB_CACHE" in cache


def test_index_placing_a_tensor_in_a_shard_without_it_is_refused(small_ckpt, tmp_path):
    import json

    repo = repo_from_dir(small_ckpt)
    index = json.loads(repo.files["model.safetensors.index.json"])
    moved = next(n for n, f in index["weight_map"].items() if f.startswith("model-00003"))
    index["weight_map"][moved] = "model-00001-of-00003.safetensors"
    repo.files["model.safetensors.index.json"] = json.dumps(index).encode()
    with HubServer({"org/tiny": repo}) as hub:
        line = _one_line_error(coli(hub_env(hub.url, tmp_path), "convert", "hf://org/tiny", tmp_path / "d", *ARGS))
    assert repr(moved) in line and "model-00001-of-00003.safetensors" in line and "disagree" in line


def test_convert_onto_a_disk_too_small_is_refused_before_fetching_shards(hub, tmp_path):
    import subprocess

    small = tmp_path / "small-disk"
    if not small_tmpfs(small, "1m"):
        pytest.skip("needs a small file system: root and mount(8) make a 1 MiB tmpfs")
    try:
        env = hub_env(hub.url, tmp_path)
        env["HF_HUB_CACHE"] = str(small / "hf-cache")     # the cache and DST on one small disk
        line = _one_line_error(coli(env, "convert", "hf://org/tiny", small / "dst", *ARGS))
        assert "not enough disk" in line and "needed" in line and "free" in line and "--max-shards-on-disk" in line
        assert not [r for r in hub.requests if r[0] == "GET" and r[1].endswith(".safetensors")]
    finally:
        subprocess.run(["umount", str(small)], check=False)
