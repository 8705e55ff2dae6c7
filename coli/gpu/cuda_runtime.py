"""CUDA plumbing for the GPU backend: one context, one compute stream, a device memory pool, the kernel
modules (`cuda/*.cu`, package `coli.kernels`) compiled at run time with PyCUDA's SourceModule, prepared
launches on the explicit stream, and pinned staging for small per-step uploads.

PyCUDA is imported only inside `CudaRuntime.__init__` (and functions it calls): importing this module needs
nothing but numpy. Every driver call goes through PyCUDA, which raises on any error code; kernel launches
are asynchronous, so a failing kernel surfaces at the next synchronisation -- set COLI_CUDA_SYNC=1 to
synchronise after every launch and get the failing kernel's name.

Ordering rule: everything (kernels, async copies, pool reuse) is on the one compute stream, so a device
buffer dropped by Python and handed out again by the pool is only reused by work queued after the last
use. The copy lanes of the next part add streams; they hand over with events.
"""

from __future__ import annotations

import atexit
import os
import threading
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from coli.errors import ColiError

MODULES = ("argmax", "attention", "elementwise", "gemm", "gemv", "graph", "indexer", "moe_mma", "norm", "prefill_mma",
           "rope", "router")


class CudaUnavailable(ColiError):
    """PyCUDA is missing or there is no usable CUDA device."""


class CudaError(ColiError):
    """A CUDA operation failed (names the kernel or copy)."""


def kernels_dir() -> Path:
    """The folder holding the kernel sources (package data `coli.kernels`, the repo's `cuda/`)."""
    try:
        from importlib.resources import files
        p = Path(str(files("coli.kernels").joinpath("coli_common.cuh")))
        if p.is_file():
            return p.parent
    except (ImportError, ModuleNotFoundError, TypeError, ValueError):
        pass
    import coli
    p = Path(coli.__file__).resolve().parent.parent / "cuda"
    if (p / "coli_common.cuh").is_file():
        return p
    raise CudaUnavailable("kernel sources not found: package data coli.kernels (cuda/*.cu) is missing "
                          "(reinstall colistream)")


def kernel_sources() -> list[Path]:
    return sorted(kernels_dir().glob("*.cu"))


class DeviceArray:
    """A dense row-major array in device memory (float32 unless said otherwise). Views share `owner`."""

    __slots__ = ("ptr", "shape", "dtype", "owner")

    def __init__(self, ptr: int, shape: Sequence[int], dtype: Any = np.float32, owner: Any = None):
        self.ptr = int(ptr)
        self.shape = tuple(int(s) for s in shape)
        self.dtype = np.dtype(dtype)
        self.owner = owner

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def reshape(self, *shape) -> "DeviceArray":
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        shape = list(shape)
        if -1 in shape:
            i = shape.index(-1)
            rest = int(np.prod([s for j, s in enumerate(shape) if j != i], dtype=np.int64))
            shape[i] = self.size // max(rest, 1)
        if int(np.prod(shape, dtype=np.int64)) != self.size:
            raise ValueError(f"cannot reshape a device array of shape {self.shape} into {tuple(shape)}")
        return DeviceArray(self.ptr, shape, self.dtype, self.owner)

    def row_view(self, start: int, n: int) -> "DeviceArray":
        """Rows [start, start+n) along the first axis (contiguous)."""
        row = self.nbytes // max(self.shape[0], 1) if self.shape else self.dtype.itemsize
        return DeviceArray(self.ptr + start * row, (n,) + self.shape[1:], self.dtype, self.owner)

    def __int__(self) -> int:
        return self.ptr

    def __repr__(self) -> str:
        return f"DeviceArray(shape={self.shape}, dtype={self.dtype}, ptr=0x{self.ptr:x})"


class _Staging:
    """A ring of pinned host buffers for small asynchronous uploads; a slot is reused only after the
    copy that last read it has finished (its event)."""

    def __init__(self, drv, slots: int = 16, slot_bytes: int = 1 << 20):
        self.drv = drv
        self.slot_bytes = slot_bytes
        self.bufs = [drv.pagelocked_empty(slot_bytes, np.uint8) for _ in range(slots)]
        self.events: list[Any] = [None] * slots
        self.i = 0

    def put(self, host: np.ndarray, dst: int, stream) -> None:
        raw = np.ascontiguousarray(host).reshape(-1).view(np.uint8)
        n = raw.nbytes
        if n == 0:
            return
        if n > self.slot_bytes:
            stream.synchronize()
            self.drv.memcpy_htod(dst, raw)
            return
        i = self.i
        self.i = (i + 1) % len(self.bufs)
        if self.events[i] is not None:
            self.events[i].synchronize()
        else:
            self.events[i] = self.drv.Event()
        buf = self.bufs[i]
        buf[:n] = raw
        self.drv.memcpy_htod_async(dst, buf[:n], stream)
        self.events[i].record(stream)


class CudaRuntime:
    """Context, stream, pool, kernels. One per process and device: use `get_runtime()`."""

    def __init__(self, device: int = 0):
        try:
            import pycuda.driver as drv
            from pycuda.tools import DeviceMemoryPool
        except ImportError as e:
            raise CudaUnavailable(f"PyCUDA is not installed ({e}); pip install 'colistream[gpu]'") from None
        try:
            drv.init()
            n = drv.Device.count()
        except drv.Error as e:
            raise CudaUnavailable(f"the CUDA driver did not initialise: {e}") from None
        if n == 0 or not 0 <= device < n:
            raise CudaUnavailable(f"no CUDA device {device} ({n} device(s) found)")
        self.drv = drv
        self.device = drv.Device(device)
        self.ctx = self.device.retain_primary_context()
        self.ctx.push()
        # PyCUDA aborts the interpreter at exit if a context is still on the stack: pop ours first
        # (atexit runs handlers in reverse order, so this runs before PyCUDA's own cleanup).
        atexit.register(self._pop_context)
        a = drv.device_attribute
        self.name = self.device.name()
        self.cc = self.device.compute_capability()
        self.sm_count = self.device.get_attribute(a.MULTIPROCESSOR_COUNT)
        self.smem_optin = self.device.get_attribute(a.MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
        self.smem_per_sm = self.device.get_attribute(a.MAX_SHARED_MEMORY_PER_MULTIPROCESSOR)
        self.threads_per_sm = self.device.get_attribute(a.MAX_THREADS_PER_MULTIPROCESSOR)
        self.regs_per_sm = self.device.get_attribute(a.MAX_REGISTERS_PER_MULTIPROCESSOR)
        self.stream = drv.Stream()
        self.pool = DeviceMemoryPool()
        self.staging = _Staging(drv)
        self.sync_debug = os.environ.get("COLI_CUDA_SYNC", "") == "1"
        self._modules: dict[str, Any] = {}
        self._fns: dict[tuple[str, str], Any] = {}
        self._smem_set: dict[int, int] = {}
        self.launches = 0
        # COLI_PDL: captured graphs get programmatic kernel->kernel edges (coli/gpu/pdl.py); benchmarks flip it
        from coli.gpu.pdl import pdl_enabled
        self.pdl = pdl_enabled()
        # While a graph is captured (begin_capture .. end_capture): every allocation made, kept alive by the graph
        # (its replays use the same addresses); None when not capturing.
        self._capture_keep: list | None = None
        self._side = None          # the second stream of a captured step's branches (on_side_stream), made once
        self._unjoined: list = []  # the joins of this capture's branches not called yet (end / abort call them)

    # ---- kernels ------------------------------------------------------------------------------------
    def module(self, name: str):
        if name not in self._modules:
            from pycuda.compiler import SourceModule
            d = kernels_dir()
            src = (d / f"{name}.cu").read_text()
            try:
                self._modules[name] = SourceModule(src, no_extern_c=True, include_dirs=[str(d)],
                                                   options=["-std=c++17"])
            except Exception as e:
                raise CudaError(f"compiling cuda/{name}.cu for sm_{self.cc[0]}{self.cc[1]} failed: {e}") from None
        return self._modules[name]

    def use_module(self, name: str, module) -> None:
        """Serve cuda/<name>.cu's kernels from `module` (a loaded module: a variant built with other -D settings, for
        scripts/pf_kernel_sweep.py; None: compile the source as shipped on next use). The functions prepared from
        the old one are dropped, with their shared-memory settings."""
        for key in [k for k in self._fns if k[0] == name]:
            self._smem_set.pop(id(self._fns.pop(key)), None)
        if module is None:
            self._modules.pop(name, None)
        else:
            self._modules[name] = module

    def function(self, module: str, name: str, argtypes: str):
        key = (module, name)
        fn = self._fns.get(key)
        if fn is None:
            fn = self.module(module).get_function(name)
            fn.prepare(argtypes)
            fn.coli_name = name
            self._fns[key] = fn
        return fn

    def _fn_attr(self, fn, name: str, default: int = 0) -> int:
        a = getattr(self.drv.function_attribute, name, None)
        return int(fn.get_attribute(a)) if a is not None else default

    def allow_smem(self, fn, nbytes: int) -> bool:
        """Let fn use nbytes of dynamic shared memory (raising the 48 KiB default); False if it cannot. The default
        covers static + dynamic <= 48 KiB, so the limit is raised as soon as the SUM passes 48 KiB (a kernel with
        96 bytes of static shared memory cannot take exactly 48 KiB of dynamic without it: the launch fails)."""
        static = self._fn_attr(fn, "SHARED_SIZE_BYTES")
        if nbytes + static > self.smem_optin:
            return False
        if nbytes + static > 48 * 1024 and self._smem_set.get(id(fn), 0) < nbytes:
            fn.set_attribute(self.drv.function_attribute.MAX_DYNAMIC_SHARED_SIZE_BYTES, nbytes)
            self._smem_set[id(fn)] = nbytes
        return True

    def resident_blocks(self, fn, threads: int, smem: int = 0) -> int:
        """How many blocks of fn fit on the whole device at once (for persistent grids)."""
        regs = max(self._fn_attr(fn, "NUM_REGS", 128), 1)
        static = self._fn_attr(fn, "SHARED_SIZE_BYTES")
        warps = -(-threads // 32)
        regs_warp = -(-regs * 32 // 256) * 256
        by_regs = self.regs_per_sm // (regs_warp * warps)
        by_threads = self.threads_per_sm // threads
        by_smem = self.smem_per_sm // (smem + static + 1024) if smem + static else 32
        return self.sm_count * max(1, min(by_regs, by_threads, by_smem, 32))

    def launch(self, fn, grid: tuple[int, ...], block: int, *args, smem: int = 0) -> None:
        g = tuple(int(x) for x in grid) + (1,) * (3 - len(grid))
        if min(g) <= 0:
            return
        try:
            fn.prepared_async_call(g, (int(block), 1, 1), self.stream, *args, shared_size=int(smem))
            self.launches += 1
            if self.sync_debug and self._capture_keep is None:
                self.stream.synchronize()
        except self.drv.Error as e:
            raise CudaError(f"kernel {fn.coli_name} (grid {g}, block {block}, smem {smem}): {e}") from None

    # ---- graphs ---------------------------------------------------------------------------------------
    @property
    def capturing(self) -> bool:
        return self._capture_keep is not None

    def _not_capturing(self, what: str) -> None:
        """A host round trip (a synchronisation, a staged upload) cannot be part of a graph: refuse it while
        capturing, so the capture fails with this name instead of the driver's invalidated-capture error."""
        if self._capture_keep is not None:
            raise CudaError(f"{what} during a CUDA graph capture (the step is not graphable: run it eagerly)")

    def begin_capture(self) -> None:
        """Capture everything queued on the compute stream from now on into a graph (coli/gpu/graphs.py)."""
        from coli.gpu.driver import DriverError, get_driver
        if self._capture_keep is not None:
            raise CudaError("begin_capture: a capture is already in progress")
        self.synchronize()
        try:
            get_driver().begin_capture(int(self.stream.handle))
        except DriverError as e:
            raise CudaError(f"cannot capture the decode step into a CUDA graph: {e}") from None
        self._capture_keep = []

    def end_capture(self, pdl: bool | None = None) -> "CudaGraph":
        """End the capture -> the instantiated graph, holding every buffer allocated during the capture. pdl (None:
        self.pdl, COLI_PDL): its kernel->kernel edges made programmatic first (CudaGraph.pdl_edges counts them)."""
        from coli.gpu.driver import DriverError, get_driver
        d = get_driver()
        if self._capture_keep is None:
            raise CudaError("end_capture without begin_capture")
        self._join_branches()
        keep, self._capture_keep = self._capture_keep, None
        try:
            g = d.end_capture(int(self.stream.handle))
            try:
                nodes = d.graph_nodes(g)
                edges = None
                if self.pdl if pdl is None else pdl:
                    edges = self._edge_count(d, g)
                    converted = self._programmatic(d, g)
                else:
                    converted = []
                ex = self._instantiate(d, g, converted)
            finally:
                d.graph_destroy(g)
        except DriverError as e:
            raise CudaError(f"capturing the decode step into a CUDA graph failed: {e}") from None
        return CudaGraph(ex, keep, nodes, len(converted), edges)

    @staticmethod
    def _edge_count(d, g: int) -> int | None:
        """g's edges as captured (a chain of n nodes has n - 1; each fork of a graph branch adds one), or None where
        the driver cannot list them (cuGraphGetEdges_v2: CUDA 12.3+, as programmatic edges need)."""
        from coli.gpu.driver import DriverError
        try:
            return len(d.graph_edges(g))
        except (DriverError, AttributeError):
            return None

    def _programmatic(self, d, g: int) -> list:
        """Make g's kernel->kernel edges programmatic -> the converted edges; [] (one warning) where this device or
        driver cannot. Raises only when the graph could not be put back as captured (pdl.GraphBroken)."""
        from coli.gpu import pdl
        from coli.gpu.driver import DriverError
        if tuple(self.cc) < pdl.MIN_CC:
            pdl.warn_once(f"{self.name} is sm_{self.cc[0]}{self.cc[1]}; programmatic launch needs sm_90+")
            return []
        try:
            return pdl.make_programmatic(d, g)
        except pdl.GraphBroken:
            raise
        except DriverError as e:
            pdl.warn_once(str(e))
            return []

    @staticmethod
    def _instantiate(d, g: int, converted: list) -> int:
        """Instantiate g; if the driver refuses it with programmatic edges, once more as captured (one warning)."""
        from coli.gpu import pdl
        from coli.gpu.driver import DriverError
        try:
            return d.graph_instantiate(g)
        except DriverError as e:
            if not converted:
                raise
            pdl.revert(d, g, converted)
            pdl.warn_once(f"instantiating a graph with programmatic edges failed ({e})")
            converted.clear()
            return d.graph_instantiate(g)

    def on_side_stream(self, fn):
        """While capturing: fn's launches as a second branch of the graph -- on a side stream that starts after
        everything queued so far on the compute stream -> join(), which makes the compute stream wait for that
        branch (once) and returns fn's result. The two branches then run concurrently in every replay. Only while
        capturing: every buffer allocated meanwhile is kept by the graph, so the pool cannot hand a block still in
        use by one branch to the other (eagerly it could: the pool is not stream-ordered). The driver refuses to end
        a capture with a branch not joined, so end_capture and abort_capture join what the caller did not (an error
        between the fork and the join), and when fn raises its branch is joined before the error goes on."""
        if self._capture_keep is None:
            raise CudaError("on_side_stream outside a CUDA graph capture")
        if self._side is None:
            self._side = self.drv.Stream()
        main, side = self.stream, self._side
        fork, done = self.event(), self.event()
        self._capture_keep += [fork, done]
        fork.record(main)
        side.wait_for_event(fork)
        self.stream = side
        try:
            value = fn()
        except BaseException:
            self.stream = main
            done.record(side)
            main.wait_for_event(done)
            raise
        finally:
            self.stream = main
        done.record(side)

        def join():
            if join in self._unjoined:
                self._unjoined.remove(join)
                main.wait_for_event(done)
            return value
        self._unjoined.append(join)
        return join

    def _join_branches(self) -> None:
        """Join every branch of this capture its caller left open (on_side_stream)."""
        while self._unjoined:
            self._unjoined[0]()

    def abort_capture(self) -> None:
        """Leave a capture that failed half-way (the stream returns to eager use; the partial graph is dropped)."""
        from coli.gpu.driver import DriverError, get_driver
        if self._capture_keep is None:
            return
        try:
            self._join_branches()          # an unjoined branch would keep the side stream in the dead capture
        except Exception:                  # noqa: BLE001 -- the capture is being dropped anyway
            self._unjoined.clear()
            self._side = None              # a fresh side stream for the next capture
        self._capture_keep = None
        d = get_driver()
        try:
            if d.is_capturing(int(self.stream.handle)):
                d.graph_destroy(d.end_capture(int(self.stream.handle)))
        except DriverError:
            pass   # an invalidated capture ends with an error and no graph: the stream is usable again

    # ---- memory -------------------------------------------------------------------------------------
    def alloc(self, nbytes: int):
        try:
            a = self.pool.allocate(max(int(nbytes), 16))
        except self.drv.Error as e:
            raise CudaError(f"device allocation of {nbytes} bytes failed: {e}") from None
        if self._capture_keep is not None:
            self._capture_keep.append(a)
        return a

    def empty(self, shape: Sequence[int], dtype: Any = np.float32) -> DeviceArray:
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        a = self.alloc(nbytes)
        return DeviceArray(int(a), shape, dtype, a)

    def to_device(self, host: np.ndarray, dtype: Any = None) -> DeviceArray:
        """Synchronous upload (load time): the host array can be reused at once."""
        self._not_capturing("a synchronous upload")
        h = np.ascontiguousarray(host, dtype=dtype or host.dtype)
        d = self.empty(h.shape, h.dtype)
        if h.nbytes:
            self.stream.synchronize()
            self.drv.memcpy_htod(d.ptr, h)
        return d

    def to_device_async(self, host: np.ndarray, dtype: Any = None) -> DeviceArray:
        """Upload through pinned staging, ordered on the compute stream (per-step tables, ids, masks)."""
        self._not_capturing("an upload through the staging ring")   # a replay would read a reused ring slot
        h = np.ascontiguousarray(host, dtype=dtype or host.dtype)
        d = self.empty(h.shape, h.dtype)
        self.staging.put(h, d.ptr, self.stream)
        return d

    def upload_bytes(self, raw: np.ndarray, dst: int) -> None:
        self._not_capturing("a synchronous upload")
        h = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
        if h.nbytes:
            self.stream.synchronize()
            self.drv.memcpy_htod(dst, h)

    def to_host(self, x: DeviceArray) -> np.ndarray:
        out = np.empty(x.shape, x.dtype)
        if out.nbytes:
            self.synchronize()
            self.drv.memcpy_dtoh(out, x.ptr)
        return out

    def zero(self, dst: int, nbytes: int) -> None:
        """Zero nbytes (a multiple of 4) at dst, ordered on the compute stream."""
        if nbytes:
            self.drv.memset_d32_async(int(dst), 0, int(nbytes) // 4, self.stream)

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        if nbytes:
            self.drv.memcpy_dtod_async(int(dst), int(src), int(nbytes), self.stream)

    def synchronize(self) -> None:
        self._not_capturing("a synchronisation (a read-back to the host)")
        try:
            self.stream.synchronize()
        except self.drv.Error as e:
            raise CudaError(f"a kernel or copy on the compute stream failed: {e} "
                            f"(run with COLI_CUDA_SYNC=1 to name it)") from None

    def event(self):
        return self.drv.Event()

    def _pop_context(self) -> None:
        try:
            self.stream.synchronize()
            self.pool.stop_holding()
            self.ctx.pop()
        except Exception:  # at interpreter exit there is nobody left to tell
            pass


class CudaGraph:
    """An instantiated CUDA graph (driver handle) and the device buffers its nodes use, kept as long as it is."""

    def __init__(self, exec_handle: int, keep: list, nodes: int, pdl_edges: int = 0, edges: int | None = None):
        self.exec = exec_handle
        self.keep = keep
        self.nodes = nodes
        self.pdl_edges = pdl_edges       # kernel->kernel edges made programmatic (COLI_PDL; 0: as captured)
        self.edges = edges               # every edge as captured, where COLI_PDL looked at them (else None)

    def launch(self, rt: CudaRuntime) -> None:
        from coli.gpu.driver import DriverError, get_driver
        if not self.exec:
            raise CudaError("launch of a destroyed CUDA graph")
        try:
            get_driver().graph_launch(self.exec, int(rt.stream.handle))
        except DriverError as e:
            raise CudaError(f"launching the decode step's CUDA graph failed: {e}") from None
        rt.launches += 1

    def close(self) -> None:
        """Destroy the graph (its queued replays finish first: the driver defers the release)."""
        if self.exec:
            from coli.gpu.driver import get_driver
            get_driver().graph_exec_destroy(self.exec)
            self.exec = 0
        self.keep = []


_runtimes: dict[int, CudaRuntime] = {}
_lock = threading.Lock()


def get_runtime(device: int = 0) -> CudaRuntime:
    with _lock:
        if device not in _runtimes:
            _runtimes[device] = CudaRuntime(device)
        return _runtimes[device]
