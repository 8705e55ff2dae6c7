"""Resumability: SIGKILL at random moments then rerun == uninterrupted run, byte for byte; refusals."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import make_fp8_checkpoint as mk
from coli.container.format import JOURNAL_NAME, MANIFEST_NAME
from coli.container.reader import ContainerReader
from coli.container.writer import ConvertOptions, convert
from coli.errors import ColiError

from container_cli import coli

ARGS = ["--experts", "int4", "--dense", "int8", "--group", "32", "--tile-kb", "64", "--expert-file-mb", "8",
        "--commit-mb", "1", "--no-progress"]


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def _interrupt_after(n_calls: int):
    calls = []

    def progress(done, total):
        calls.append(done)
        if len(calls) > n_calls:
            raise KeyboardInterrupt
    return progress


@pytest.fixture(scope="module")
def big_ckpt(tmp_path_factory) -> Path:
    # ~50 MB of FP8 input (random codes): a conversion that takes a couple of seconds, across several files
    d = tmp_path_factory.mktemp("big") / "ckpt"
    mk.build_checkpoint(d, seed=3, experts=80, random_codes=True, tokenizer=False)
    return d


def test_sigkill_at_random_points_then_resume_is_byte_identical(big_ckpt, tmp_path):
    ref, dst = tmp_path / "ref", tmp_path / "killed"
    t0 = time.monotonic()
    coli("convert", big_ckpt, ref, *ARGS, check=True)
    full = time.monotonic() - t0
    seed = int.from_bytes(os.urandom(4), "little")
    rng = random.Random(seed)
    mid_run, attempts, log = 0, 0, []
    scale = 1.0  # adapts to the machine's load: later if kills land before any unit, sooner if after the end
    while mid_run < 3 and attempts < 20:
        attempts += 1
        delay = rng.uniform(0.3, 0.85) * full * scale
        p = subprocess.Popen([sys.executable, "-m", "coli.cli.main", "convert", str(big_ckpt), str(dst), *ARGS],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        time.sleep(delay)
        finished = p.poll() is not None
        if not finished:
            os.kill(p.pid, signal.SIGKILL)
        p.wait()
        p.stderr.close()
        journal = dst / JOURNAL_NAME
        units = len(journal.read_bytes().split(b"\n")) - 2 if journal.exists() else -1
        complete = (dst / MANIFEST_NAME).exists()
        log.append((round(delay, 2), finished, units, complete))
        if complete:
            # finished before the kill landed: start over so the next kill hits a conversion in progress
            assert _files(dst) == _files(ref), f"seed {seed}: {log}"
            for f in dst.iterdir():
                f.unlink()
            scale *= 0.7
            continue
        if units > 0:
            mid_run += 1
        else:
            scale *= 1.3
    assert mid_run >= 3, f"seed {seed}: too few kills landed mid-conversion: {log}"
    r = coli("convert", big_ckpt, dst, *ARGS, check=True)
    assert "container complete" in r.stderr or "nothing to do" in r.stderr
    assert _files(dst) == _files(ref), f"seed {seed}: kills {log}"
    assert not (dst / JOURNAL_NAME).exists()
    assert coli("verify", dst, "--no-progress").returncode == 0
    print(f"SIGKILL test: seed {seed}, uninterrupted {full:.2f} s; kills (delay s, finished, units journaled, "
          f"complete): {log}")


def test_interrupt_resume_and_torn_journal(small_fp8, tmp_path):
    opts = ConvertOptions(experts="int4", dense="int8", tile_kb=8)
    convert(small_fp8, tmp_path / "ref", opts)
    dst = tmp_path / "c"
    with pytest.raises(KeyboardInterrupt):
        convert(small_fp8, dst, opts, progress=_interrupt_after(5), threads=1, commit_seconds=0)
    j = dst / JOURNAL_NAME
    n_lines = len(j.read_bytes().split(b"\n"))
    assert n_lines > 3 and not (dst / MANIFEST_NAME).exists()
    with open(j, "ab") as f:
        f.write(b"9999 0123")                                   # a torn last line (power cut mid-append)
    (dst / "coli-manifest.json.tmp").write_bytes(b"{")          # a manifest write cut short
    r = convert(small_fp8, dst, opts)
    assert r.status == "resumed" and r.units_skipped > 0
    assert _files(dst) == _files(tmp_path / "ref")


def test_killed_before_the_journal_existed(small_fp8, tmp_path):
    dst = tmp_path / "c"
    dst.mkdir()
    (dst / (JOURNAL_NAME + ".tmp")).write_bytes(b'{"jour')
    convert(small_fp8, dst, ConvertOptions())
    ContainerReader(dst)


def test_different_arguments_on_unfinished_dst_are_refused(small_fp8, tmp_path):
    dst = tmp_path / "c"
    with pytest.raises(KeyboardInterrupt):
        convert(small_fp8, dst, ConvertOptions(experts="int4", group=64), progress=_interrupt_after(3), threads=1)
    with pytest.raises(ColiError, match=r"unfinished conversion made with different options: --group 64 \(now 32\)"):
        convert(small_fp8, dst, ConvertOptions(experts="int4", group=32))
    r = coli("convert", small_fp8, dst, "--experts", "int8", "--no-progress")
    assert r.returncode == 2 and "--experts int4 (now int8)" in r.stderr
    assert not (dst / MANIFEST_NAME).exists()
    # the original arguments still resume
    assert convert(small_fp8, dst, ConvertOptions(experts="int4", group=64)).status in ("resumed", "converted")
    ContainerReader(dst)


def test_changed_source_on_unfinished_dst_is_refused(small_fp8, tmp_path):
    src = tmp_path / "src"
    mk.build_checkpoint(src, seed=8, layers=2, dense_layers=1, experts=4, topk=2)
    dst = tmp_path / "c"
    with pytest.raises(KeyboardInterrupt):
        convert(src, dst, ConvertOptions(), progress=_interrupt_after(3), threads=1)
    cfg = (src / "config.json").read_text()
    (src / "config.json").write_text(cfg.replace('"rms_norm_eps": 1e-05', '"rms_norm_eps": 1e-06'))
    with pytest.raises(ColiError, match="different source checkpoint"):
        convert(src, dst, ConvertOptions())


def test_non_empty_unrelated_dst_is_refused(small_fp8, tmp_path):
    dst = tmp_path / "c"
    dst.mkdir()
    (dst / "notes.txt").write_text("mine")
    with pytest.raises(ColiError, match="not empty"):
        convert(small_fp8, dst, ConvertOptions())
    assert (dst / "notes.txt").read_text() == "mine"


def _peak_rss_converting(src: Path, dst: Path) -> int:
    code = ("import resource, sys; from coli.container.writer import ConvertOptions, convert; "
            "convert(sys.argv[1], sys.argv[2], ConvertOptions()); "
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)")
    r = subprocess.run([sys.executable, "-c", code, str(src), str(dst)], capture_output=True, text=True, check=True)
    return int(r.stdout.split()[-1])


def test_peak_memory_does_not_grow_with_the_checkpoint(big_ckpt, tmp_path):
    small = tmp_path / "small"
    mk.build_checkpoint(small, seed=3, experts=8, random_codes=True, tokenizer=False)
    size = lambda d: sum(p.stat().st_size for p in d.iterdir())                      # noqa: E731
    assert size(big_ckpt) - size(small) > 30e6                                       # 10x the experts
    rss_small = _peak_rss_converting(small, tmp_path / "a")
    rss_big = _peak_rss_converting(big_ckpt, tmp_path / "b")
    assert rss_big - rss_small < 15e6, (rss_small, rss_big)
