"""Read-only probes of the machine, shared by `coli plan` (default figures) and `coli doctor` (checks):
memory from /proc/meminfo, GPUs through `nvidia-smi` (never a CUDA context), the locked-memory limit,
/dev/shm, and a bounded O_DIRECT read of existing files to measure a volume's read speed."""

from __future__ import annotations

import mmap
import os
import resource
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

# Usable fraction of a PCIe link's raw rate for large pinned copies (measured here: 55.9 GB/s on Gen5 x16,
# whose raw rate is 63 GB/s, ARCHITECTURE §1).
PCIE_EFFICIENCY = 0.88
PCIE_LANE_GBPS = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}


def meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes."""
    out: dict[str, int] = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            k, _, rest = line.partition(":")
            parts = rest.split()
            if parts and parts[0].isdigit():
                out[k] = int(parts[0]) * (1024 if len(parts) > 1 and parts[1] == "kB" else 1)
    except OSError:
        pass
    return out


@dataclass
class Gpu:
    index: int
    name: str
    memory_total: int       # bytes
    memory_free: int
    driver: str
    pcie_gen: int | None
    pcie_width: int | None

    @property
    def pcie_gbps(self) -> float | None:
        if not self.pcie_gen or not self.pcie_width or self.pcie_gen not in PCIE_LANE_GBPS:
            return None
        return PCIE_LANE_GBPS[self.pcie_gen] * self.pcie_width * PCIE_EFFICIENCY


def gpus(timeout: float = 10.0) -> tuple[list[Gpu], str | None]:
    """GPUs nvidia-smi reports, and None, or [] and why there are none."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return [], "nvidia-smi not found (no NVIDIA driver installed)"
    q = "index,name,memory.total,memory.free,driver_version,pcie.link.gen.max,pcie.link.width.max"
    try:
        r = subprocess.run([exe, f"--query-gpu={q}", "--format=csv,noheader,nounits"], capture_output=True, text=True,
                           timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        return [], f"nvidia-smi failed: {e}"
    if r.returncode != 0:
        return [], f"nvidia-smi failed: {(r.stderr or r.stdout).strip()[:200]}"
    out = []
    for line in r.stdout.strip().splitlines():
        f = [x.strip() for x in line.split(",")]
        if len(f) < 7:
            continue

        def num(s: str) -> int | None:
            return int(s) if s.isdigit() else None

        out.append(Gpu(int(f[0]), f[1], (num(f[2]) or 0) << 20, (num(f[3]) or 0) << 20, f[4], num(f[5]), num(f[6])))
    return out, None if out else "nvidia-smi lists no GPU"


def memlock_limit() -> int | None:
    """RLIMIT_MEMLOCK soft limit in bytes; None means unlimited."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return None if soft == resource.RLIM_INFINITY else soft


def shm_space(path: str = "/dev/shm") -> tuple[int, int] | None:
    """(total, free) bytes of the shared-memory filesystem, None if it is not there."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize


@dataclass
class ReadSpeed:
    gbps: float
    nbytes: int
    seconds: float
    direct: bool
    note: str = ""


def read_speed(files: list[Path], max_bytes: int = 512 << 20, max_seconds: float = 1.5,
               block: int = 8 << 20) -> ReadSpeed:
    """Read up to `max_bytes` (or `max_seconds`) of `files` with O_DIRECT in `block`-byte reads and time it.
    O_DIRECT bypasses the page cache, so the figure is the device's, not RAM's. Falls back to buffered reads
    (said in `note`) on filesystems that refuse O_DIRECT (tmpfs, some overlays)."""
    buf = mmap.mmap(-1, block)  # page-aligned, as O_DIRECT needs
    total, t0, direct, note = 0, time.perf_counter(), True, ""
    try:
        for p in files:
            try:
                fd = os.open(p, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
            except OSError as e:
                direct, note = False, f"O_DIRECT refused on {p.parent} ({e.strerror}); buffered reads (may be cached)"
                fd = os.open(p, os.O_RDONLY)
            try:
                size = os.fstat(fd).st_size
                off = 0
                while off < size and total < max_bytes and time.perf_counter() - t0 < max_seconds:
                    try:
                        n = os.preadv(fd, [buf], off)
                    except OSError as e:
                        if direct and e.errno == 22:  # EINVAL: O_DIRECT not supported for this file
                            os.close(fd)
                            fd = os.open(p, os.O_RDONLY)
                            direct, note = False, f"O_DIRECT refused on {p.parent}; buffered reads (may be cached)"
                            continue
                        raise
                    if n <= 0:
                        break
                    total += n
                    off += n
            finally:
                os.close(fd)
            if total >= max_bytes or time.perf_counter() - t0 >= max_seconds:
                break
    finally:
        buf.close()
    dt = time.perf_counter() - t0
    if total == 0:
        raise ValueError("nothing to read: the files are empty")
    if total < 64 << 20:
        note = (note + "; " if note else "") + f"only {total >> 10} KiB to read: a rough figure"
    return ReadSpeed(total / dt / 1e9, total, dt, direct, note)


def expert_files(model_dir: str | Path) -> list[Path]:
    d = Path(model_dir)
    return sorted(d.glob("experts-*.coli"))


@dataclass
class CpuExpertSpeed:
    expert_s: float       # one routed expert for one token on the numpy path: decode its record + SwiGLU
    gemv_gbps: float      # float32 weight bytes/s of the matrix-vector products alone (the dense core's rate)
    note: str


def cpu_expert_speed(rows: int, cols: int, fmt: str, group: int, tile_kb: int, repeats: int = 2) -> CpuExpertSpeed:
    """Time what the CPU path does per routed expert, on one matrix of the model's own expert layout: decode it
    from record bytes (coli.container.quant, as the executor decodes a RAM-tier slot) and multiply one token by
    it. gate, up and down hold the same number of weights, so an expert costs three times one matrix. The
    bytes are a constant pattern (0x3C) that decodes to normal, finite numbers in every format: random bytes
    would hold fp16 NaNs and subnormals, which run slower than real scales. Best of `repeats`."""
    import numpy as np

    from coli.container.format import MatrixLayout
    from coli.container.quant import decode_matrix

    lay = MatrixLayout.make(rows, cols, fmt, group, tile_kb)
    buf = np.full(lay.nbytes, 0x3C, np.uint8)
    x = np.full((1, cols), 0.01, np.float32)                              # [1, cols]: one token
    best_dec = best_mul = float("inf")
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        w = decode_matrix(buf, lay)                                       # [rows, cols] float32
        t1 = time.perf_counter()
        y = x @ w.T                                                       # [1, rows]
        t2 = time.perf_counter()
        best_dec, best_mul = min(best_dec, t1 - t0), min(best_mul, t2 - t1)
    del y
    per_expert = 3 * (best_dec + best_mul)
    gemv = rows * cols * 4 / max(best_mul, 1e-9) / 1e9
    return CpuExpertSpeed(per_expert, gemv, f"one {rows} x {cols} {fmt} matrix decoded in {best_dec * 1e3:.0f} ms and "
                                            f"multiplied in {best_mul * 1e3:.1f} ms (best of {max(1, repeats)})")
