"""A host tier for a single process (`coli run --device gpu --vram-gb N`): records read from a container
into a ring of pinned host buffers (one anonymous mapping, registered once), each checksum-verified,
held until its copy to VRAM has landed. No caching on the host side: that is the RAM tier's job in the
stage runtime (`coli up`); here a VRAM miss is a disk read."""

from __future__ import annotations

import errno
import mmap
import os
import time
from collections import OrderedDict
from typing import Callable, Iterator

import numpy as np

from coli.container.format import ALIGN, align
from coli.container.reader import verify_record
from coli.errors import ColiError
from coli.gpu.vram_experts import HostRecord


class DirectReads:
    """Reads expert records with O_DIRECT (no page cache: the NVMe's rate, not RAM's) into page-aligned
    buffers. Records are 4 KiB-aligned in the container (offset and length, coli/container/format.py), so
    each read is one aligned preadv. A file system that refuses O_DIRECT (tmpfs: EINVAL) falls back to buffered
    reads of that file; `fallback` names such files. Each record's xxh64 is verified unless verify=False."""

    def __init__(self, reader, verify: bool = True):
        self.reader, self.verify = reader, verify
        self._fds: dict[int, int] = {}
        self.direct_files = 0
        self.fallback: list[str] = []
        self.bytes_read = 0
        self.read_s = 0.0                       # wall time spent in reads (the reading thread's busy time)

    def _fd(self, f: int) -> int:
        fd = self._fds.get(f)
        if fd is None:
            path = self.reader.expert_paths[f]
            try:
                fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
                self.direct_files += 1
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                fd = os.open(path, os.O_RDONLY)
                self.fallback.append(str(path))
            self._fds[f] = fd
        return fd

    def read(self, layer: int, expert: int, out: np.ndarray) -> np.ndarray:
        """The record into `out` (page-aligned, >= the record's length): uint8 [length]."""
        row = self.reader.index[self.reader._index_row(layer, expert)]
        f, off, n = int(row["file"]), int(row["offset"]), int(row["length"])
        if off % ALIGN or n % ALIGN or out.ctypes.data % ALIGN:
            raise ColiError(f"layer {layer} expert {expert}: record at offset {off} length {n} (buffer at "
                            f"0x{out.ctypes.data:x}) is not {ALIGN}-aligned: cannot read it with O_DIRECT")
        t = time.perf_counter()
        buf = self.reader.read_record(layer, expert, out=out, verify=False, fd_of=self._fd)
        self.read_s += time.perf_counter() - t          # the read alone: the checksum is CPU time
        self.bytes_read += n
        if self.verify:
            verify_record(buf, int(row["xxh64"]), f"{self.reader.expert_paths[f]}: record layer {layer} expert "
                                                  f"{expert} at offset {off} (length {n})")
        return buf

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


class ContainerHostTier:
    def __init__(self, reader, n_buffers: int = 16, direct: bool = False):
        self.reader = reader
        self.direct = DirectReads(reader) if direct else None   # O_DIRECT reads (the `disk` benchmark)
        self.E = reader.config.n_routed_experts
        self.buf_bytes = align(reader.record_layout.nbytes, 4096)
        self.n = max(2, int(n_buffers))
        self._mm = mmap.mmap(-1, self.buf_bytes * self.n)          # page-aligned, private
        self._arr = np.frombuffer(self._mm, np.uint8)
        self._base = int(self._arr.ctypes.data)
        self._free = list(range(self.n))
        self._reclaim: Callable[[], None] | None = None
        self.reads = 0

    def _take(self) -> int:
        if not self._free and self._reclaim is not None:
            self._reclaim()                                       # copies that landed give buffers back
        if not self._free:
            raise RuntimeError("every pinned read buffer is held (more records in flight than buffers)")
        return self._free.pop()

    def grants(self, layer: int, ids: list[int]) -> Iterator[HostRecord | None]:
        for e in ids:
            i = self._take()
            view = self._arr[i * self.buf_bytes:(i + 1) * self.buf_bytes]
            try:
                if self.direct is not None:
                    raw = self.direct.read(layer, int(e), view)              # checksum-verified
                else:
                    raw = self.reader.read_record(layer, int(e), out=view)     # checksum-verified
            except Exception:
                self._free.append(i)
                raise
            self.reads += 1
            yield HostRecord(layer, int(e), self._base + i * self.buf_bytes, int(raw.nbytes), raw, i)

    def release(self, rec: HostRecord) -> None:
        self._free.append(int(rec.token))

    def probe(self, layer: int, expert: int) -> HostRecord | None:
        return None                                   # nothing stays resident on the host here

    def still_valid(self, rec: HostRecord) -> bool:
        return int(rec.token) not in self._free

    def prefetch(self, layer: int, ids: list[int]) -> None:
        pass

    def pinned_ranges(self) -> list[tuple[int, int]]:
        return [(self._base, self.buf_bytes * self.n)]

    def reclaim_hook(self, fn: Callable[[], None]) -> None:
        self._reclaim = fn

    def close(self) -> None:
        if self.direct is not None:
            self.direct.close()


class MemoryHostTier:
    """Every record of some layers held in one pinned host mapping (the `cold-ram` benchmark case: all experts
    in RAM, nothing in VRAM; tests of speculative copies). Grants are immediate; `probe` finds any held record;
    `recycle(layer, e)` bumps a record's generation as if the RAM tier had reused its slot (tests)."""

    holds_all_for_life = True       # no record's memory is ever reused: kernels may read it in place (mapped_experts)

    def __init__(self, reader, layers: list[int], experts: list[int] | None = None):
        self.reader = reader
        self.E = reader.config.n_routed_experts
        self.rec_bytes = reader.record_layout.nbytes
        self.stride = align(self.rec_bytes, 4096)
        experts = list(range(self.E)) if experts is None else list(experts)
        self.index = {(l, e): i for i, (l, e) in enumerate((l, e) for l in layers for e in experts)}
        self._mm = mmap.mmap(-1, self.stride * max(1, len(self.index)))
        self._arr = np.frombuffer(self._mm, np.uint8)
        self._base = int(self._arr.ctypes.data)
        for (l, e), i in self.index.items():
            reader.read_record(l, e, out=self._arr[i * self.stride:(i + 1) * self.stride])
        self.gen = np.zeros(len(self.index), np.int64)
        self._reclaim: Callable[[], None] | None = None
        self.leases = 0

    def _rec(self, layer: int, e: int) -> HostRecord:
        i = self.index.get((layer, int(e)))
        if i is None:
            raise KeyError(f"layer {layer} expert {e} is not held by this host tier")
        off = i * self.stride
        return HostRecord(layer, int(e), self._base + off, self.rec_bytes, self._arr[off:off + self.rec_bytes],
                          (i, int(self.gen[i])))

    def grants(self, layer: int, ids: list[int]) -> Iterator[HostRecord | None]:
        for e in ids:
            self.leases += 1
            yield self._rec(layer, e)

    def release(self, rec: HostRecord) -> None:
        self.leases -= 1

    def probe(self, layer: int, expert: int) -> HostRecord | None:
        return self._rec(layer, expert) if (layer, int(expert)) in self.index else None

    def still_valid(self, rec: HostRecord) -> bool:
        i, g = rec.token
        return int(self.gen[i]) == g

    def recycle(self, layer: int, e: int) -> None:
        self.gen[self.index[(layer, int(e))]] += 1

    def prefetch(self, layer: int, ids: list[int]) -> None:
        pass

    def pinned_ranges(self) -> list[tuple[int, int]]:
        return [(self._base, self.stride * max(1, len(self.index)))]

    def reclaim_hook(self, fn: Callable[[], None]) -> None:
        self._reclaim = fn


class CachedHostTier:
    """A RAM tier for one process (the `budget` benchmark): `capacity` pinned record slots over a container
    (one anonymous mapping, registered once), kept in LRU order. A granted record is leased until `release`;
    a miss takes the least recently used unleased slot (its generation bumps, so a speculative copy of the old
    record fails `still_valid`) and reads the record from disk (O_DIRECT with direct=True), checksum-verified.
    `probe` returns resident records without a lease; `prefetch` does nothing (no background reader here: a
    cold guess is left for the demand read). Counters: hits, misses, evictions, reads, bytes_read."""

    def __init__(self, reader, capacity: int, direct: bool = True):
        self.reader = reader
        self.E = reader.config.n_routed_experts
        self.stride = align(reader.record_layout.nbytes, 4096)
        self.n = max(2, int(capacity))
        self._mm = mmap.mmap(-1, self.stride * self.n)
        self._arr = np.frombuffer(self._mm, np.uint8)
        self._base = int(self._arr.ctypes.data)
        self.direct = DirectReads(reader) if direct else None
        self.key = [None] * self.n                              # (layer, expert) per slot
        self.nbytes = [0] * self.n
        self.gen = np.zeros(self.n, np.int64)
        self.leases = np.zeros(self.n, np.int64)
        self.where: dict[tuple[int, int], int] = {}
        self.lru: OrderedDict[int, None] = OrderedDict((i, None) for i in range(self.n))   # oldest first
        self._reclaim: Callable[[], None] | None = None
        self.stats = {"hits": 0, "misses": 0, "evictions": 0, "reads": 0, "bytes_read": 0, "read_s": 0.0}

    def _record(self, i: int) -> HostRecord:
        layer, e = self.key[i]
        off = i * self.stride
        return HostRecord(layer, e, self._base + off, self.nbytes[i], self._arr[off:off + self.nbytes[i]],
                          (i, int(self.gen[i])))

    def _victim(self) -> int:
        for _ in range(2):
            for i in self.lru:
                if self.leases[i] == 0:
                    return i
            if self._reclaim is None:
                break
            self._reclaim()                                   # copies that landed give leases back
        raise RuntimeError(f"every one of the {self.n} RAM-tier slots is leased (more records in flight than slots)")

    def _fill(self, layer: int, e: int) -> int:
        i = self._victim()
        old = self.key[i]
        if old is not None:
            del self.where[old]
            self.stats["evictions"] += 1
        self.gen[i] += 1
        self.key[i] = None
        view = self._arr[i * self.stride:(i + 1) * self.stride]
        t = time.perf_counter()
        raw = (self.direct.read(layer, e, view) if self.direct is not None
               else self.reader.read_record(layer, e, out=view))
        self.stats["read_s"] += time.perf_counter() - t
        self.stats["reads"] += 1
        self.stats["bytes_read"] += int(raw.nbytes)
        self.key[i], self.nbytes[i] = (layer, e), int(raw.nbytes)
        self.where[(layer, e)] = i
        return i

    def grants(self, layer: int, ids: list[int]) -> Iterator[HostRecord | None]:
        ids = [int(e) for e in ids]
        resident = [e for e in ids if (layer, e) in self.where]
        cold = [e for e in ids if (layer, e) not in self.where]
        for e in resident:                                    # RAM hits first: no wait
            i = self.where[(layer, e)]
            self.stats["hits"] += 1
            self.leases[i] += 1
            self.lru.move_to_end(i)
            yield self._record(i)
        for e in cold:
            yield None                                        # a disk read follows
            if (layer, e) in self.where:                      # read meanwhile (cannot happen: one thread)
                i = self.where[(layer, e)]
                self.stats["hits"] += 1
            else:
                self.stats["misses"] += 1
                i = self._fill(layer, e)
            self.leases[i] += 1
            self.lru.move_to_end(i)
            yield self._record(i)

    def release(self, rec: HostRecord) -> None:
        i = int(rec.token[0])
        if self.leases[i] <= 0:
            raise ValueError(f"RAM-tier slot {i} is not leased")
        self.leases[i] -= 1

    def probe(self, layer: int, expert: int) -> HostRecord | None:
        i = self.where.get((layer, int(expert)))
        return None if i is None else self._record(i)

    def still_valid(self, rec: HostRecord) -> bool:
        i, g = rec.token
        return int(self.gen[i]) == g

    def prefetch(self, layer: int, ids: list[int]) -> None:
        pass

    def hit_rate(self) -> float:
        n = self.stats["hits"] + self.stats["misses"]
        return self.stats["hits"] / n if n else 0.0

    def pinned_ranges(self) -> list[tuple[int, int]]:
        return [(self._base, self.stride * self.n)]

    def reclaim_hook(self, fn: Callable[[], None]) -> None:
        self._reclaim = fn

    def close(self) -> None:
        if self.direct is not None:
            self.direct.close()
