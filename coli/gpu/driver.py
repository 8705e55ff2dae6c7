"""The few CUDA driver calls the copy lanes need, through ctypes on libcuda.

Why not PyCUDA for these: `register_host_memory` refuses memory it did not allocate in the way shared
memory is mapped (the RAM tier's /dev/shm arena), and the lane workers run in their own threads, where a
raw driver call (which releases the GIL for its duration, being a ctypes call) is both cheaper and
simpler to reason about than PyCUDA's context stack. Every call is checked: a failing one raises
`DriverError` with the driver's name and text of the error code.

Handles (streams, events, contexts) are plain ints. PyCUDA objects interoperate through their `.handle`.
Importing this module needs nothing; `Driver()` loads libcuda.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

from coli.errors import ColiError

CUDA_SUCCESS = 0
CUDA_ERROR_NOT_READY = 600
CU_STREAM_NON_BLOCKING = 0x1
CU_EVENT_DEFAULT = 0x0
CU_EVENT_DISABLE_TIMING = 0x2
CU_MEMHOSTREGISTER_PORTABLE = 0x1
CU_MEMHOSTREGISTER_DEVICEMAP = 0x2   # kernels may read the pages over PCIe (coli/gpu/mapped_experts.py)
CU_STREAM_CAPTURE_MODE_RELAXED = 2   # other threads (the copy lanes) may call the driver during a capture
CU_STREAM_CAPTURE_STATUS_NONE = 0
# Errors after which the context is unusable (sticky): the run must leave the GPU (coli demotes to the CPU).
FATAL_CODES = {
    700,  # CUDA_ERROR_ILLEGAL_ADDRESS
    701,  # CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES is not sticky, but 702+ are
    702,  # CUDA_ERROR_LAUNCH_TIMEOUT
    714, 715, 716, 717, 718, 719,  # hardware stack error, illegal instruction, misaligned, invalid pc, launch failed
    999,  # CUDA_ERROR_UNKNOWN
    46,   # CUDA_ERROR_DEVICES_UNAVAILABLE
    201,  # CUDA_ERROR_INVALID_CONTEXT (the context was destroyed)
}
FATAL_CODES.discard(701)
# Graph edges and node types (cuda.h, CUDA >= 12.3), for the programmatic edges of coli/gpu/pdl.py;
# tests/test_graphs.py checks these against the header.
CU_GRAPH_NODE_TYPE_KERNEL = 0
CU_GRAPH_DEPENDENCY_TYPE_DEFAULT = 0
CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC = 1
CU_GRAPH_KERNEL_NODE_PORT_DEFAULT = 0
CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC = 1


class CUgraphEdgeData(ctypes.Structure):
    """cuda.h's CUgraphEdgeData: 8 bytes, all unsigned char (zeroed: an ordinary full dependency)."""
    _fields_ = [("from_port", ctypes.c_ubyte), ("to_port", ctypes.c_ubyte), ("type", ctypes.c_ubyte),
                ("reserved", ctypes.c_ubyte * 5)]


# Calls a driver older than CUDA 12.3 lacks: bound when present (Driver.missing lists the absent ones); only
# COLI_PDL uses them, and it falls back to the graph as captured without them.
OPTIONAL = frozenset({"cuGraphGetEdges_v2", "cuGraphNodeGetType", "cuGraphRemoveDependencies_v2",
                      "cuGraphAddDependencies_v2"})


def signatures() -> dict[str, list]:
    """The libcuda functions bound here and their ctypes argument types (all return CUresult). Checked against
    cuda.h's prototypes by tests/test_graphs.py (no GPU needed)."""
    P, S, U, I = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint, ctypes.c_int
    sig = {
        "cuGetErrorName": [I, ctypes.POINTER(ctypes.c_char_p)],
        "cuGetErrorString": [I, ctypes.POINTER(ctypes.c_char_p)],
        "cuMemHostRegister_v2": [P, S, U],
        "cuMemHostUnregister": [P],
        "cuMemHostGetDevicePointer_v2": [ctypes.POINTER(ctypes.c_uint64), P, U],
        "cuMemcpyHtoDAsync_v2": [ctypes.c_uint64, P, S, P],
        "cuMemcpyDtoHAsync_v2": [P, ctypes.c_uint64, S, P],
        "cuStreamCreate": [ctypes.POINTER(P), U],
        "cuStreamDestroy_v2": [P],
        "cuStreamQuery": [P],
        "cuStreamSynchronize": [P],
        "cuStreamWaitEvent": [P, P, U],
        "cuEventCreate": [ctypes.POINTER(P), U],
        "cuEventDestroy_v2": [P],
        "cuEventRecord": [P, P],
        "cuEventQuery": [P],
        "cuEventSynchronize": [P],
        "cuEventElapsedTime": [ctypes.POINTER(ctypes.c_float), P, P],
        "cuCtxGetCurrent": [ctypes.POINTER(P)],
        "cuCtxSetCurrent": [P],
        # CUDA graphs (coli/gpu/graphs.py; the PyCUDA wheel exposes no stream capture)
        "cuStreamBeginCapture_v2": [P, I],
        "cuStreamEndCapture": [P, ctypes.POINTER(P)],
        "cuStreamIsCapturing": [P, ctypes.POINTER(I)],
        "cuGraphInstantiateWithFlags": [ctypes.POINTER(P), P, ctypes.c_ulonglong],
        "cuGraphLaunch": [P, P],
        "cuGraphExecDestroy": [P],
        "cuGraphDestroy": [P],
        "cuGraphGetNodes": [P, ctypes.POINTER(P), ctypes.POINTER(S)],
        # programmatic edges (OPTIONAL: CUDA >= 12.3)
        "cuGraphGetEdges_v2": [P, ctypes.POINTER(P), ctypes.POINTER(P), ctypes.POINTER(CUgraphEdgeData),
                               ctypes.POINTER(S)],
        "cuGraphNodeGetType": [P, ctypes.POINTER(I)],
        "cuGraphRemoveDependencies_v2": [P, ctypes.POINTER(P), ctypes.POINTER(P), ctypes.POINTER(CUgraphEdgeData), S],
        "cuGraphAddDependencies_v2": [P, ctypes.POINTER(P), ctypes.POINTER(P), ctypes.POINTER(CUgraphEdgeData), S],
    }
    return sig


class DriverError(ColiError):
    """A CUDA driver call failed; `code` is the CUresult, `fatal` says whether the context is lost."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code
        self.fatal = code in FATAL_CODES


class Driver:
    """libcuda through ctypes (one per process: `get_driver()`)."""

    def __init__(self) -> None:
        try:
            self.lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise ColiError(f"libcuda.so.1 cannot be loaded ({e}): no CUDA driver on this machine") from None
        L = self.lib
        self.signatures = signatures()
        self.missing: set[str] = set()          # OPTIONAL calls this driver does not export
        for name, args in self.signatures.items():
            if name in OPTIONAL and not hasattr(L, name):
                self.missing.add(name)
                continue
            fn = getattr(L, name)
            fn.argtypes = args
            fn.restype = ctypes.c_int

    def _err(self, code: int, what: str) -> DriverError:
        name, text = ctypes.c_char_p(), ctypes.c_char_p()
        self.lib.cuGetErrorName(code, ctypes.byref(name))
        self.lib.cuGetErrorString(code, ctypes.byref(text))
        n = name.value.decode() if name.value else f"CUresult {code}"
        t = text.value.decode() if text.value else "unknown error"
        return DriverError(f"{what}: {n} ({t})", code)

    def check(self, code: int, what: str) -> None:
        if code != CUDA_SUCCESS:
            raise self._err(code, what)

    # ---- host memory -------------------------------------------------------------------------------
    def host_register(self, addr: int, nbytes: int, device_map: bool = False) -> None:
        """Pin [addr, addr + nbytes) for DMA copies; device_map: also map it into the device's address space, so
        kernels can read it (host_device_pointer)."""
        flags = CU_MEMHOSTREGISTER_PORTABLE | (CU_MEMHOSTREGISTER_DEVICEMAP if device_map else 0)
        self.check(self.lib.cuMemHostRegister_v2(ctypes.c_void_p(addr), nbytes, flags),
                   f"cuMemHostRegister of {nbytes} bytes at 0x{addr:x}")

    def host_device_pointer(self, addr: int) -> int:
        """The device address of host memory registered with device_map=True."""
        d = ctypes.c_uint64()
        self.check(self.lib.cuMemHostGetDevicePointer_v2(ctypes.byref(d), ctypes.c_void_p(addr), 0),
                   f"cuMemHostGetDevicePointer at 0x{addr:x}")
        return int(d.value)

    def host_unregister(self, addr: int) -> None:
        self.check(self.lib.cuMemHostUnregister(ctypes.c_void_p(addr)), f"cuMemHostUnregister at 0x{addr:x}")

    # ---- copies ---------------------------------------------------------------------------------------
    def copy_htod_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self.check(self.lib.cuMemcpyHtoDAsync_v2(dst, ctypes.c_void_p(src), nbytes, ctypes.c_void_p(stream)),
                   f"H2D copy of {nbytes} bytes to 0x{dst:x}")

    def copy_dtoh_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self.check(self.lib.cuMemcpyDtoHAsync_v2(ctypes.c_void_p(dst), src, nbytes, ctypes.c_void_p(stream)),
                   f"D2H copy of {nbytes} bytes from 0x{src:x}")

    # ---- streams and events ------------------------------------------------------------------------------
    def stream_create(self) -> int:
        s = ctypes.c_void_p()
        self.check(self.lib.cuStreamCreate(ctypes.byref(s), CU_STREAM_NON_BLOCKING), "cuStreamCreate")
        return int(s.value or 0)

    def stream_destroy(self, s: int) -> None:
        self.lib.cuStreamDestroy_v2(ctypes.c_void_p(s))

    def stream_idle(self, s: int) -> bool:
        code = self.lib.cuStreamQuery(ctypes.c_void_p(s))
        if code == CUDA_ERROR_NOT_READY:
            return False
        self.check(code, "cuStreamQuery")
        return True

    def stream_sync(self, s: int) -> None:
        self.check(self.lib.cuStreamSynchronize(ctypes.c_void_p(s)), "cuStreamSynchronize")

    def stream_wait(self, s: int, ev: int) -> None:
        self.check(self.lib.cuStreamWaitEvent(ctypes.c_void_p(s), ctypes.c_void_p(ev), 0), "cuStreamWaitEvent")

    def event_create(self, timing: bool = True) -> int:
        e = ctypes.c_void_p()
        flags = CU_EVENT_DEFAULT if timing else CU_EVENT_DISABLE_TIMING
        self.check(self.lib.cuEventCreate(ctypes.byref(e), flags), "cuEventCreate")
        return int(e.value or 0)

    def event_destroy(self, ev: int) -> None:
        self.lib.cuEventDestroy_v2(ctypes.c_void_p(ev))

    def event_record(self, ev: int, stream: int) -> None:
        self.check(self.lib.cuEventRecord(ctypes.c_void_p(ev), ctypes.c_void_p(stream)), "cuEventRecord")

    def event_done(self, ev: int) -> bool:
        code = self.lib.cuEventQuery(ctypes.c_void_p(ev))
        if code == CUDA_ERROR_NOT_READY:
            return False
        self.check(code, "cuEventQuery")
        return True

    def event_sync(self, ev: int) -> None:
        self.check(self.lib.cuEventSynchronize(ctypes.c_void_p(ev)), "cuEventSynchronize")

    def elapsed_ms(self, start: int, end: int) -> float:
        ms = ctypes.c_float()
        self.check(self.lib.cuEventElapsedTime(ctypes.byref(ms), ctypes.c_void_p(start), ctypes.c_void_p(end)),
                   "cuEventElapsedTime")
        return float(ms.value)

    # ---- graphs ------------------------------------------------------------------------------------------
    def begin_capture(self, s: int) -> None:
        """Start capturing stream s into a graph (relaxed mode: the lane threads keep calling the driver)."""
        self.check(self.lib.cuStreamBeginCapture_v2(ctypes.c_void_p(s), CU_STREAM_CAPTURE_MODE_RELAXED),
                   "cuStreamBeginCapture")

    def end_capture(self, s: int) -> int:
        """End the capture on stream s -> the captured graph's handle (raises if the capture was invalidated)."""
        g = ctypes.c_void_p()
        self.check(self.lib.cuStreamEndCapture(ctypes.c_void_p(s), ctypes.byref(g)), "cuStreamEndCapture")
        return int(g.value or 0)

    def is_capturing(self, s: int) -> bool:
        st = ctypes.c_int()
        self.check(self.lib.cuStreamIsCapturing(ctypes.c_void_p(s), ctypes.byref(st)), "cuStreamIsCapturing")
        return st.value != CU_STREAM_CAPTURE_STATUS_NONE

    def graph_instantiate(self, g: int) -> int:
        ex = ctypes.c_void_p()
        self.check(self.lib.cuGraphInstantiateWithFlags(ctypes.byref(ex), ctypes.c_void_p(g), 0),
                   "cuGraphInstantiateWithFlags")
        return int(ex.value or 0)

    def graph_nodes(self, g: int) -> int:
        n = ctypes.c_size_t(0)
        self.check(self.lib.cuGraphGetNodes(ctypes.c_void_p(g), None, ctypes.byref(n)), "cuGraphGetNodes")
        return int(n.value)

    def graph_edges(self, g: int) -> list[tuple[int, int, tuple[int, int, int]]]:
        """Every edge of graph g: (from node, to node, (from_port, to_port, type)) as cuGraphGetEdges_v2 lists them."""
        n = ctypes.c_size_t(0)
        self.check(self.lib.cuGraphGetEdges_v2(ctypes.c_void_p(g), None, None, None, ctypes.byref(n)),
                   "cuGraphGetEdges")
        if n.value == 0:
            return []
        frm, to, data = (ctypes.c_void_p * n.value)(), (ctypes.c_void_p * n.value)(), (CUgraphEdgeData * n.value)()
        self.check(self.lib.cuGraphGetEdges_v2(ctypes.c_void_p(g), frm, to, data, ctypes.byref(n)), "cuGraphGetEdges")
        return [(int(frm[i] or 0), int(to[i] or 0), (data[i].from_port, data[i].to_port, data[i].type))
                for i in range(n.value)]

    def node_type(self, node: int) -> int:
        t = ctypes.c_int()
        self.check(self.lib.cuGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(t)), "cuGraphNodeGetType")
        return int(t.value)

    @staticmethod
    def _edge_args(frm: int, to: int, data: tuple[int, int, int]):
        d = CUgraphEdgeData()
        d.from_port, d.to_port, d.type = data
        return (ctypes.byref(ctypes.c_void_p(frm)), ctypes.byref(ctypes.c_void_p(to)), ctypes.byref(d))

    def graph_remove_edge(self, g: int, frm: int, to: int, data: tuple[int, int, int]) -> None:
        f, t, d = self._edge_args(frm, to, data)
        self.check(self.lib.cuGraphRemoveDependencies_v2(ctypes.c_void_p(g), f, t, d, 1), "cuGraphRemoveDependencies")

    def graph_add_edge(self, g: int, frm: int, to: int, data: tuple[int, int, int]) -> None:
        f, t, d = self._edge_args(frm, to, data)
        self.check(self.lib.cuGraphAddDependencies_v2(ctypes.c_void_p(g), f, t, d, 1), "cuGraphAddDependencies")

    def graph_launch(self, ex: int, s: int) -> None:
        self.check(self.lib.cuGraphLaunch(ctypes.c_void_p(ex), ctypes.c_void_p(s)), "cuGraphLaunch")

    def graph_exec_destroy(self, ex: int) -> None:
        self.lib.cuGraphExecDestroy(ctypes.c_void_p(ex))

    def graph_destroy(self, g: int) -> None:
        self.lib.cuGraphDestroy(ctypes.c_void_p(g))

    # ---- contexts ------------------------------------------------------------------------------------------
    def current_context(self) -> int:
        c = ctypes.c_void_p()
        self.check(self.lib.cuCtxGetCurrent(ctypes.byref(c)), "cuCtxGetCurrent")
        return int(c.value or 0)

    def set_context(self, ctx: int) -> None:
        self.check(self.lib.cuCtxSetCurrent(ctypes.c_void_p(ctx)), "cuCtxSetCurrent")


class EventPool:
    """Recycled CUDA events (creating one costs a driver call; a decode step uses dozens)."""

    def __init__(self, drv: Driver, timing: bool = True):
        self.drv, self.timing = drv, timing
        self._free: list[int] = []
        self._lock = threading.Lock()

    def get(self) -> int:
        with self._lock:
            if self._free:
                return self._free.pop()
        return self.drv.event_create(self.timing)

    def put(self, ev: int) -> None:
        with self._lock:
            self._free.append(ev)


_driver: Driver | None = None
_lock = threading.Lock()


def get_driver() -> Driver:
    global _driver
    with _lock:
        if _driver is None:
            _driver = Driver()
        return _driver


def handle_of(obj: Any) -> int:
    """The raw handle of a PyCUDA Stream/Event/Context (or an int already)."""
    return int(obj) if isinstance(obj, int) else int(obj.handle)
