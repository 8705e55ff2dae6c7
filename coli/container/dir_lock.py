"""One writer per directory: `coli convert` (local and from the Hub) and `coli pull` hold an exclusive flock on
the directory they write, so a second command on the same DST fails at once instead of interleaving its files
with the first's. The kernel drops the lock when the holder exits, even on SIGKILL, so a killed run never
leaves a stale lock behind."""

from __future__ import annotations

import fcntl
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


@contextmanager
def sole_writer(d: Path, command: str, error: type[Exception]) -> Iterator[None]:
    """Hold the directory D (which must exist) for COMMAND ("coli convert", "coli pull") while the block runs;
    raise ERROR naming D and the command if another process holds it."""
    fd = os.open(d, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise error(f"{d}: another {command} is writing this directory") from None
        yield
    finally:
        os.close(fd)
