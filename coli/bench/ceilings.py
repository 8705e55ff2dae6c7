"""The ceilings a streaming benchmark is judged against, measured in the same run: the pinned host-to-device copy
peak (`h2d_peak`) and the O_DIRECT read peak of the disk holding the slice (`odirect_read_peak`).

    h2d_peak(nbytes=512 MiB, tiles_kb=(64..4096), repeats=5)
        an anonymous page-aligned mmap registered with cuMemHostRegister (coli.gpu.driver), a device buffer from
        PyCUDA, copies on a stream of its own, timed by driver events:
          whole_GBps      one cuMemcpyHtoDAsync of the whole buffer (best of `repeats`; whole_GBps_median too)
          tiles[kb].GBps  the whole buffer as back-to-back tiles of kb KiB, one cuMemcpyHtoDAsync per tile issued
                          from Python (so it includes the issue cost a copy lane pays), best of `repeats`
          tiles[kb].tile_us  one tile's transfer time: median of `tile_samples` single-tile copies, each between
                          its own pair of events -- the "tile transfer time" unit demand delays are reported in
    mapped_read_peak(nbytes=512 MiB, repeats=5)
        the zero-copy expert source's ceiling (coli/gpu/mapped_experts.py): an anonymous mmap registered with
        CU_MEMHOSTREGISTER_DEVICEMAP, read by a kernel over PCIe through its device-mapped address (`read_ceiling`,
        16-byte loads, 8 in flight per thread) at 1, 2 and 4 x the resident blocks of 256 threads:
          GBps            the best grid's rate (best of `repeats` each); grids {blocks: GBps}
    odirect_read_peak(path, block_mb=(1,4,16), threads=(1,4,8), seconds=3.0)
        random block-aligned reads of an existing file with O_DIRECT (page cache bypassed; nothing is dropped from
        it) by N threads for `seconds` per (block, threads) pair; falls back to buffered reads, saying so, where
        the filesystem refuses O_DIRECT (tmpfs, some overlay filesystems).

Importing this module needs nothing beyond the standard library; PyCUDA is imported inside `h2d_peak` and
`mapped_read_peak`.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import random
import statistics
import threading
import time
from pathlib import Path
from typing import Any, Iterator

from coli.errors import ColiError

ALIGN = 4096
TILES_KB = (64, 128, 256, 512, 1024, 2048, 4096)


class CeilingError(ColiError):
    """A ceiling could not be measured (names the file or the setting)."""


# ---- pinned host-to-device copies ----------------------------------------------------------------------------------
def _addr(mm: mmap.mmap) -> tuple[int, Any]:
    """The address of an mmap's first byte and the ctypes view holding the export (drop it before mm.close())."""
    view = ctypes.c_char.from_buffer(mm)
    return ctypes.addressof(view), view


@contextlib.contextmanager
def _pinned_buffer(drv, nbytes: int, device_map: bool = False) -> Iterator[int]:
    """An anonymous mapping of nbytes, every page faulted in and registered with the driver (device_map: mapped into
    the device's address space too) -> its address; unregistered and unmapped on the way out."""
    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    src, view = _addr(mm)
    ctypes.memset(src, 1, nbytes)     # fault every page in before registering (register pins them)
    try:
        drv.host_register(src, nbytes, device_map=device_map)
        try:
            yield src
        finally:
            drv.host_unregister(src)
    finally:
        del view
        mm.close()


def h2d_peak(nbytes: int = 512 << 20, tiles_kb: tuple[int, ...] = TILES_KB, repeats: int = 5,
             tile_samples: int = 64, device: int = 0) -> dict[str, Any]:
    """Pinned H2D copy peak: whole-buffer GB/s, and per tile size the GB/s of back-to-back tiles and one tile's µs.

    Returns {"whole_GBps", "whole_GBps_median", "tiles": {kb: {"GBps", "GBps_median", "tile_us", "tiles"}},
    "nbytes", "repeats", "tile_samples", "pinned", "device"}. GB = 1e9 bytes."""
    if nbytes < ALIGN or nbytes % ALIGN:
        raise CeilingError(f"h2d_peak nbytes={nbytes}: must be a positive multiple of {ALIGN}")
    bad = [kb for kb in tiles_kb if kb <= 0 or (kb << 10) > nbytes]
    if bad:
        raise CeilingError(f"h2d_peak tiles_kb {bad}: each tile must be 1 KiB..nbytes ({nbytes} B)")
    if repeats < 1 or tile_samples < 1:
        raise CeilingError(f"h2d_peak repeats={repeats}, tile_samples={tile_samples}: both must be >= 1")

    from coli.gpu.driver import get_driver
    from coli.gpu.cuda_runtime import get_runtime

    rt = get_runtime(device)          # creates and pushes the context PyCUDA and the driver calls share
    import pycuda.driver as cuda

    drv = get_driver()
    with _pinned_buffer(drv, nbytes) as src:
        dbuf = stream = e0 = e1 = None
        try:
            dbuf = cuda.mem_alloc(nbytes)
            dst = int(dbuf)
            stream = drv.stream_create()
            e0, e1 = drv.event_create(True), drv.event_create(True)

            def timed(copies: list[tuple[int, int, int]]) -> float:
                """Seconds between events around these (dst, src, n) copies on the stream."""
                drv.event_record(e0, stream)
                for d, s, n in copies:
                    drv.copy_htod_async(d, s, n, stream)
                drv.event_record(e1, stream)
                drv.event_sync(e1)
                return drv.elapsed_ms(e0, e1) / 1e3

            timed([(dst, src, nbytes)])   # warm-up: first-touch costs, lazy driver setup
            whole = [nbytes / timed([(dst, src, nbytes)]) / 1e9 for _ in range(repeats)]
            tiles: dict[int, dict[str, Any]] = {}
            for kb in tiles_kb:
                t = kb << 10
                n = nbytes // t
                plan = [(dst + i * t, src + i * t, t) for i in range(n)]
                rates = [n * t / timed(plan) / 1e9 for _ in range(repeats)]
                singles = [timed([plan[j % n]]) * 1e6 for j in range(tile_samples)]
                tiles[kb] = {"GBps": max(rates), "GBps_median": statistics.median(rates),
                             "tile_us": statistics.median(singles), "tiles": n}
            return {"whole_GBps": max(whole), "whole_GBps_median": statistics.median(whole), "tiles": tiles,
                    "nbytes": nbytes, "repeats": repeats, "tile_samples": tile_samples,
                    "pinned": "anonymous mmap + cuMemHostRegister", "device": str(rt.device.name())}
        finally:
            if stream is not None:
                drv.stream_sync(stream)
            for ev in (e0, e1):
                if ev is not None:
                    drv.event_destroy(ev)
            if stream is not None:
                drv.stream_destroy(stream)
            if dbuf is not None:
                dbuf.free()


def mapped_read_peak(nbytes: int = 512 << 20, repeats: int = 5, device: int = 0) -> dict[str, Any]:
    """GB/s of a kernel reading pinned host memory over PCIe (see the module docstring). GB = 1e9 bytes."""
    if nbytes < ALIGN or nbytes % ALIGN:
        raise CeilingError(f"mapped_read_peak nbytes={nbytes}: must be a positive multiple of {ALIGN}")
    if repeats < 1:
        raise CeilingError(f"mapped_read_peak repeats={repeats}: must be >= 1")
    import numpy as np

    from coli.gpu.cuda_runtime import get_runtime
    from coli.gpu.driver import get_driver

    rt = get_runtime(device)
    drv = get_driver()
    with _pinned_buffer(drv, nbytes, device_map=True) as src:
        try:
            table = rt.to_device(np.array([drv.host_device_pointer(src)], np.uint64))    # [1] record addresses
            sink = rt.alloc(16)
            f = rt.module("gemv").get_function("read_ceiling")
            f.prepare("PqqiP")
            resident = rt.resident_blocks(f, 256)
            grids: dict[int, float] = {}
            for mult in (1, 2, 4):
                blocks = resident * mult

                def once() -> float:
                    a, b = rt.event(), rt.event()
                    a.record(rt.stream)
                    f.prepared_async_call((blocks, 1, 1), (256, 1, 1), rt.stream, table.ptr, 0, nbytes, 1, sink)
                    b.record(rt.stream)
                    b.synchronize()
                    return b.time_since(a) / 1e3

                once()                                # warm-up: the mapping's first touch
                grids[blocks] = max(nbytes / once() / 1e9 for _ in range(repeats))
            return {"GBps": max(grids.values()), "grids": grids, "nbytes": nbytes, "repeats": repeats,
                    "kernel": "read_ceiling", "threads": 256, "device": str(rt.device.name())}
        finally:
            rt.synchronize()                          # no kernel reads the pages once they are unregistered


# ---- O_DIRECT reads ---------------------------------------------------------------------------------------------------
def _open_direct(path: Path) -> tuple[int, bool, str]:
    """(fd, o_direct, note): O_DIRECT if the filesystem takes it (checked by one aligned read), else buffered."""
    flag = getattr(os, "O_DIRECT", 0)
    if flag:
        try:
            fd = os.open(path, os.O_RDONLY | flag)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise CeilingError(f"{path}: cannot open for reading: {e.strerror}") from None
            why = f"the filesystem refused O_DIRECT at open ({e.strerror})"
        else:
            probe = mmap.mmap(-1, ALIGN)
            try:
                os.preadv(fd, [probe], 0)
                return fd, True, "O_DIRECT: reads bypass the page cache (nothing was dropped from it)"
            except OSError as e:
                os.close(fd)
                if e.errno != errno.EINVAL:
                    raise CeilingError(f"{path}: O_DIRECT read failed: {e.strerror}") from None
                why = f"the filesystem refused an O_DIRECT read ({e.strerror})"
            finally:
                probe.close()
    else:
        why = "this platform has no O_DIRECT"
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        raise CeilingError(f"{path}: cannot open for reading: {e.strerror}") from None
    return fd, False, (f"BUFFERED fallback: {why}; reads may be served from the page cache, so these figures are "
                       f"not the disk's")


def _read_for(fd: int, size: int, block: int, nthreads: int, seconds: float, seed: int) -> tuple[int, float]:
    """Bytes read and seconds taken by nthreads threads reading random aligned blocks until `seconds` pass."""
    slots = (size - block) // ALIGN + 1
    counts = [0] * nthreads
    errors: list[BaseException] = []
    start = threading.Barrier(nthreads + 1)
    deadline = [0.0]

    def worker(k: int) -> None:
        rng = random.Random(seed * 1000 + k)
        buf = mmap.mmap(-1, block)            # page-aligned, as O_DIRECT needs
        try:
            start.wait()
            while time.perf_counter() < deadline[0]:
                got = os.preadv(fd, [buf], rng.randrange(slots) * ALIGN)
                if got <= 0:
                    raise OSError(errno.EIO, f"short read ({got} B)")
                counts[k] += got
        except BaseException as e:            # reported by the caller, naming the file
            errors.append(e)
        finally:
            buf.close()

    ts = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(nthreads)]
    for t in ts:
        t.start()
    t0 = time.perf_counter()
    deadline[0] = t0 + seconds
    start.wait()
    for t in ts:
        t.join()
    dt = time.perf_counter() - t0
    if errors:
        e = errors[0]
        raise OSError(getattr(e, "errno", None) or errno.EIO, getattr(e, "strerror", None) or str(e))
    return sum(counts), dt


def odirect_read_peak(path: str | Path, block_mb: tuple[int, ...] = (1, 4, 16), threads: tuple[int, ...] = (1, 4, 8),
                      seconds: float = 3.0, seed: int = 0) -> dict[str, Any]:
    """Random aligned reads of an existing file, `seconds` per (block, threads) pair.

    Returns {"path", "size", "o_direct", "page_cache", "note", "best_GBps", "best": {"block_mb", "threads"},
    "table": [{"block_mb", "threads", "GBps", "bytes", "seconds"}], "skipped": [...], "seconds_each"}.
    Block sizes larger than the file are skipped (listed in "skipped")."""
    path = Path(path)
    if not path.is_file():
        raise CeilingError(f"{path}: no such file (odirect_read_peak reads an existing, large file)")
    if seconds <= 0 or not block_mb or not threads or min(threads) < 1 or min(block_mb) < 1:
        raise CeilingError(f"odirect_read_peak on {path}: needs seconds > 0, block_mb >= 1 and threads >= 1 "
                           f"(got seconds={seconds}, block_mb={block_mb}, threads={threads})")
    size = path.stat().st_size // ALIGN * ALIGN
    blocks = [b for b in block_mb if (b << 20) <= size]
    skipped = [b for b in block_mb if (b << 20) > size]
    if not blocks:
        raise CeilingError(f"{path}: {path.stat().st_size} B is smaller than the smallest block ({min(block_mb)} MiB)")
    fd, direct, note = _open_direct(path)
    table: list[dict[str, Any]] = []
    try:
        for b in blocks:
            for n in threads:
                try:
                    got, dt = _read_for(fd, size, b << 20, n, seconds, seed)
                except OSError as e:
                    raise CeilingError(f"{path}: reading {b} MiB blocks with {n} thread(s) failed: "
                                       f"{e.strerror or e}") from None
                table.append({"block_mb": b, "threads": n, "GBps": got / dt / 1e9, "bytes": got, "seconds": dt})
    finally:
        os.close(fd)
    best = max(table, key=lambda r: r["GBps"])
    return {"path": str(path), "size": path.stat().st_size, "o_direct": direct,
            "page_cache": "bypassed (O_DIRECT); nothing dropped" if direct else "may serve reads (buffered fallback)",
            "note": note, "best_GBps": best["GBps"], "best": {"block_mb": best["block_mb"], "threads": best["threads"]},
            "table": table, "skipped": [{"block_mb": b, "why": "larger than the file"} for b in skipped],
            "seconds_each": seconds}
