"""`coli convert hf://ORG/REPO DST` through the real huggingface_hub client against a local Hub: the container is
byte-identical to `coli convert` of the same files on disk, never more than --max-shards-on-disk shards are on disk,
and a run killed at random points resumes to the same bytes without fetching consumed shards again."""

from __future__ import annotations

import hashlib
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from hub_cli import coli, hub_env
from hub_server import HubServer, repo_from_dir
from coli.hub.journal import JOURNAL, read_journal

ARGS = ["--experts", "int4", "--dense", "int8", "--group", "32", "--tile-kb", "64", "--expert-file-mb", "8",
        "--commit-mb", "1", "--no-progress"]


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


class ShardWatch:
    """Polls the cache's blobs/ folder and keeps the most shards (whole or partial) seen there at once."""

    def __init__(self, cache: Path, ckpt: Path):
        self.blobs = cache / "models--org--big" / "blobs"
        self.shas = {hashlib.sha256(p.read_bytes()).hexdigest() for p in ckpt.glob("*.safetensors")}
        self.most = 0
        self.stop = threading.Event()
        self.t = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self.stop.is_set():
            try:
                present = {p.name.split(".")[0] for p in self.blobs.iterdir()} & self.shas
                self.most = max(self.most, len(present))
            except FileNotFoundError:
                pass
            time.sleep(0.001)

    def __enter__(self):
        self.t.start()
        return self

    def __exit__(self, *a):
        self.stop.set()
        self.t.join()


@pytest.fixture(scope="module")
def local_ref(big_ckpt, tmp_path_factory) -> dict[str, bytes]:
    ref = tmp_path_factory.mktemp("hub-ref") / "ref"
    r = coli(os.environ, "convert", big_ckpt, ref, *ARGS)
    assert r.returncode == 0, r.stderr
    return _files(ref)


@pytest.mark.parametrize("max_shards", [1, 2])
def test_hf_convert_is_byte_identical_with_bounded_shards(big_ckpt, local_ref, tmp_path, max_shards):
    with HubServer({"org/big": repo_from_dir(big_ckpt)}) as hub:
        env = hub_env(hub.url, tmp_path)
        with ShardWatch(Path(env["HF_HUB_CACHE"]), big_ckpt) as watch:
            r = coli(env, "convert", "hf://org/big", tmp_path / "dst", *ARGS, "--max-shards-on-disk", max_shards)
        assert r.returncode == 0, r.stderr
    assert _files(tmp_path / "dst") == local_ref
    assert 1 <= watch.most <= max_shards, f"{watch.most} shards on disk at once"
    assert "at most" in r.stderr and "GB" in r.stderr   # the disk it needs, printed before starting
    if max_shards == 1:
        assert "span shards staged" in r.stderr          # records across a shard boundary went through the stage
    left = list((Path(env["HF_HUB_CACHE"]) / "models--org--big" / "blobs").iterdir())
    assert not [p for p in left if p.name.split(".")[0] in watch.shas], "converted shards must be deleted"


def test_hf_convert_killed_at_random_points_resumes_byte_identical(big_ckpt, local_ref, tmp_path):
    seed = int.from_bytes(os.urandom(4), "little")
    rng = random.Random(seed)
    dst = tmp_path / "dst"
    with HubServer({"org/big": repo_from_dir(big_ckpt)}) as hub:
        hub.chunk_delay = 0.004          # ~15 MB/s: a download takes long enough to be killed inside
        env = hub_env(hub.url, tmp_path)
        cmd = [sys.executable, "-m", "coli.cli.main", "convert", "hf://org/big", str(dst), *ARGS]
        kills = 0
        for attempt in range(6):
            consumed = read_journal(dst / JOURNAL).consumed
            n_before = len(hub.requests)
            p = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            try:
                p.wait(timeout=rng.uniform(0.5, 4.0))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
                kills += 1
            p.stderr.close()
            again = {path.rsplit("/", 1)[1] for m, path, _ in hub.requests[n_before:] if m == "GET"} & consumed
            assert not again, f"consumed shards fetched again: {again} (seed {seed})"
            if p.returncode == 0:
                break
        hub.chunk_delay = 0.0
        consumed = read_journal(dst / JOURNAL).consumed
        n_before = len(hub.requests)
        r = coli(env, "convert", "hf://org/big", dst, *ARGS)
        assert r.returncode == 0, r.stderr
        again = {path.rsplit("/", 1)[1] for m, path, _ in hub.requests[n_before:] if m == "GET"} & consumed
        assert not again, f"consumed shards fetched again: {again} (seed {seed})"
    assert kills >= 1, f"no kill landed (seed {seed})"
    assert _files(dst) == local_ref, f"seed {seed}"


def test_dropped_connection_is_retried_and_the_result_is_identical(small_ckpt, tmp_path):
    shard = "model-00002-of-00003.safetensors"
    with HubServer({"org/tiny": repo_from_dir(small_ckpt)}) as hub:
        hub.drop_once[("org/tiny", shard)] = 4096
        env = hub_env(hub.url, tmp_path)
        r = coli(env, "convert", "hf://org/tiny", tmp_path / "hub", *ARGS)
        assert r.returncode == 0, r.stderr
        gets = hub.gets(shard)
        # huggingface_hub retries a dropped stream; with a Range from what it had written (it writes 10 MiB chunks)
        assert len(gets) == 2 and gets[0] is None and (gets[1] is None or gets[1].startswith("bytes=")), gets
    assert coli(os.environ, "convert", small_ckpt, tmp_path / "local", *ARGS).returncode == 0
    assert _files(tmp_path / "hub") == _files(tmp_path / "local")


def test_resume_keeps_the_commit_it_started_from_when_the_branch_moves(big_ckpt, local_ref, tmp_path):
    import make_fp8_checkpoint as mk

    other = tmp_path / "other"
    mk.build_checkpoint(other, seed=4, experts=80, random_codes=True, tokenizer=False, shards=5)
    dst = tmp_path / "dst"
    with HubServer({"org/big": repo_from_dir(big_ckpt)}) as hub:
        hub.chunk_delay = 0.004
        env = hub_env(hub.url, tmp_path)
        p = subprocess.Popen([sys.executable, "-m", "coli.cli.main", "convert", "hf://org/big@main", str(dst), *ARGS],
                             env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while not read_journal(dst / JOURNAL).consumed and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        p.kill()
        p.wait()
        assert read_journal(dst / JOURNAL).consumed, "the kill should land after a shard was consumed"
        first = hub.repos["org/big"].commit
        hub.repos["org/big"].push(repo_from_dir(other).files, "f" * 40)   # main moves on
        hub.chunk_delay = 0.0
        n = len(hub.requests)
        r = coli(env, "convert", "hf://org/big@main", dst, *ARGS)
        assert r.returncode == 0, r.stderr
        resolved = [path for m, path, _ in hub.requests[n:] if "/resolve/" in path]
        assert resolved and all(f"/resolve/{first}/" in path for path in resolved)
    assert _files(dst) == local_ref
