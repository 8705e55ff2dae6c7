"""Starts real runs (`coli up` as a subprocess: supervisor + spawned stage processes) on a model in an
isolated run dir, and checks that nothing of a run survives it (processes, /dev/shm segments)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

SHM = Path("/dev/shm")


def env_for(run_base: Path, cache: Path, **extra: str) -> dict:
    env = dict(os.environ)
    env.update(COLI_RUN_DIR=str(run_base), COLI_CACHE=str(cache), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


class Run:
    def __init__(self, model: Path, name: str, run_base: Path, cache: Path, ram_gb: float = 1.0,
                 extra_env: dict | None = None, args: tuple = (), log_tag: str = ""):
        self.name, self.run_base, self.env = name, run_base, env_for(run_base, cache, **(extra_env or {}))
        self.log = run_base.parent / f"{name}{log_tag}.up.out"  # log_tag: several `coli up` of one name
        cmd = [sys.executable, "-m", "coli.cli.main", "up", "--model", str(model), "--name", name,
               "--ram-gb", str(ram_gb), "--startup-timeout", "60",
               "--experts", "f32", "--dense", "f32",   # a checkpoint converts lossless: tokens match the oracle
               *args]
        self._out = open(self.log, "w")
        self.proc = subprocess.Popen(cmd, env=self.env, stdout=self._out, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.state: dict = {}

    def wait_ready(self, timeout: float = 120.0) -> dict:
        deadline = time.monotonic() + timeout
        state_file = self.run_base / self.name / "state.json"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"coli up exited with {self.proc.returncode}:\n{self.output()}")
            try:
                st = json.loads(state_file.read_text())
                if st.get("state") == "ready" and st.get("supervisor_pid") == self.proc.pid:
                    self.state = st
                    return st
            except (OSError, ValueError):
                pass
            time.sleep(0.05)
        raise TimeoutError(f"run {self.name} not ready in {timeout} s:\n{self.output()}")

    def output(self) -> str:
        self._out.flush()
        return self.log.read_text()

    def coli(self, *args: str, timeout: float = 120.0, input: str | None = None) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "coli.cli.main", *args], env=self.env, capture_output=True,
                              text=True, timeout=timeout, input=input)

    @property
    def stage_pids(self) -> dict[str, int]:
        return {n: s["pid"] for n, s in self.state.get("stages", {}).items()}

    @property
    def arenas(self) -> list[str]:
        return list(self.state.get("arenas", []))

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._out.close()


def pid_gone(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return "\nState:\tZ" in status  # a zombie is dead; only its parent's wait() is missing


def wait_gone(pids, timeout: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout
    left = list(pids)
    while left and time.monotonic() < deadline:
        left = [p for p in left if not pid_gone(p)]
        if left:
            time.sleep(0.05)
    return left


def shm_left(names) -> list[str]:
    return [n for n in names if (SHM / n).exists()]


def assert_run_gone(run: Run, timeout: float = 10.0) -> None:
    pids = [*run.stage_pids.values(), run.proc.pid]
    left = wait_gone(pids, timeout)
    assert not left, f"processes of run {run.name} still alive: {left}"
    deadline = time.monotonic() + timeout
    while shm_left(run.arenas) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not shm_left(run.arenas), f"/dev/shm still holds {shm_left(run.arenas)}"
