"""Weights on the device in their stored (container) format, and the device-record expert source.

A `QWeight` is one [rows, cols] matrix exactly as the container stores it -- tiles of whole rows, each
[fp16 scales | packed data] -- so the kernels dequantise int4/int8/bf16 in registers; nothing is widened to
f32 on the device. A weight source without raw tiles (a Hugging Face checkpoint) is uploaded as a one-tile
f32 matrix, which is the same layout with no metadata.

Routed experts reach the MoE op as `DeviceRecord` handles: the device address of a whole expert record
(gate, up, down at the RecordLayout's offsets), optionally an event the compute stream must wait for (a
copy lane still writing the slot) and a callback that receives an event recorded after the last kernel that
reads the record (when the slot may be recycled). `ResidentExperts` keeps every record resident (this part);
the VRAM slot pool of the next part yields the same handles for slots.

Importing this module needs no PyCUDA.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from coli.container.format import ALIGN, MatrixLayout, RecordLayout, align
from coli.gpu.cuda_runtime import CudaError, CudaRuntime
from coli.weights import ExpertWeights

FMT_CODE = {"f32": 0, "bf16": 1, "int8": 2, "int4": 3}
SUPPORTED = tuple(FMT_CODE)


def check_format(fmt: str, what: str) -> None:
    if fmt not in FMT_CODE:
        raise CudaError(f"{what}: format {fmt!r} is not supported by the CUDA backend (supported: "
                        f"{', '.join(SUPPORTED)}; re-convert with --experts/--dense int4|int8|bf16|f32)")


def check_record_formats(layout: RecordLayout) -> None:
    """Each matrix of an expert record in a format the CUDA kernels take (else check_format's error, naming it)."""
    for m, part in zip(layout.matrices, ("gate_proj", "up_proj", "down_proj")):
        check_format(m.fmt, f"routed experts ({part})")


def qmat_args(ptr: int, lay: MatrixLayout) -> tuple:
    """The six kernel arguments of a stored matrix (QMAT_PARAMS in coli_common.cuh): P i i i i q."""
    return (int(ptr), lay.rows, lay.cols, lay.group or 32, lay.rows_per_tile, lay.tile_bytes)


def vec_ok(lay: MatrixLayout) -> bool:
    """Rows start 16-byte aligned: the 16-byte-chunk GEMV kernels apply."""
    return lay.row_data_bytes % 16 == 0


@dataclass(eq=False)
class QWeight:
    """A stored matrix on the device. `layout.offset` is 0: tiles start at `ptr`."""

    ptr: int
    layout: MatrixLayout
    shape: tuple[int, ...]
    owner: Any = None

    @property
    def fmt(self) -> str:
        return self.layout.fmt

    @property
    def rows(self) -> int:
        return self.layout.rows

    @property
    def cols(self) -> int:
        return self.layout.cols

    def args(self) -> tuple:
        return qmat_args(self.ptr, self.layout)

    @property
    def vec_ok(self) -> bool:
        return vec_ok(self.layout)

    @property
    def nbytes(self) -> int:
        return self.layout.nbytes


@dataclass(eq=False)
class HeadView:
    """Per-head row blocks of one stored matrix: head h's rows are
    row_off + h * head_stride .. + rows_per_head (kv_b_proj's key or value rows)."""

    w: QWeight
    row_off: int
    head_stride: int
    rows_per_head: int
    heads: int

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.heads, self.rows_per_head, self.w.cols)


def f32_layout(rows: int, cols: int) -> MatrixLayout:
    """A plain row-major f32 matrix as a one-tile container matrix."""
    return MatrixLayout(rows, cols, "f32", 0, rows, 0)


def upload_stored(rt: CudaRuntime, raw: np.ndarray, lay: MatrixLayout, shape: tuple[int, ...], what: str) -> QWeight:
    check_format(lay.fmt, what)
    lay0 = dataclasses.replace(lay, offset=0)
    buf = rt.alloc(lay0.nbytes)
    rt.upload_bytes(raw[:lay0.nbytes], int(buf))
    return QWeight(int(buf), lay0, tuple(shape), buf)


def upload_f32(rt: CudaRuntime, w: np.ndarray) -> QWeight:
    w2 = np.ascontiguousarray(w, np.float32)
    if w2.ndim != 2:
        raise ValueError(f"a weight matrix must be 2-D, got shape {w2.shape}")
    lay = f32_layout(*w2.shape)
    buf = rt.alloc(lay.nbytes)
    rt.upload_bytes(w2, int(buf))
    return QWeight(int(buf), lay, tuple(w.shape), buf)


def upload_weight(rt: CudaRuntime, src: Any, name: str) -> QWeight:
    """Tensor `name` of a weight source as a stored matrix on the device (raw tiles from a container)."""
    if hasattr(src, "dense_layout") and hasattr(src, "dense_raw"):
        lay = src.dense_layout(name)
        shape = tuple(src.manifest.dense[name].shape) if hasattr(src, "manifest") else (lay.rows, lay.cols)
        return upload_stored(rt, src.dense_raw(name), lay, shape, f"tensor {name!r}")
    return upload_f32(rt, src.dense(name))


# ---- expert records ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DeviceRecord:
    """One routed expert's record in device memory (see the module docstring). Events are PyCUDA Events or
    raw driver handles (ints, coli.gpu.driver)."""

    ptr: int
    layout: RecordLayout
    ready: Any = None                                   # event before reading gate/up (a copy lane's), or None
    on_consumed: Callable[[Any], None] | None = None    # gets an event recorded after the last reader
    owner: Any = None
    ready_down: Any = None                              # event before reading down (None: `ready` covers it)
    fetch_host: Callable[[], ExpertWeights] | None = None  # the record's host copy, for a CPU fallback


@dataclass(frozen=True)
class HostExpert:
    """An expert the GPU could not take (oversize record, no slot, failed copy, stale source): the backend
    computes it on the CPU from these host matrices, at once (the memory may be recycled after)."""

    weights: ExpertWeights
    reason: str


# Yielded by an expert source between experts when its next expert will take a while (a disk read): the
# backend launches what it holds now, so VRAM hits compute while the misses are still on their way.
FLUSH = None


def host_record_layout(hidden: int, inter: int) -> RecordLayout:
    """The record layout used for experts that arrive as host float32 matrices: one f32 tile per matrix."""
    gate = dataclasses.replace(f32_layout(inter, hidden), offset=0)
    up = dataclasses.replace(f32_layout(inter, hidden), offset=align(gate.end))
    down = dataclasses.replace(f32_layout(hidden, inter), offset=align(up.end))
    return RecordLayout(gate, up, down)


def pack_host_record(ew: ExpertWeights, layout: RecordLayout) -> np.ndarray:
    buf = np.zeros(layout.nbytes, np.uint8)
    for m, w in zip(layout.matrices, (ew.gate, ew.up, ew.down)):
        a = np.ascontiguousarray(w, np.float32)
        if a.shape != (m.rows, m.cols):
            raise ValueError(f"expert matrix of shape {a.shape}, the layout needs {(m.rows, m.cols)}")
        buf[m.offset:m.offset + a.nbytes] = a.reshape(-1).view(np.uint8)
    return buf


def upload_host_expert(rt: CudaRuntime, ew: ExpertWeights) -> DeviceRecord:
    """A host float32 expert (e.g. from the RAM tier) copied into a fresh device record (synchronous copy:
    the host memory may be recycled as soon as this returns)."""
    H, Im = ew.down.shape
    lay = host_record_layout(H, Im)
    buf = rt.alloc(lay.nbytes)
    rt.upload_bytes(pack_host_record(ew, lay), int(buf))
    return DeviceRecord(int(buf), lay, owner=buf)


class UploadedExperts:
    """ExpertSource that uploads each record it is asked for from the container, when asked (the MTP layer's
    experts where the VRAM budget keeps them out of the device: coli.gpu.setup.plan_mtp). The copy is synchronous
    into memory from the backend's pool, which the record's owner holds until its kernels are queued; the pool hands
    it out again only behind them (one compute stream)."""

    def __init__(self, rt: CudaRuntime, weights: Any):
        if not (hasattr(weights, "read_record") and hasattr(weights, "record_layout")):
            raise TypeError("UploadedExperts reads a container's expert records")
        self.rt, self.weights = rt, weights
        self.batch = int(weights.config.num_experts_per_tok)  # records live at once: the room plan_mtp reserves
        self.layout: RecordLayout = weights.record_layout
        check_record_formats(self.layout)
        self.uploaded = 0                                    # records copied so far (stats, tests)

    def stream(self, layer: int, ids: list[int]) -> Iterator[Any]:
        """(e, DeviceRecord) per expert, and a FLUSH after every `batch` of them: the backend launches what it holds
        and lets those records go, so at most `batch` uploads are live at once (a catch-up step over a whole prompt
        routes to nearly every expert: without the FLUSH all 256 would be held, 4.9 GB for GLM-5 int4)."""
        for j, e in enumerate(ids):
            if j and j % self.batch == 0:
                yield FLUSH
            d = self.rt.to_device(self.weights.read_record(layer, e))     # checksum-verified bytes
            self.uploaded += 1
            yield e, DeviceRecord(d.ptr, self.layout, owner=d)


class ResidentExperts:
    """ExpertSource with every routed expert of every MoE layer resident on the device, in the container's
    record format (or f32 records for a checkpoint source). One allocation per layer, records back to back
    at `stride` bytes; `stream()` yields DeviceRecord handles in the order asked for."""

    def __init__(self, rt: CudaRuntime, weights: Any, layers: Iterable[int] | None = None):
        c = weights.config
        self.rt = rt
        self.E = c.n_routed_experts
        layers = list(c.moe_layers if layers is None else layers)
        container = hasattr(weights, "read_record") and hasattr(weights, "record_layout")
        if container:
            self.layout: RecordLayout = weights.record_layout
            check_record_formats(self.layout)
        else:
            self.layout = host_record_layout(c.hidden_size, c.moe_intermediate_size)
        self.stride = align(self.layout.nbytes, ALIGN)
        self._alloc: dict[int, Any] = {}
        host = np.zeros(self.stride, np.uint8)
        for layer in layers:
            buf = rt.alloc(self.stride * self.E)
            self._alloc[layer] = buf
            for e in range(self.E):
                if container:
                    rec = weights.read_record(layer, e)           # checksum-verified
                    host[:rec.nbytes] = rec
                    host[rec.nbytes:] = 0
                else:
                    host[:self.layout.nbytes] = pack_host_record(weights.experts(layer, [e])[e], self.layout)
                rt.upload_bytes(host, int(buf) + e * self.stride)

    @property
    def nbytes(self) -> int:
        return self.stride * self.E * len(self._alloc)

    def slot_table(self, n_layers: int) -> np.ndarray:
        """[n_layers, E] uint64 record addresses, 0 on layers not held (coli.gpu.graphs: a replayed step's table)."""
        from coli.gpu.graphs import build_slot_table
        return build_slot_table(n_layers, self.E, sorted(self._alloc),
                                lambda layer, e: int(self._alloc[layer]) + e * self.stride)

    def record(self, layer: int, e: int) -> DeviceRecord:
        if layer not in self._alloc or not 0 <= e < self.E:
            raise KeyError(f"no resident record for layer {layer} expert {e}")
        return DeviceRecord(int(self._alloc[layer]) + e * self.stride, self.layout)

    def stream(self, layer: int, ids: list[int]) -> Iterator[tuple[int, DeviceRecord]]:
        for e in ids:
            yield e, self.record(layer, e)
