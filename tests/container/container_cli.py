"""Helpers of the container tests (imported by conftest.py and the tests; kept out of conftest.py so
`from container_cli import ...` cannot pick up another folder's conftest)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path


def coli(*args: str, check: bool = False, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "coli.cli.main", *map(str, args)], capture_output=True, text=True,
                       timeout=timeout, **kw)
    if check and r.returncode != 0:
        raise AssertionError(f"coli {' '.join(map(str, args))} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
    return r


def copy_tree(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst
