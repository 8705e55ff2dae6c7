"""The reader's pure core: read one expert record from the container into an arena slot and verify
it. The process wrapper runs `read_record` on a bounded thread pool (preadv releases the GIL).

O_DIRECT bypasses the page cache (the RAM tier *is* our cache; double-caching would halve it) and
needs 4 KiB-aligned offsets, lengths and buffers: records are 4 KiB-aligned in the container and
arena slots are page-aligned, so we read the record's length rounded up to 4 KiB. Filesystems
without O_DIRECT (tmpfs) fall back to buffered reads, reported once through `direct`.
"""

from __future__ import annotations

import errno
import os
import threading
from dataclasses import dataclass

import xxhash

ALIGN = 4096


def round_up(n: int, a: int = ALIGN) -> int:
    return -(-n // a) * a


class RecordError(Exception):
    """A record could not be read or failed its checksum; the message names file and offset."""


@dataclass
class ReadStats:
    bytes_read: int = 0
    records: int = 0
    errors: int = 0
    checksum_failures: int = 0
    busy_s: float = 0.0


class FileTable:
    """Opened container files, O_DIRECT where the filesystem allows it."""

    def __init__(self, use_direct: bool = True):
        self.use_direct = use_direct and hasattr(os, "O_DIRECT")
        self._fds: dict[str, tuple[int, bool]] = {}
        self._lock = threading.Lock()
        self.fallbacks: list[str] = []

    def get(self, path: str) -> tuple[int, bool]:
        with self._lock:
            if path in self._fds:
                return self._fds[path]
            direct = False
            fd = -1
            if self.use_direct:
                try:
                    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
                    direct = True
                except OSError as e:
                    if e.errno != errno.EINVAL:
                        raise
                    self.fallbacks.append(path)
            if fd < 0:
                fd = os.open(path, os.O_RDONLY)
            self._fds[path] = (fd, direct)
            return fd, direct

    def disable_direct(self, path: str) -> tuple[int, bool]:
        """Reopen `path` buffered (some filesystems accept O_DIRECT at open but refuse the read)."""
        with self._lock:
            fd, _ = self._fds.pop(path, (-1, False))
            if fd >= 0:
                os.close(fd)
            fd = os.open(path, os.O_RDONLY)
            self._fds[path] = (fd, False)
            self.fallbacks.append(path)
            return fd, False

    def close(self) -> None:
        with self._lock:
            for fd, _ in self._fds.values():
                os.close(fd)
            self._fds.clear()


def read_record(files: FileTable, path: str, offset: int, length: int, checksum: int, dest: memoryview,
                verify: bool = True) -> int:
    """Read `length` bytes at `offset` of `path` into `dest` (a page-aligned slot of at least
    round_up(length) bytes) and check xxhash64. Returns the bytes read from the device."""
    span = round_up(length)
    if len(dest) < span:
        raise RecordError(f"{path} @ {offset}: record of {length} B does not fit a {len(dest)} B slot")
    fd, direct = files.get(path)
    if direct and (offset % ALIGN):
        fd, direct = files.disable_direct(path)
    try:
        n = _pread_full(fd, dest[:span] if direct else dest[:length], offset)
    except OSError as e:
        if direct and e.errno == errno.EINVAL:
            fd, _ = files.disable_direct(path)
            n = _pread_full(fd, dest[:length], offset)
        else:
            raise RecordError(f"{path} @ {offset}: read failed: {e.strerror or e}") from None
    if n < length:
        raise RecordError(f"{path} @ {offset}: short read ({n} of {length} B; truncated file?)")
    if verify:
        got = xxhash.xxh64_intdigest(dest[:length])
        if got != checksum:
            raise RecordError(f"{path} @ {offset}: checksum mismatch (xxh64 {got:016x}, index says {checksum:016x})")
    return n


def _pread_full(fd: int, buf: memoryview, offset: int) -> int:
    got = 0
    while got < len(buf):
        n = os.preadv(fd, [buf[got:]], offset + got)
        if n == 0:
            break
        got += n
    return got
