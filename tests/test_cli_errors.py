"""The CLI's errors as a newcomer meets them (issue 13 §3.6): one line on stderr, exit 2, naming the culprit and
what to do; no traceback, no rich box, no empty progress bar first. The terminal cases run the real `coli`
under a pseudo-terminal (python's pty), where rich draws its bars and boxes."""

from __future__ import annotations

import importlib.util
import os
import pty
import re
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

DEMO = Path(__file__).resolve().parent.parent / "coli" / "demo" / "model"
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07")


def coli(*args, env=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "coli.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def coli_tty(*args, env=None, timeout=60) -> tuple[int, list[str]]:
    """Run coli with stdout and stderr on a pseudo-terminal; (exit code, the non-blank lines it drew)."""
    master, slave = pty.openpty()
    p = subprocess.Popen([sys.executable, "-m", "coli.cli.main", *args], stdin=slave, stdout=slave, stderr=slave,
                         env=env, close_fds=True)
    os.close(slave)
    out, deadline = b"", time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            r, _, _ = select.select([master], [], [], 0.2)
            if r:
                try:
                    chunk = os.read(master, 65536)
                except OSError:       # EIO: the child closed the terminal
                    break
                if not chunk:
                    break
                out += chunk
            elif p.poll() is not None:
                break
        rc = p.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        os.close(master)
    text = ANSI.sub("", out.decode(errors="replace")).replace("\r", "\n")
    return rc, [line.strip() for line in text.split("\n") if line.strip()]


def _env(tmp_path) -> dict:
    return dict(os.environ, COLI_RUN_DIR=str(tmp_path / "runs"), COLI_CACHE=str(tmp_path / "cache"),
                COLUMNS="100", TERM="xterm-256color")


def _one_error_line(rc: int, lines: list[str]) -> str:
    assert rc == 2, lines
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert not any(c in lines[0] for c in "╭╰│━"), lines   # no rich box, no bar
    return lines[0]


@pytest.mark.parametrize("args,needle", [
    (["run", "--prompt-ids", "1"], "Missing option '--model'"),
    (["chat", "--max-tokens", "0"], "Invalid value for '--max-tokens'"),
    (["plan", "--bogus"], "No such option: --bogus"),
    (["plan", "--preset", "glm5", "--vram-gb", "abc"], "Invalid value for '--vram-gb'"),
    (["convert"], "Missing argument 'src'"),
    (["nosuch"], "No such command 'nosuch'"),
    (["up", "--max-batch", "0"], "Invalid value for '--max-batch'"),
    (["up", "--step-tokens", "0"], "Invalid value for '--step-tokens'"),
    (["up", "--prefill-chunk", "-1"], "Invalid value for '--prefill-chunk'"),
])
@pytest.mark.timeout(60)
def test_usage_errors_are_one_line_naming_the_option(args, needle, tmp_path):
    line = _one_error_line(*coli_tty(*args, env=_env(tmp_path)))
    assert needle in line and f"(see `coli{' ' + args[0] if args[0] != 'nosuch' else ''} --help`)" in line, line
    r = coli(*args, env=_env(tmp_path))     # the same through a pipe
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [line], r.stderr


@pytest.mark.timeout(60)
def test_help_and_no_arguments_still_print_the_help(tmp_path):
    r = coli("plan", "--help", env=_env(tmp_path))
    assert r.returncode == 0 and "--vram-gb" in r.stdout
    r = coli(env=_env(tmp_path))
    assert r.returncode == 2 and "plan" in r.stdout + r.stderr and "error:" not in r.stderr
    r = coli("--version", env=_env(tmp_path))
    assert r.returncode == 0 and r.stdout.startswith("coli ")


@pytest.mark.skipif(importlib.util.find_spec("pycuda") is not None, reason="PyCUDA is installed here")
@pytest.mark.timeout(60)
@pytest.mark.parametrize("args", [["up", "--device", "gpu", "--name", "nogpu"],
                                  ["up", "--device", "gpu", "--name", "nogpu", "--detach"],
                                  ["run", "--model", str(DEMO), "--device", "gpu", "--prompt-ids", "1,2"]])
def test_device_gpu_without_pycuda_is_one_line_naming_the_extra(args, tmp_path):
    line = _one_error_line(*coli_tty(*args, env=_env(tmp_path)))
    assert "PyCUDA is not installed" in line and "pip install -e '.[gpu]'" in line and "--device cpu" in line
    assert not (tmp_path / "runs" / "nogpu").exists()    # refused before any stage started
    assert not (tmp_path / "cache").exists()              # and before converting anything


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args", [["run", "--model", "{d}", "--prompt", "hi"], ["run", "--model", "{d}", "--prompt-ids", "1"],
                                  ["up", "--model", "{d}"], ["plan", "--model", "{d}"], ["verify", "{d}"]])
def test_a_missing_model_dir_is_said_to_not_exist(args, tmp_path):
    d = tmp_path / "no" / "such"
    line = _one_error_line(*coli_tty(*[a.format(d=d) for a in args], env=_env(tmp_path)))
    assert str(d) in line and "no such directory" in line and "tokenizer" not in line, line


@pytest.fixture(scope="module")
def half_converted(tmp_path_factory) -> Path:
    """A real conversion of the demo model stopped after its first units (as Ctrl-C stops it)."""
    from coli.container.format import JOURNAL_NAME, MANIFEST_NAME
    from coli.container.writer import ConvertOptions, convert

    if not (DEMO / "config.json").is_file():
        pytest.skip("demo model not built")
    dst = tmp_path_factory.mktemp("half") / "demo-int4"
    calls = []

    def stop_after_two(done, total):
        calls.append(done)
        if len(calls) > 2:
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        convert(DEMO, dst, ConvertOptions(experts="int4", dense="int4"), progress=stop_after_two, threads=1,
                commit_seconds=0)
    assert (dst / JOURNAL_NAME).is_file() and not (dst / MANIFEST_NAME).exists()
    return dst


@pytest.mark.timeout(120)
@pytest.mark.parametrize("args", [["run", "--model", "{d}", "--prompt-ids", "1,2"], ["up", "--model", "{d}"],
                                  ["plan", "--model", "{d}", "--vram-gb", "0"], ["verify", "{d}"]])
def test_a_half_finished_conversion_says_rerun_convert_to_resume(args, half_converted, tmp_path):
    line = _one_error_line(*coli_tty(*[a.format(d=half_converted) for a in args], env=_env(tmp_path)))
    assert f"{half_converted} is an unfinished conversion" in line, line
    assert f"rerun `coli convert SRC {half_converted} " in line and "--experts int4" in line and "to resume it" in line
    assert "safetensors" not in line
    assert not (tmp_path / "cache").exists()   # `coli up` did not start converting it as a checkpoint


@pytest.mark.timeout(180)
def test_the_resume_command_it_names_finishes_the_container(half_converted, tmp_path):
    import shutil

    d = tmp_path / "copy"
    shutil.copytree(half_converted, d)
    line = coli("verify", str(d), env=_env(tmp_path)).stderr
    cmd = re.search(r"`coli convert SRC (\S+) ([^`]*)`", line)
    assert cmd and cmd.group(1) == str(d), line
    r = coli("convert", str(DEMO), str(d), *cmd.group(2).split(), "--no-progress", env=_env(tmp_path))
    assert r.returncode == 0 and "container complete" in r.stderr and "resumed" in r.stderr, r.stderr
    assert coli("verify", str(d), "--no-progress", env=_env(tmp_path)).returncode == 0


@pytest.mark.timeout(120)
def test_convert_and_verify_errors_come_without_an_empty_progress_bar(tmp_path):
    unrelated = tmp_path / "unrelated"
    unrelated.mkdir()
    (unrelated / "notes.txt").write_text("mine\n")
    cases = [
        (["convert", str(tmp_path / "nope"), str(tmp_path / "dst")], "is not a directory"),
        (["convert", str(DEMO), str(unrelated)], "is not empty and holds no unfinished conversion"),
        (["convert", str(DEMO), str(tmp_path / "dst"), "--experts", "int3"], "--experts 'int3' is not a format"),
        (["verify", str(unrelated)], "coli-manifest.json"),
    ]
    for args, needle in cases:
        line = _one_error_line(*coli_tty(*args, env=_env(tmp_path)))
        assert needle in line, (args, line)
        assert "converting" not in line and "verifying" not in line
    assert (unrelated / "notes.txt").read_text() == "mine\n" and not (tmp_path / "dst").exists()


@pytest.mark.timeout(180)
def test_the_progress_bar_still_shows_while_converting(tmp_path):
    rc, lines = coli_tty("convert", str(DEMO), str(tmp_path / "c"), "--experts", "int8", env=_env(tmp_path),
                         timeout=150)
    assert rc == 0, lines
    assert any(line.startswith("converting") and "━" in line for line in lines), lines
    assert "container complete" in lines[-1]
