"""The compile tests' nvcc runs, started in the background as soon as the suite is collected.

Compiling every kernel for every target arch (and the PTX, preprocessor and sweep builds the other compile tests
check) is ~4.5 CPU-minutes of nvcc, and the rest of the suite is serial: on CI's 2 cores one core is mostly idle
while it runs. So tests/conftest.py hands every selected test's `@pytest.mark.nvcc(builds=fn)` to one NvccPool
right after collection; the pool runs the commands at the lowest CPU priority (nice 19, their autogroup too: the
serial tests keep the CPU), `os.cpu_count()` at a time, and a compile test takes its results (waiting for those not
finished yet) and checks them exactly as it would have checked its own runs. The commands and flags are the tests'
own; only the moment they run changes. A test run alone (or a builds function the hook did not see) submits on
first use.

`builds(out_dir) -> {key: (argv, output path or None)}`: the nvcc command lines of one test, writing under out_dir."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

Builds = Callable[[Path], dict]


@dataclass(frozen=True)
class Compiled:
    """One finished nvcc run: what subprocess.run(..., capture_output=True, text=True) gave before, and its -o file."""
    returncode: int
    stdout: str
    stderr: str
    out: Path | None          # None: the command writes to stdout (nvcc -E)


def builds_name(builds: Builds) -> str:
    return f"{builds.__module__}.{builds.__qualname__}"


class NvccPool:
    def __init__(self, workers: int | None = None, timeout: float = 1500.0):
        self._root = Path(tempfile.mkdtemp(prefix="coli-nvcc-"))
        self._pool = ThreadPoolExecutor(max_workers=max(1, workers or os.cpu_count() or 1),
                                        thread_name_prefix="nvcc")
        self._timeout = timeout                    # per command: an upper bound, like the tests' own timeouts
        self._nice = [shutil.which("nice"), "-n", "19"] if shutil.which("nice") else []
        self._jobs: dict[str, dict] = {}           # builds name -> {key: Future[Compiled]}
        self._procs: set[subprocess.Popen] = set()
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, builds: Builds) -> None:
        """Queue builds' commands (once per builds function, however many tests name it)."""
        name = builds_name(builds)
        with self._lock:
            if self._closed:
                raise RuntimeError("the nvcc pool is closed (the test session is ending)")
            if name in self._jobs:
                return
            out_dir = self._root / str(len(self._jobs))      # names hold '<locals>': no path of them
            out_dir.mkdir()
            self._jobs[name] = {key: self._pool.submit(self._run, argv, out and Path(out))
                                for key, (argv, out) in builds(out_dir).items()}

    def results(self, builds: Builds) -> dict:
        """{key: Compiled} of builds, in builds' order, once every one of its commands has finished."""
        self.submit(builds)
        return {key: f.result() for key, f in self._jobs[builds_name(builds)].items()}

    def _run(self, argv: list[str], out: Path | None) -> Compiled:
        with self._lock:
            if self._closed:
                raise RuntimeError("the nvcc pool was closed before this build ran")
            # its own session: close() ends nvcc and the cicc / ptxas it started, and nothing else
            p = subprocess.Popen([*self._nice, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 start_new_session=True)
            self._procs.add(p)
            _lowest_autogroup_priority(p.pid)
        try:
            try:
                stdout, stderr = p.communicate(timeout=self._timeout)
            except subprocess.TimeoutExpired:
                _kill_group(p)
                p.communicate()
                raise TimeoutError(f"nvcc ran past {self._timeout:.0f} s: {' '.join(argv)}") from None
        finally:
            with self._lock:
                self._procs.discard(p)
        return Compiled(p.returncode, stdout, stderr, out)

    def close(self) -> None:
        """Drop queued commands, end the running ones, remove the outputs."""
        with self._lock:
            self._closed = True
            running = list(self._procs)
        self._pool.shutdown(wait=False, cancel_futures=True)
        for p in running:
            _kill_group(p)
        self._pool.shutdown(wait=True)
        shutil.rmtree(self._root, ignore_errors=True)


def _lowest_autogroup_priority(pid: int) -> None:
    """Under autogroup scheduling (Linux's default on desktops and this VM: /proc/sys/kernel/sched_autogroup_enabled)
    a task's nice only ranks it within its session, and a new session is a new group weighing as much as the
    suite's: nice 19 alone left a CPU-bound foreground loop ~75 % slower beside two such nvccs here, against ~20 %
    with the group itself at nice 19. The group is nvcc's alone (its own session) and holds the cicc / ptxas it
    starts, even those started before this write."""
    try:
        Path(f"/proc/{pid}/autogroup").write_text("19")
    except OSError:                                # no autogroup scheduling, or nvcc already gone: nice alone
        pass


def _kill_group(p: subprocess.Popen) -> None:
    if p.poll() is not None:                       # reaped: its group id may name someone else by now
        return
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
