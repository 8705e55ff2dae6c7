"""Helpers of the hub tests (kept out of conftest.py so `from hub_cli import ...` cannot pick up another folder's
conftest): the environment that points huggingface_hub at the local Hub, and `coli` as a subprocess."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path


def hub_env(url: str, home: Path, token: str | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_ENDPOINT=url, HF_HOME=str(home / "hf-home"), HF_HUB_CACHE=str(home / "hf-cache"),
               HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_DISABLE_XET="1", COLI_CACHE=str(home / "coli-cache"),
               HF_HUB_ETAG_TIMEOUT="5", HF_HUB_DOWNLOAD_TIMEOUT="5")
    if token:
        env["HF_TOKEN"] = token
    return env


def coli(env: dict, *args, timeout: float = 180, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "coli.cli.main", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=env, **kw)


def small_tmpfs(path: Path, size: str) -> bool:
    """A real file system of `size` at path, for disk-full refusals (root and mount(8) only: False elsewhere)."""
    path.mkdir(parents=True)
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True).returncode == 0
