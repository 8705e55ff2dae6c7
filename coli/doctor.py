"""`coli doctor` checks: read-only readiness checks of this machine (and of a model, with --model), each a
function returning a `Check` (pass / warn / fail, what was found, and the fix). Nothing here creates a CUDA
context, writes a file outside a temporary probe, or changes a setting."""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import random
import socket
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from coli import probe

PASS, WARN, FAIL, SKIP = "pass", "warn", "fail", "skip"
REQUIRED = ("numpy", "typer", "rich", "zmq:pyzmq", "msgpack", "structlog", "aiofiles", "safetensors", "tokenizers",
            "jinja2:Jinja2", "xxhash", "starlette", "uvicorn")
OPTIONAL = ("uvloop", "pycuda")
GOOD_DISK_GBPS = 3.0


@dataclass
class Check:
    name: str
    status: str
    message: str
    fix: str = ""


@dataclass
class Context:
    model: Path | None = None
    ram_gb: float = 4.0          # the RAM tier `coli up --ram-gb` will ask for
    port: int = 8000             # where `coli serve` will listen
    host: str = "127.0.0.1"
    sample: int = 16             # expert records whose checksums are recomputed
    read_mb: int = 512           # most bytes the read-speed probe reads

    @property
    def container(self) -> Path | None:
        from coli.container.format import MANIFEST_NAME
        return self.model if self.model is not None and (self.model / MANIFEST_NAME).is_file() else None


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def check_python(ctx: Context) -> Check:
    v = sys.version_info
    if v < (3, 11):
        return Check("python", FAIL, f"Python {v.major}.{v.minor} at {sys.executable}", "use Python >= 3.11")
    return Check("python", PASS, f"Python {v.major}.{v.minor}.{v.micro} at {sys.executable}")


def check_packages(ctx: Context) -> Check:
    missing, found = [], []
    for spec in REQUIRED:
        mod, _, dist = spec.partition(":")
        try:
            importlib.import_module(mod)
            found.append(f"{dist or mod} {importlib.metadata.version(dist or mod)}")
        except Exception as e:  # ImportError, or a broken install raising anything on import
            missing.append(f"{dist or mod} ({type(e).__name__})")
    if missing:
        return Check("packages", FAIL, "missing or broken: " + ", ".join(missing),
                     "pip install -e . (from the ColiStream checkout) or pip install colistream")
    opt = []
    for mod in OPTIONAL:
        try:
            opt.append(f"{mod} {importlib.metadata.version(mod)}")
        except importlib.metadata.PackageNotFoundError:
            opt.append(f"{mod} not installed")
    return Check("packages", PASS, f"{len(found)} required packages import; " + ", ".join(opt))


def check_cuda_driver(ctx: Context) -> Check:
    gpus, why = probe.gpus()
    if not gpus:
        return Check("cuda driver", WARN, f"{why}: only the CPU path (--device cpu) can run",
                     "install the NVIDIA driver to use a GPU")
    return Check("cuda driver", PASS, f"driver {gpus[0].driver}; " + "; ".join(f"GPU {g.index} {g.name}" for g in gpus))


def check_pycuda(ctx: Context) -> Check:
    # In a child process: the import and cuInit stay out of this one, and a hang is bounded.
    code = "import pycuda.driver as d; d.init(); print(d.get_version(), d.Device.count())"
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return Check("pycuda", FAIL, "importing pycuda and cuInit took over 30 s", "check the driver (nvidia-smi)")
    if r.returncode != 0:
        err = (r.stderr.strip().splitlines() or ["?"])[-1][:200]
        if "No module named 'pycuda'" in err:
            return Check("pycuda", WARN, "PyCUDA is not installed: the GPU stage cannot start",
                         "pip install -e '.[gpu]' (needs the CUDA toolkit headers)")
        return Check("pycuda", WARN if "cuInit" in err or "CUDA" in err else FAIL, f"PyCUDA: {err}",
                     "check the NVIDIA driver and that the CUDA libraries are on the loader path")
    ver, n = r.stdout.split(")", 1) if ")" in r.stdout else (r.stdout, "")
    return Check("pycuda", PASS, f"PyCUDA imports; CUDA driver API {ver.strip('( ')}, {n.strip()} device(s)")


def _model_need(ctx: Context) -> tuple[int, int] | None:
    """(dense core bytes, expert record bytes) of --model's container."""
    if ctx.container is None:
        return None
    from coli.plan import sizes_from_container
    s = sizes_from_container(ctx.container)
    return s.dense_bytes, s.expert_bytes


def check_gpu_memory(ctx: Context) -> Check:
    gpus, why = probe.gpus()
    if not gpus:
        return Check("gpu memory", SKIP, f"no GPU ({why})")
    g = max(gpus, key=lambda g: g.memory_free)
    need = _model_need(ctx)
    msg = f"GPU {g.index}: {_gb(g.memory_free)} free of {_gb(g.memory_total)}"
    if need is None:
        return Check("gpu memory", PASS, msg + " (pass --model to check it against a model)")
    dense, rec = need
    want = dense + 16 * rec + int(1e9)
    if g.memory_free < want:
        return Check("gpu memory", FAIL, msg + f"; the dense core ({_gb(dense)}), 16 expert slots and 1 GB of "
                     f"workspace need {_gb(want)}", "free GPU memory (other processes: nvidia-smi) or use --device cpu;"
                     " `coli plan` shows what fits")
    return Check("gpu memory", PASS, msg + f"; {_gb(want)} needed for the dense core + 16 slots + workspace")


def check_memlock(ctx: Context) -> Check:
    lim = probe.memlock_limit()
    arena = int(ctx.ram_gb * 1e9)
    if lim is None:
        return Check("locked memory", PASS, "RLIMIT_MEMLOCK is unlimited (the arena can be pinned)")
    if os.geteuid() == 0:
        return Check("locked memory", PASS, f"RLIMIT_MEMLOCK {_gb(lim)}, but running as root (CAP_IPC_LOCK) pins "
                     f"regardless")
    if lim < arena:
        return Check("locked memory", WARN, f"RLIMIT_MEMLOCK is {_gb(lim)}, the {_gb(arena)} RAM tier cannot be "
                     f"pinned: copies fall back to pageable speed (7-14 GB/s)",
                     "ulimit -l unlimited (or memlock in /etc/security/limits.conf; docker: --ulimit memlock=-1)")
    return Check("locked memory", PASS, f"RLIMIT_MEMLOCK {_gb(lim)} >= the {_gb(arena)} RAM tier")


def check_shm(ctx: Context) -> Check:
    sp = probe.shm_space()
    arena = int(ctx.ram_gb * 1e9)
    if sp is None:
        return Check("/dev/shm", FAIL, "/dev/shm is not mounted", "mount -t tmpfs -o size=<N>G tmpfs /dev/shm")
    total, free = sp
    msg = f"{_gb(free)} free of {_gb(total)}; the RAM tier (--ram-gb {ctx.ram_gb:g}) needs {_gb(arena)}"
    if free < arena:
        return Check("/dev/shm", FAIL, msg, f"mount -o remount,size={int(ctx.ram_gb * 1.1) + 1}G /dev/shm (docker: "
                     f"--shm-size), or lower --ram-gb")
    return Check("/dev/shm", PASS, msg)


def check_free_ram(ctx: Context) -> Check:
    mi = probe.meminfo()
    avail, total = mi.get("MemAvailable", 0), mi.get("MemTotal", 0)
    arena = int(ctx.ram_gb * 1e9)
    msg = f"{_gb(avail)} available of {_gb(total)}; the RAM tier (--ram-gb {ctx.ram_gb:g}) takes {_gb(arena)}"
    if avail < arena:
        return Check("free ram", FAIL, msg, "lower --ram-gb or free memory")
    if avail < arena + 2e9:
        return Check("free ram", WARN, msg + " and leaves under 2 GB for the rest", "lower --ram-gb")
    return Check("free ram", PASS, msg)


def check_disk_speed(ctx: Context) -> Check:
    if ctx.container is None:
        return Check("disk read speed", SKIP, "pass --model CONTAINER to measure its volume")
    files = probe.expert_files(ctx.container)
    try:
        rs = probe.read_speed(files, max_bytes=ctx.read_mb << 20)
    except (OSError, ValueError) as e:
        return Check("disk read speed", WARN, f"could not measure: {e}")
    msg = f"{rs.gbps:.2f} GB/s reading {rs.nbytes / 2**20:.1f} MiB of {ctx.container} in {rs.seconds:.3f} s"
    if rs.direct and rs.note:
        msg += f" ({rs.note})"
    if not rs.direct:
        return Check("disk read speed", WARN, f"{msg}; {rs.note}",
                     "keep containers on a filesystem that supports O_DIRECT (ext4, xfs) on an NVMe")
    if rs.gbps < GOOD_DISK_GBPS:
        return Check("disk read speed", WARN, msg + f" with O_DIRECT: below {GOOD_DISK_GBPS:g} GB/s, cold experts "
                     f"will be disk-bound", "put the container on a local NVMe (`coli plan` shows the effect)")
    return Check("disk read speed", PASS, msg + " with O_DIRECT")


def check_container(ctx: Context) -> Check:
    if ctx.model is None:
        return Check("container", SKIP, "pass --model DIR to check a container")
    if ctx.container is None:
        if (ctx.model / "config.json").is_file():
            return Check("container", WARN, f"{ctx.model} is a Hugging Face checkpoint, not a container: "
                         f"`coli up` converts it (lossless f32) on first use", f"coli convert {ctx.model} DST "
                         f"for a quantised container")
        return Check("container", FAIL, f"{ctx.model} is neither a container nor a checkpoint (no config.json)")
    import numpy as np

    from coli.container.check import _hash_range
    from coli.container.format import ContainerError
    from coli.container.reader import ContainerReader

    try:
        r = ContainerReader(ctx.container, cache_dense=False)
    except (ContainerError, OSError) as e:
        return Check("container", FAIL, f"manifest/index check failed: {e}", f"re-convert with coli convert")
    try:
        rng = random.Random(0)
        rows = rng.sample(range(len(r.index)), min(ctx.sample, len(r.index)))
        buf = np.empty(r.record_layout.nbytes, np.uint8)
        bad = []
        for i in rows:
            row = r.index[i]
            fd = os.open(r.expert_paths[int(row["file"])], os.O_RDONLY)
            try:
                got = _hash_range(fd, int(row["offset"]), int(row["length"]), buf)
            finally:
                os.close(fd)
            if got != int(row["xxh64"]):
                bad.append(f"layer {int(row['layer'])} expert {int(row['expert'])}")
        m = r.manifest
        dense = sorted(m.dense.values(), key=lambda e: e.length)[-2:]  # the two largest tensors
        fd = os.open(ctx.container / m.dense_file.name, os.O_RDONLY)
        try:
            dbuf = np.empty(1 << 24, np.uint8)
            for e in dense:
                if _hash_range(fd, e.layout.offset, e.length, dbuf) != e.xxh64:
                    bad.append(f"dense tensor {e.name}")
        finally:
            os.close(fd)
    finally:
        r.close()
    what = f"manifest, index and file headers ok; {len(rows)} sampled expert records + {len(dense)} dense tensors"
    if bad:
        return Check("container", FAIL, f"{what}: checksum mismatch in " + ", ".join(bad[:5]),
                     f"coli verify {ctx.container} lists every damaged extent; re-convert or restore the files")
    return Check("container", PASS, f"{what} match their checksums")


def check_ports(ctx: Context) -> Check:
    s = socket.socket(socket.AF_INET6 if ":" in ctx.host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.bind((ctx.host, ctx.port))
    except OSError as e:
        return Check("free port", WARN, f"{ctx.host}:{ctx.port} is taken ({e.strerror})",
                     f"coli serve --http {ctx.host}:<another port> (or stop what listens there)")
    finally:
        s.close()
    return Check("free port", PASS, f"{ctx.host}:{ctx.port} is free for coli serve")


def check_run_dir(ctx: Context) -> Check:
    from coli.protocol.rundir import SUN_PATH_MAX, default_base

    base = default_base()
    probe_dir = base if base.exists() else base.parent
    longest = len(str(base / ("x" * 64) / "executor.sock"))
    if not os.access(probe_dir, os.W_OK):
        return Check("run dir", FAIL, f"{probe_dir} is not writable", "set COLI_RUN_DIR to a writable directory")
    if longest > SUN_PATH_MAX:
        return Check("run dir", WARN, f"{base}: socket paths may reach {longest} bytes (limit {SUN_PATH_MAX}); long "
                     f"run names will be refused", "set COLI_RUN_DIR to a shorter path")
    return Check("run dir", PASS, f"{base} (sockets, logs)")


CHECKS: tuple[Callable[[Context], Check], ...] = (
    check_python, check_packages, check_cuda_driver, check_pycuda, check_gpu_memory, check_memlock, check_shm,
    check_free_ram, check_disk_speed, check_container, check_ports, check_run_dir)


def run_checks(ctx: Context, checks=CHECKS) -> list[Check]:
    out = []
    for fn in checks:
        try:
            out.append(fn(ctx))
        except Exception as e:  # a check that breaks is itself a finding, never a traceback
            out.append(Check(fn.__name__.removeprefix("check_").replace("_", " "), FAIL,
                             f"the check itself failed: {type(e).__name__}: {e}"))
    return out


def to_dicts(checks: list[Check]) -> list[dict]:
    return [asdict(c) for c in checks]
