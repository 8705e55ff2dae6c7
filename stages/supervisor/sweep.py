"""Sweeping /dev/shm of segments that dead runs left behind, whatever their run name.

A run whose whole process group is SIGKILLed (or whose host `coli up` died before its stages noticed)
leaves its arenas: no process of it is left to unlink them. Every `coli up` and `coli down` therefore
removes such segments, owner-checked three ways so a sweep can never touch what is not ours to remove:
the name follows the supervisor's pattern `coli-<run name>-<supervisor pid>-(experts|residency)`, the
file is a regular file of this user holding an arena header, and the supervisor pid in the name is dead.
A live pid (even a reused one) keeps its segments: a leftover is better than unmapping a live run."""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

from coli.protocol.arena import SHM_DIR

# the names Supervisor._start_stages gives its two segments
SEGMENT = re.compile(r"coli-(?P<run>[A-Za-z0-9][A-Za-z0-9._-]{0,63})-(?P<pid>[1-9][0-9]{0,9})-(?:experts|residency)")
ARENA_MAGIC = b"COLIAREN"


def segment_name(run: str, pid: int, what: str) -> str:
    """The name of a run's segment (`what` is experts or residency), the one SEGMENT recognises."""
    return f"coli-{run}-{pid}-{what}"


def _pid_dead(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # exists, another user's
    return False


def _ours(path: Path) -> bool:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
        return False
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        return os.pread(fd, len(ARENA_MAGIC), 0) == ARENA_MAGIC
    finally:
        os.close(fd)


def sweep_dead_segments(shm_dir: str | os.PathLike[str] = SHM_DIR) -> list[str]:
    """Unlink every segment in `shm_dir` of a run whose supervisor is dead; returns their names."""
    removed = []
    try:
        names = sorted(os.listdir(shm_dir))
    except OSError:
        return removed
    for name in names:
        m = SEGMENT.fullmatch(name)
        if m is None or not _pid_dead(int(m["pid"])):
            continue
        path = Path(shm_dir) / name
        if not _ours(path):
            continue
        try:
            os.unlink(path)
        except FileNotFoundError:
            continue  # another sweep got there first
        removed.append(name)
    return removed


def describe(removed: list[str]) -> str:
    runs = sorted({SEGMENT.fullmatch(n)["run"] for n in removed})
    return (f"removed {len(removed)} shared-memory segment(s) that dead runs left in {SHM_DIR} "
            f"(run(s) {', '.join(map(repr, runs))})")
