"""Durable file replacement and the sweep of what a killed writer left behind.

A stage that persists state (sessions, the RAM tier's usage counts) writes `<dir>/<prefix><pid>` and
renames it over the real file, so a reader sees the old file or the new one, never half of one. A writer
killed between the two leaves its temp file; `sweep_dead_temps` removes those whose pid is no longer a
live process (30 killed session saves once left 1.87 GB of them)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Callable


def temp_path(final: Path, prefix: str) -> Path:
    """`<dir>/<prefix><pid>`: one temp per writer process, so two processes never write one file."""
    return final.with_name(f"{prefix}{os.getpid()}")


def create_private(path: Path) -> None:
    """Create `path` empty with mode 0600 (owner only) before anything is written into it: content never
    sits in a file other local users can read, whatever the umask. A leftover of ours is replaced."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))


def replace_durably(tmp: Path, final: Path) -> None:
    """fsync `tmp`, rename it over `final`, fsync the directory: after this returns the new content
    survives a crash of this process and of the machine."""
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, final)
    dfd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def write_private(final: Path, write: Callable[[Path], None], prefix: str) -> None:
    """Write `final` atomically, mode 0600: `write(tmp)` fills the temp file, then it replaces `final`.
    On any failure the temp file is removed and `final` is left as it was."""
    tmp = temp_path(final, prefix)
    try:
        create_private(tmp)
        write(tmp)
        replace_durably(tmp, final)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True          # exists, another user's: not ours to judge
    return True


def sweep_dead_temps(directory: Path, pattern: str) -> list[Path]:
    """Remove files in `directory` whose whole name matches `pattern` (a regex with one group: the
    writer's pid) and whose writer is no longer alive. Returns what was removed; never raises for a
    missing directory or a file that went away meanwhile."""
    rx = re.compile(pattern)
    removed: list[Path] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        m = rx.fullmatch(name)
        if not m:
            continue
        pid = int(m.group(1))
        if pid == os.getpid() or _pid_alive(pid):
            continue
        try:
            os.unlink(directory / name)
            removed.append(directory / name)
        except OSError:
            pass
    return removed
