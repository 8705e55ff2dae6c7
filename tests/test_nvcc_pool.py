"""tests/nvcc_pool.py, the background runner of the compile tests' nvcc commands, with real processes (sh, not
nvcc: the pool only runs command lines): a test gets what its own subprocess.run gave, each builds function runs
once, and nothing it started outlives the session or its timeout."""

from __future__ import annotations

import subprocess

import time
from pathlib import Path

import pytest

from harness import wait_gone  # a zombie counts as gone: its reaper, not the pool, is what is slow
from nvcc_pool import NvccPool


def test_results_are_each_commands_exit_status_output_and_file_in_order(tmp_path):
    runs = tmp_path / "runs"

    def builds(out_dir):
        return {k: (["sh", "-c", f"echo {k} >> {runs}; echo out-{k}; echo err-{k} >&2; echo x > {out_dir}/{k}; "
                                 f"exit {rc}"], out_dir / k) for k, rc in (("b", 0), ("a", 3))}

    pool = NvccPool(workers=2)
    try:
        pool.submit(builds)
        pool.submit(builds)                          # a second test naming the same builds: no second run
        got = pool.results(builds)
        assert list(got) == ["b", "a"]
        assert [got[k].returncode for k in got] == [0, 3]
        assert got["a"].stdout == "out-a\n" and got["a"].stderr == "err-a\n"
        assert got["b"].out.read_text() == "x\n"
        assert sorted(runs.read_text().split()) == ["a", "b"]
    finally:
        pool.close()
    assert not got["b"].out.exists(), "close() removes the outputs"


def test_close_ends_running_commands_with_their_children_and_drops_queued_ones(tmp_path):
    started = tmp_path / "started"

    def builds(out_dir):
        # the shell's child (sleep) stands for the cicc / ptxas that nvcc starts
        return {k: (["sh", "-c", f"sleep 60 & echo $! >> {started}; wait"], None) for k in range(3)}

    pool = NvccPool(workers=1)
    pool.submit(builds)
    deadline = time.monotonic() + 10
    while not (started.is_file() and started.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.02)
    t = time.monotonic()
    pool.close()
    assert time.monotonic() - t < 10
    pids = [int(p) for p in started.read_text().split()]
    assert len(pids) == 1, "the queued commands must not start once the pool is closed"
    assert not wait_gone(pids), "the running command's child outlived close()"
    with pytest.raises(RuntimeError, match="closed"):
        pool.submit(lambda out_dir: {})


def test_a_command_past_its_timeout_is_killed_and_named(tmp_path):
    pidfile = tmp_path / "pid"

    def builds(out_dir):
        return {"slow": (["sh", "-c", f"sleep 60 & echo $! > {pidfile}; wait"], None)}

    pool = NvccPool(workers=1, timeout=1.0)
    try:
        with pytest.raises(TimeoutError, match="past 1 s: sh -c sleep 60"):
            pool.results(builds)
        assert not wait_gone([int(pidfile.read_text())])
    finally:
        pool.close()


def _can_lower_an_autogroup() -> bool:
    """Whether this machine lets a process set its own session's autogroup to nice 19 (a read-only /proc in some
    containers does not: the pool then falls back to nice alone, which the first assertion still checks)."""
    p = subprocess.run(["sh", "-c", "echo 19 > /proc/self/autogroup"], start_new_session=True, capture_output=True)
    return p.returncode == 0


def test_commands_run_at_the_lowest_priority_in_an_autogroup_of_their_own(tmp_path):
    """nice 19 for the command, and (where the kernel groups by session) its own session's group at nice 19 too,
    read by a child started after a pause, as nvcc's cicc and ptxas are."""
    mine = Path("/proc/self/autogroup")

    def builds(out_dir):
        return {"ni": (["sh", "-c", "sleep 0.3; cut -d' ' -f19 /proc/self/stat; "
                                    "cat /proc/self/autogroup 2>/dev/null || true"], None)}

    pool = NvccPool(workers=1)
    try:
        r = pool.results(builds)["ni"]
    finally:
        pool.close()
    lines = r.stdout.split("\n")
    assert r.returncode == 0 and lines[0] == "19", r
    # The kernel prints nothing for a task whose scheduling group is not an autogroup (a task in a cpu cgroup of
    # its own, as on the CI machine): there is then no group of ours for nvcc's to rank against, only its nice.
    own = mine.read_text().split() if mine.is_file() else []
    if own and _can_lower_an_autogroup():
        assert lines[1].endswith(" nice 19") and lines[1].split()[0] != own[0], lines
