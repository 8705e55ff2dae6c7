"""A host tier for a single process (`coli run --device gpu --vram-gb N`): records read from a container
into a ring of pinned host buffers (one anonymous mapping, registered once), each checksum-verified,
held until its copy to VRAM has landed. No caching on the host side: that is the RAM tier's job in the
stage runtime (`coli up`); here a VRAM miss is a disk read."""

from __future__ import annotations

import mmap
from typing import Callable, Iterator

import numpy as np

from coli.container.format import align
from coli.gpu.vram_experts import HostRecord


class ContainerHostTier:
    def __init__(self, reader, n_buffers: int = 16):
        self.reader = reader
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


class MemoryHostTier:
    """Every record of some layers held in one pinned host mapping (the `cold-ram` benchmark case: all experts
    in RAM, nothing in VRAM; tests of speculative copies). Grants are immediate; `probe` finds any held record;
    `recycle(layer, e)` bumps a record's generation as if the RAM tier had reused its slot (tests)."""

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
