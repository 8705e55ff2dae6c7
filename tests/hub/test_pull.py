"""`coli pull ORG/REPO` of a published container from a local Hub, then `coli up --model ORG/REPO` serves the
oracle's tokens exactly; `coli models` lists it (size, format, source, verified) and `coli models rm` removes it;
a flipped byte — on the wire or in the published file — is refused at pull time with the file named, and the model
stays unusable until a pull verifies it."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from hub_cli import coli, hub_env, small_tmpfs
from harness import Run, assert_run_gone
from hub_server import HubServer, repo_from_dir
from oracles import load_oracle, oracle_dir


@pytest.fixture(scope="module")
def oracle_ckpt(tmp_path_factory) -> Path:
    """The default oracle: a tiny glm_moe_dsa saved by transformers."""
    return oracle_dir(tmp_path_factory.mktemp("hub-oracle"), "default")


@pytest.fixture(scope="module")
def published(oracle_ckpt) -> tuple[Path, dict]:
    """The default oracle converted lossless into a container, as someone would publish it."""
    root, d = oracle_ckpt.parent, oracle_ckpt
    dst = root / "container"
    r = coli(os.environ, "convert", d, dst, "--experts", "f32", "--dense", "f32", "--no-progress")
    assert r.returncode == 0, r.stderr
    return dst, load_oracle(d)


@pytest.fixture
def short_root():
    d = Path(tempfile.mkdtemp(prefix="colihub-", dir="/tmp"))   # ipc:// paths must stay under 107 bytes
    (d / "runs").mkdir()
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _one_line_error(r) -> str:
    assert r.returncode == 2, (r.returncode, r.stderr)
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1 and r.stderr.strip().splitlines()[-1] == errors[0], r.stderr
    return errors[0]


def _models(env) -> dict[str, dict]:
    r = coli(env, "models", "--json")
    assert r.returncode == 0, r.stderr
    return {m["name"]: m for m in map(json.loads, r.stdout.splitlines())}


@pytest.mark.timeout(300)
def test_pull_then_up_serves_the_oracle_tokens(published, short_root):
    container, o = published
    with HubServer({"org/tiny-coli": repo_from_dir(container)}) as hub:
        env = hub_env(hub.url, short_root)
        r = coli(env, "pull", "org/tiny-coli", "--no-progress")
        assert r.returncode == 0, r.stderr
        assert "verified" in r.stderr
    m = _models(env)["org/tiny-coli"]
    assert m["verified"] and m["kind"] == "pulled" and m["format"] == "experts f32, dense f32"
    assert m["source"] == f"hf://org/tiny-coli@{hub.repos['org/tiny-coli'].commit}" and m["size"] > 0
    for p in Path(container).iterdir():   # every file came down unchanged
        assert (Path(m["path"]) / p.name).read_bytes() == p.read_bytes()
    run = Run(Path("org/tiny-coli"), f"hp{os.getpid() % 10000}", short_root / "runs", Path(env["COLI_CACHE"]),
              extra_env={k: v for k, v in env.items() if k.startswith(("HF_", "COLI_CACHE"))})
    try:
        run.wait_ready()
        ids = ",".join(map(str, o["prompt_ids"]))
        r = run.coli("chat", "--name", run.name, "--prompt-ids", ids, "--max-tokens", "32", "--greedy",
                     "--ignore-eos", "--json")
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["tokens"] == o["greedy_tokens"]
        assert run.coli("down", "--name", run.name).returncode == 0
        run.proc.wait(30)
        assert_run_gone(run)
    finally:
        run.stop()
    r = coli(env, "models", "rm", "org/tiny-coli")
    assert r.returncode == 0, r.stderr
    assert "org/tiny-coli" not in _models(env) and not Path(m["path"]).exists()


def test_byte_flipped_on_the_wire_is_refused_with_the_file_named(published, tmp_path):
    container, _ = published
    with HubServer({"org/tiny-coli": repo_from_dir(container)}) as hub:
        hub.corrupt[("org/tiny-coli", "dense.coli")] = 10_000
        env = hub_env(hub.url, tmp_path)
        line = _one_line_error(coli(env, "pull", "org/tiny-coli", "--no-progress"))
        assert "dense.coli" in line and "disagrees with the Hub's index" in line
        assert not _models(env)["org/tiny-coli"]["verified"]
        line = _one_line_error(coli(env, "up", "--model", "org/tiny-coli"))
        assert "not verified" in line and "coli pull org/tiny-coli" in line
        del hub.corrupt[("org/tiny-coli", "dense.coli")]
        r = coli(env, "pull", "org/tiny-coli", "--no-progress")   # the rerun fetches what was refused
        assert r.returncode == 0, r.stderr
    assert _models(env)["org/tiny-coli"]["verified"]


def test_byte_flipped_in_the_published_container_is_refused_by_its_checksums(published, tmp_path):
    container, _ = published
    repo = repo_from_dir(container)
    expert_file = next(n for n in repo.files if n.startswith("experts") and n.endswith(".coli"))
    data = bytearray(repo.files[expert_file])
    data[len(data) // 2] ^= 0x40                       # the listing agrees with the damaged bytes: only the
    repo.files[expert_file] = bytes(data)              # manifest's checksums can catch it
    with HubServer({"org/bad": repo}) as hub:
        env = hub_env(hub.url, tmp_path)
        line = _one_line_error(coli(env, "pull", "org/bad", "--no-progress"))
    assert expert_file in line and "checksum mismatch" in line and "record layer" in line
    assert not _models(env)["org/bad"]["verified"]


def test_pulling_a_checkpoint_points_to_convert(small_ckpt, tmp_path):
    with HubServer({"org/ckpt": repo_from_dir(small_ckpt)}) as hub:
        line = _one_line_error(coli(hub_env(hub.url, tmp_path), "pull", "org/ckpt", "--no-progress"))
    assert "not a ColiStream container" in line and "coli convert hf://org/ckpt" in line


def test_up_with_an_unknown_name_says_where_models_come_from(tmp_path):
    env = hub_env("http://127.0.0.1:9", tmp_path)
    line = _one_line_error(coli(env, "up", "--model", "org/never-pulled"))
    assert "coli models" in line and "coli pull" in line


def test_killed_pull_stays_unusable_and_the_rerun_keeps_finished_files(published, tmp_path):
    import signal
    import subprocess
    import sys
    import time

    container, _ = published
    with HubServer({"org/tiny-coli": repo_from_dir(container)}) as hub:
        hub.chunk_delay = 0.02
        env = hub_env(hub.url, tmp_path)
        d = Path(env["COLI_CACHE"]) / "models" / f"org--tiny-coli--{hub.repos['org/tiny-coli'].commit[:12]}"
        p = subprocess.Popen([sys.executable, "-m", "coli.cli.main", "pull", "org/tiny-coli", "--no-progress"],
                             env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and p.poll() is None and \
                not (d.is_dir() and len([f for f in d.iterdir() if f.is_file()]) >= 2):
            time.sleep(0.01)
        p.send_signal(signal.SIGKILL)
        p.wait()
        done = sorted(f.name for f in d.iterdir() if f.is_file())
        assert 2 <= len(done) < len(list(container.iterdir())), done
        assert not _models(env)["org/tiny-coli"]["verified"]
        assert "not verified" in _one_line_error(coli(env, "up", "--model", "org/tiny-coli"))
        hub.chunk_delay = 0.0
        n = len(hub.requests)
        r = coli(env, "pull", "org/tiny-coli", "--no-progress")
        assert r.returncode == 0, r.stderr
        refetched = {path.rsplit("/", 1)[1] for m, path, _ in hub.requests[n:] if m == "GET" and "/resolve/" in path}
        assert not refetched & set(done), refetched & set(done)
        assert not list(d.rglob("*.incomplete")), "the killed pull's partial file is swept"
    assert _models(env)["org/tiny-coli"]["verified"]


def test_pull_into_a_dir_holding_other_files_is_refused(published, tmp_path):
    container, _ = published
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with HubServer({"org/tiny-coli": repo_from_dir(container)}) as hub:
        line = _one_line_error(coli(hub_env(hub.url, tmp_path), "pull", "org/tiny-coli", tmp_path / "mine",
                                    "--no-progress"))
    assert "is not empty" in line and (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_pull_onto_a_disk_too_small_is_refused_before_downloading(published, tmp_path):
    import subprocess

    container, _ = published
    small = tmp_path / "small-disk"
    if not small_tmpfs(small, "256k"):
        pytest.skip("needs a small file system: root and mount(8) make a 256 KiB tmpfs")
    try:
        with HubServer({"org/tiny-coli": repo_from_dir(container)}) as hub:
            line = _one_line_error(coli(hub_env(hub.url, tmp_path), "pull", "org/tiny-coli", small / "c",
                                        "--no-progress"))
            assert not [r for r in hub.requests if r[0] == "GET" and "/resolve/" in r[1]]
        assert "not enough disk" in line and "MB more" in line and "free" in line
    finally:
        subprocess.run(["umount", str(small)], check=False)


def test_hf_convert_of_the_oracle_checkpoint_matches_the_local_convert(oracle_ckpt, tmp_path):
    args = ("--experts", "f32", "--dense", "f32", "--no-progress")
    with HubServer({"org/oracle": repo_from_dir(oracle_ckpt)}) as hub:
        r = coli(hub_env(hub.url, tmp_path), "convert", "hf://org/oracle", tmp_path / "hub", *args)
        assert r.returncode == 0, r.stderr
    assert coli(os.environ, "convert", oracle_ckpt, tmp_path / "local", *args).returncode == 0
    want = {p.name: p.read_bytes() for p in (tmp_path / "local").iterdir()}
    assert {p.name: p.read_bytes() for p in (tmp_path / "hub").iterdir()} == want
