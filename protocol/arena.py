"""The shared-memory arena: one POSIX shared-memory segment of fixed-size, page-aligned expert slots.

Layout of the segment `/dev/shm/<name>`:

    [0, HEADER_BYTES)                        header: magic, format version, header size, slot_bytes, n_slots
    [HEADER_BYTES + i*slot_bytes, +slot_bytes)  slot i, i in [0, n_slots); every slot starts on a page

One owner (the supervisor) creates the arena and alone unlinks it; the stages attach by name and read the
layout from the header, so a stage cannot disagree with the supervisor about slot size or count.

Why not multiprocessing.shared_memory: on Python < 3.13 every SharedMemory, attached or created,
registers with the resource tracker, and spawned children share their parent's tracker (a set of names).
An attacher then either unlinks the segment when it exits, or, with the usual
`resource_tracker.unregister` workaround, removes the owner's registration too, so the owner's own
unlink later makes the tracker print a KeyError traceback. We open /dev/shm directly instead (what
shm_open does on Linux) and nothing unlinks behind our back; the price is that a SIGKILLed owner leaves
the segment, which the supervisor's stale-run cleanup removes with `Arena.unlink_name`.

Views and close(). `slot_view(i)` hands out one shared memoryview per slot; `close()` releases them, so
using one afterwards raises ValueError instead of touching unmapped memory. Do not release a slot view
yourself (no `with arena.slot_view(i) as v:`): other holders share it. numpy arrays (`slot_array`,
`ref_array`) and slices of slot views cannot be revoked, but CPython's buffer accounting keeps the mapping
alive under them: close() then raises ArenaError and leaves the arena mapped (nothing dangles); drop them
and call close() again. Two things escape that accounting and must end before close(): raw addresses
(`address()`, e.g. for cuMemHostRegister) and arrays built with `np.ndarray(buffer=...)`, which keep no
buffer export (use np.frombuffer).
"""

from __future__ import annotations

import mmap
import os
import re
import struct
import threading

import numpy as np

from .errors import ArenaError
from .messages import SlotRef

SHM_DIR = "/dev/shm"
ALIGN = max(4096, mmap.PAGESIZE)  # O_DIRECT reads need 4 KiB; pinning (cuMemHostRegister) needs pages
HEADER_BYTES = ALIGN  # a whole page, so slot 0 is page-aligned too
ARENA_VERSION = 1
_MAGIC = b"COLIAREN"
_HEADER = struct.Struct("<8sIIQQ")  # magic, version, header_bytes, slot_bytes, n_slots
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")


def round_up(n: int, align: int = ALIGN) -> int:
    return -(-n // align) * align


def _path(name: str) -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ArenaError(f"arena name {name!r} must be 1-200 characters of A-Z a-z 0-9 . _ - (no slash)")
    return os.path.join(SHM_DIR, name)


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"


class Arena:
    """A mapped arena. Build with `Arena.create` (owner) or `Arena.attach` (stages), not directly."""

    def __init__(self, name: str, mm: mmap.mmap, slot_bytes: int, n_slots: int, *, owner: bool, ident: tuple[int, int]):
        self.name = name
        self.slot_bytes = slot_bytes  # multiple of ALIGN
        self.n_slots = n_slots
        self.nbytes = HEADER_BYTES + slot_bytes * n_slots  # whole mapping, header included
        self.owner = owner
        self._ident = ident  # (st_dev, st_ino): unlink only the segment we created, not a namesake
        self._mmap: mmap.mmap | None = mm
        self._buf = memoryview(mm)
        self._views: list[memoryview | None] = [None] * n_slots  # created on first use, released by close()
        self._lock = threading.Lock()
        self._closing = False
        self._unlinked = False

    # -- lifecycle ------------------------------------------------------------------------------------

    @classmethod
    def create(cls, name: str, slot_bytes: int, n_slots: int, *, reserve: bool = True) -> Arena:
        """Create `/dev/shm/<name>` with `n_slots` slots of `slot_bytes` rounded up to ALIGN; this
        process becomes the owner, the one that unlinks it.

        `reserve` allocates the memory now (posix_fallocate): a full /dev/shm then fails here with a
        clear error instead of killing a stage with SIGBUS the first time it touches a slot."""
        path = _path(name)
        if not isinstance(slot_bytes, int) or slot_bytes < 1:
            raise ArenaError(f"arena {name!r}: slot_bytes must be a positive int, got {slot_bytes!r}")
        if not isinstance(n_slots, int) or n_slots < 1:
            raise ArenaError(f"arena {name!r}: n_slots must be a positive int, got {n_slots!r}")
        slot_bytes = round_up(slot_bytes)
        total = HEADER_BYTES + slot_bytes * n_slots
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except FileExistsError:
            raise ArenaError(
                f"arena {name!r} already exists ({path}): another run uses the name, or a dead run left it "
                f"(stop that run, or remove the segment with Arena.unlink_name)"
            ) from None
        try:
            if reserve:
                try:
                    os.posix_fallocate(fd, 0, total)
                except OSError as e:
                    st = os.statvfs(SHM_DIR)
                    raise ArenaError(
                        f"arena {name!r} needs {_gib(total)} ({n_slots} slots of {slot_bytes} bytes) but "
                        f"{SHM_DIR} has {_gib(st.f_bavail * st.f_frsize)} free ({e.strerror}): lower the RAM "
                        f"budget or enlarge {SHM_DIR}"
                    ) from None
            else:
                os.ftruncate(fd, total)
            st = os.fstat(fd)
            mm = mmap.mmap(fd, total, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            # magic last: an attacher racing creation sees no magic and refuses, never a half header
            _HEADER.pack_into(mm, 0, b"\0" * 8, ARENA_VERSION, HEADER_BYTES, slot_bytes, n_slots)
            mm[0:8] = _MAGIC
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        os.close(fd)  # the mapping keeps the memory; the name stays until unlink()
        return cls(name, mm, slot_bytes, n_slots, owner=True, ident=(st.st_dev, st.st_ino))

    @classmethod
    def attach(cls, name: str, *, slot_bytes: int | None = None, n_slots: int | None = None) -> Arena:
        """Map an existing arena, layout read from its header. `slot_bytes` / `n_slots`, if given, are
        what the caller expects (slot_bytes before rounding); a different arena is refused."""
        path = _path(name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            raise ArenaError(f"arena {name!r} does not exist ({path}): not created yet, or already unlinked") from None
        try:
            st = os.fstat(fd)
            if st.st_uid != os.getuid():
                raise ArenaError(
                    f"arena {name!r} ({path}) belongs to uid {st.st_uid}, "
                    f"not to this user ({os.getuid()})"
                )
            raw = os.pread(fd, _HEADER.size, 0)
            if len(raw) < _HEADER.size:
                raise ArenaError(f"arena {name!r} ({path}) is {st.st_size} bytes, too small to hold an arena header")
            magic, version, header_bytes, got_slot, got_n = _HEADER.unpack(raw)
            if magic != _MAGIC:
                raise ArenaError(
                    f"arena {name!r} ({path}) is not a ColiStream arena, or is "
                    f"still being created (magic {magic!r})"
                )
            if version != ARENA_VERSION:
                raise ArenaError(
                    f"arena {name!r} has format version {version}, this process "
                    f"reads {ARENA_VERSION} (mixed installs)"
                )
            if header_bytes != HEADER_BYTES or got_slot == 0 or got_slot % ALIGN or got_n == 0:
                raise ArenaError(
                    f"arena {name!r} header is inconsistent (header_bytes={header_bytes}, slot_bytes={got_slot}, "
                    f"n_slots={got_n}; this process expects {HEADER_BYTES}-byte headers and {ALIGN}-aligned slots)"
                )
            want = HEADER_BYTES + got_slot * got_n
            if st.st_size != want:
                raise ArenaError(
                    f"arena {name!r} is {st.st_size} bytes but its header "
                    f"describes {want} (truncated or damaged)"
                )
            if slot_bytes is not None and round_up(slot_bytes) != got_slot:
                raise ArenaError(
                    f"arena {name!r} has {got_slot}-byte slots, expected "
                    f"{round_up(slot_bytes)} (slot_bytes={slot_bytes})"
                )
            if n_slots is not None and n_slots != got_n:
                raise ArenaError(f"arena {name!r} has {got_n} slots, expected {n_slots}")
            mm = mmap.mmap(fd, want, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        return cls(name, mm, got_slot, got_n, owner=False, ident=(st.st_dev, st.st_ino))

    def close(self) -> None:
        """Unmap. Releases every slot view handed out; raises ArenaError, leaving the arena mapped and
        refusing new views, while numpy arrays or slices over it are alive or a C call holds a view.
        Idempotent; call again once they are gone."""
        with self._lock:
            if self._mmap is None:
                return
            self._closing = True
            busy = []
            for i, v in enumerate(self._views):
                if v is not None:
                    try:
                        v.release()
                        self._views[i] = None
                    except BufferError:  # exported right now, e.g. os.preadv into it in another thread
                        busy.append(i)
            if busy:
                raise ArenaError(
                    f"arena {self.name!r}: slot view(s) {busy[:16]} are in use "
                    f"by a C call; close again once it returns"
                )
            try:
                self._buf.release()
                self._mmap.close()
            except BufferError:
                raise ArenaError(
                    f"arena {self.name!r} cannot unmap: views over it are still alive (numpy arrays from "
                    f"slot_array/ref_array, or slices of slot views); drop them and close again"
                ) from None
            self._mmap = None

    def unlink(self) -> None:
        """Remove the name from /dev/shm (owner only). Mappings, ours and the stages', stay valid until
        closed; the memory is freed when the last one goes. Idempotent."""
        if not self.owner:
            raise ArenaError(f"arena {self.name!r}: only the owner (the process that created it) unlinks it")
        if self._unlinked:
            return
        path = _path(self.name)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            self._unlinked = True
            return
        if (st.st_dev, st.st_ino) != self._ident:
            raise ArenaError(
                f"arena {self.name!r}: {path} is no longer the segment "
                f"this process created; not unlinking it"
            )
        os.unlink(path)
        self._unlinked = True

    @staticmethod
    def unlink_name(name: str) -> bool:
        """Remove a segment left by a dead run (its owner can no longer unlink it). True if one was removed."""
        try:
            os.unlink(_path(name))
        except FileNotFoundError:
            return False
        return True

    def __enter__(self) -> Arena:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.close()
        finally:
            if self.owner:
                self.unlink()

    @property
    def closed(self) -> bool:
        return self._closing

    def __repr__(self) -> str:
        state = "closed" if self._mmap is None else ("closing" if self._closing else "open")
        return (
            f"Arena({self.name!r}, {self.n_slots} x {self.slot_bytes} bytes, "
            f"{'owner' if self.owner else 'attached'}, {state})"
        )

    # -- views ----------------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closing:
            raise ArenaError(f"arena {self.name!r} is closed")

    def _check_slot(self, slot: int) -> None:
        if not isinstance(slot, int) or isinstance(slot, bool) or not 0 <= slot < self.n_slots:
            raise ArenaError(f"arena {self.name!r}: slot {slot!r} is out of range 0..{self.n_slots - 1}")

    def slot_offset(self, slot: int) -> int:
        """Byte offset of `slot` from the start of the mapping (a multiple of ALIGN)."""
        self._check_slot(slot)
        return HEADER_BYTES + slot * self.slot_bytes

    def slot_view(self, slot: int) -> memoryview:
        """The writable memoryview of slot `slot` ([slot_bytes] bytes), shared by every caller and
        released by close(); do not release it yourself."""
        self._check_open()
        offset = self.slot_offset(slot)
        v = self._views[slot]
        if v is None:
            with self._lock:
                self._check_open()
                v = self._views[slot]
                if v is None:
                    v = self._views[slot] = self._buf[offset : offset + self.slot_bytes]
        return v

    def slot_array(self, slot: int) -> np.ndarray:
        """Slot `slot` as a writable uint8 array, shape [slot_bytes], page-aligned. close() refuses
        while it is alive."""
        self._check_open()
        return np.frombuffer(self._buf, dtype=np.uint8, count=self.slot_bytes, offset=self.slot_offset(slot))

    def ref_array(self, ref: SlotRef) -> np.ndarray:
        """The bytes `ref` points at as a uint8 array, shape [ref.nbytes], after checking that `ref`
        names this arena and stays inside its slot (a peer's message is not trusted to)."""
        self._check_open()
        if ref.arena != self.name:
            raise ArenaError(f"{ref} names arena {ref.arena!r}, not {self.name!r}")
        self._check_slot(ref.slot)
        if ref.offset + ref.nbytes > self.slot_bytes:
            raise ArenaError(f"{ref} runs past the end of its {self.slot_bytes}-byte slot in arena {self.name!r}")
        offset = self.slot_offset(ref.slot) + ref.offset
        return np.frombuffer(self._buf, dtype=np.uint8, count=ref.nbytes, offset=offset)

    @property
    def mapped_bytes(self) -> int:
        """Bytes of the whole mapping, header included (what cuMemHostRegister pins from address())."""
        return HEADER_BYTES + self.slot_bytes * self.n_slots

    def address(self) -> int:
        """Base address of the mapping (for cuMemHostRegister). A raw pointer escapes close()'s checks:
        unregister it before close()."""
        self._check_open()
        return int(np.frombuffer(self._buf, dtype=np.uint8, count=1).ctypes.data)
