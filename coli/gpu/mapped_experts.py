"""An expert source whose records stay in pinned host RAM and are read by the MoE kernels over PCIe ("zero-copy";
issue 14 §1: "reading misses straight from mapped pinned host memory inside the MoE kernel is another design worth
measuring").

Why it is worth measuring. A streaming layer today waits for the router's top-k on the host, then the copy lane
issues the misses' DMA copies, then the kernels run on the copied slots: the link idles from the end of one layer's
copies through the next layer's dense part and the router read-back (docs/perf-notes.md: ~120-240 µs of host path
on top of the ~170 µs dense part, in a ~3.3 ms cold-ram layer). With the records mapped into the device's address
space, the slot table of a step replayed from a CUDA graph (coli/gpu/graphs.py, the warm path) can point at them
directly: the MoE kernels' own loads pull the weights over PCIe the moment the router is done, with no host in the
loop, one graph launch per token as in warm. What it costs: SM-issued PCIe reads (128-byte requests) against the
copy engine's large DMA bursts -- the ceiling `coli.bench.ceilings.h2d_peak` measures both in the same run -- and
nothing is retained in VRAM, so a record used again next token crosses PCIe again (the `cold-ram` case, where
that is true of the copy path too).

The kernels are the ones the resident experts use, reading the same record bytes at other addresses: the results are
bit for bit those of `ResidentExperts` (GPU test).

Only for a host tier that says it holds every record of its layers for its whole life (`holds_all_for_life`:
`MemoryHostTier`): a tier that recycles its slots (the LRU RAM tier, the stages' arena) would change the bytes under
a captured graph's table, even one that happens to hold everything when this is built.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator

import numpy as np

from coli.errors import ColiError
from coli.gpu.cuda_weights import DeviceRecord, check_record_formats


class MappedHostExperts:
    """ExpertSource over `host`'s pinned records, mapped into the device's address space (registered here with
    CU_MEMHOSTREGISTER_DEVICEMAP: the host tier must not be registered by anyone else meanwhile). `slot_table`
    gives the replayed step its [L, E] record addresses; `stream` hands the eager step the same addresses.
    close() (or the context manager) waits for the device (`sync`: kernels may still be reading the pages) and
    unregisters."""

    def __init__(self, drv: Any, host: Any, layout: Any, layers: Iterable[int], n_experts: int,
                 sync: Callable[[], None] | None = None):
        check_record_formats(layout)
        self.drv, self.host, self.layout, self.E, self.sync = drv, host, layout, int(n_experts), sync
        self.layers = sorted(set(int(x) for x in layers))
        self._ranges: list[tuple[int, int, int | None]] = []   # (host address, bytes, device address)
        self._ptr: dict[tuple[int, int], int] = {}
        if not getattr(host, "holds_all_for_life", False):
            raise ColiError(f"MappedHostExperts needs a host tier that holds every record for its whole life "
                            f"(MemoryHostTier); {type(host).__name__} may recycle a record's memory under the kernels")
        missing = [(l, e) for l in self.layers for e in range(self.E) if host.probe(l, e) is None]
        if missing:
            raise ColiError(f"MappedHostExperts needs every record of layers {self.layers} held in pinned RAM; "
                            f"the host tier lacks {len(missing)}, first layer {missing[0][0]} expert "
                            f"{missing[0][1]} (use a tier that holds them all, MemoryHostTier)")
        try:
            for addr, n in host.pinned_ranges():
                drv.host_register(addr, n, device_map=True)
                self._ranges.append((addr, n, None))           # registered: close() gives it back whatever follows
                self._ranges[-1] = (addr, n, drv.host_device_pointer(addr))
            for l in self.layers:
                for e in range(self.E):
                    rec = host.probe(l, e)
                    self._ptr[(l, e)] = self._device_address(rec.addr, rec.nbytes, l, e)
        except BaseException:
            self.close()
            raise

    def _device_address(self, addr: int, nbytes: int, layer: int, e: int) -> int:
        for a, n, d in self._ranges:
            if d is not None and a <= addr and addr + nbytes <= a + n:
                return d + (addr - a)
        raise ColiError(f"layer {layer} expert {e}: its record at 0x{addr:x} ({nbytes} bytes) lies outside the host "
                        f"tier's pinned ranges")

    @property
    def nbytes(self) -> int:
        """VRAM this source takes: none (the records stay in host RAM)."""
        return 0

    def slot_table(self, n_layers: int) -> np.ndarray:
        """[n_layers, E] uint64 device addresses of the mapped records, 0 on layers not held (coli.gpu.graphs)."""
        from coli.gpu.graphs import build_slot_table
        return build_slot_table(n_layers, self.E, self.layers, lambda layer, e: self._ptr[(layer, e)])

    def record(self, layer: int, e: int) -> DeviceRecord:
        p = self._ptr.get((layer, int(e)))
        if p is None:
            raise KeyError(f"no mapped record for layer {layer} expert {e}")
        return DeviceRecord(p, self.layout)

    def stream(self, layer: int, ids: list[int]) -> Iterator[tuple[int, DeviceRecord]]:
        for e in ids:
            yield e, self.record(layer, e)

    def close(self) -> None:
        """Wait for the device, then unregister every range (each on its own: one the driver refuses does not keep
        the others registered; the first such error is raised after all were tried)."""
        ranges, self._ranges, self._ptr = self._ranges, [], {}
        if not ranges:
            return
        if self.sync is not None:
            try:
                self.sync()                 # kernels queued on these pages must be done before the pages go
            except Exception:   # noqa: BLE001 -- a lost context: nothing reads them any more; unregister anyway
                pass
        first: BaseException | None = None
        for addr, _n, _d in ranges:
            try:
                self.drv.host_unregister(addr)
            except Exception as e:   # noqa: BLE001
                first = first or e
        if first is not None:
            raise first

    def __enter__(self) -> "MappedHostExperts":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
