"""A strict, memory-mapped safetensors reader.

We parse the format ourselves (8-byte little-endian header length, JSON header, raw data) rather
than go through `safetensors.numpy` because numpy has no bfloat16 or float8 dtype: tensors come back
as raw views and are widened to float32 on request. Every damage we can detect (absurd header
length, offsets outside the file, overlapping or mis-sized tensors, unknown dtypes) is an error that
names the file and the tensor. Nothing is read until a tensor is asked for.
"""

from __future__ import annotations

import json
import mmap
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from coli.errors import WeightError

MAX_HEADER_BYTES = 100 * 1024 * 1024  # the format's own limit

# safetensors dtype -> (numpy storage dtype, bytes per element)
_STORAGE = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2"),
    "F8_E4M3": np.dtype("u1"), "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"), "U8": np.dtype("u1"), "BOOL": np.dtype("u1"),
}
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16", "F8_E4M3")


def bf16_to_f32(raw_u16: np.ndarray) -> np.ndarray:
    """bfloat16 bits (uint16) -> float32: bf16 is the top half of an fp32 word, so this is exact."""
    return (raw_u16.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits with round-to-nearest-even (what torch does); NaN stays NaN."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        rounded[nan] = 0x7FC0
    return rounded


def _e4m3_table() -> np.ndarray:
    """All 256 float8_e4m3fn values (bias 7, no infinities, 0x7F/0xFF are NaN)."""
    v = np.arange(256, dtype=np.uint32)
    sign = np.where(v & 0x80, -1.0, 1.0)
    exp = (v >> 3) & 0xF
    man = (v & 0x7).astype(np.float64)
    val = np.where(exp == 0, man / 8.0 * 2.0 ** -6, (1.0 + man / 8.0) * 2.0 ** (exp.astype(np.float64) - 7))
    val = sign * val
    val[(v & 0x7F) == 0x7F] = np.nan
    return val.astype(np.float32)


E4M3_TABLE = _e4m3_table()


def to_float32(raw: np.ndarray, dtype: str) -> np.ndarray:
    """Widen a raw tensor view of safetensors dtype `dtype` to float32. F32 comes back as the same
    read-only view (zero-copy: an mmap'd checkpoint is not duplicated in RAM); others are new arrays."""
    if dtype == "F32":
        return raw
    if dtype == "BF16":
        return bf16_to_f32(raw)
    if dtype == "F8_E4M3":
        return E4M3_TABLE[raw]
    if dtype in ("F16", "F64"):
        return raw.astype(np.float32)
    raise WeightError(f"dtype {dtype} is not a floating-point weight type")


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


class SafetensorsFile:
    """One .safetensors file, validated at open, tensors served as zero-copy views of an mmap."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError as e:
            raise WeightError(f"{self.path}: cannot open: {e.strerror}") from None
        try:
            size = os.fstat(fd).st_size
            if size < 8:
                raise WeightError(f"{self.path}: truncated ({size} bytes; a safetensors file starts with an 8-byte header length)")
            n = int.from_bytes(os.pread(fd, 8, 0), "little")
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise WeightError(f"{self.path}: corrupt header length {n} (file is {size} bytes)")
            try:
                header = json.loads(os.pread(fd, n, 8))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise WeightError(f"{self.path}: corrupt header JSON: {e}") from None
            if not isinstance(header, dict):
                raise WeightError(f"{self.path}: header is not a JSON object")
            self.metadata = header.pop("__metadata__", None) or {}
            data_start = 8 + n
            self.tensors: dict[str, TensorInfo] = {}
            for name, meta in header.items():
                self.tensors[name] = self._parse_entry(name, meta, data_start, size)
            self._check_overlaps()
            self._mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ) if size else None
            self.size = size
        finally:
            os.close(fd)

    def _parse_entry(self, name: str, meta: object, data_start: int, size: int) -> TensorInfo:
        where = f"{self.path}: tensor {name!r}"
        if not isinstance(meta, dict) or not {"dtype", "shape", "data_offsets"} <= set(meta):
            raise WeightError(f"{where}: header entry lacks dtype/shape/data_offsets")
        dtype, shape, offs = meta["dtype"], meta["shape"], meta["data_offsets"]
        if dtype not in _STORAGE:
            raise WeightError(f"{where}: unsupported dtype {dtype!r} (supported: {', '.join(_STORAGE)})")
        if not (isinstance(shape, list) and all(isinstance(s, int) and s >= 0 for s in shape)):
            raise WeightError(f"{where}: bad shape {shape!r}")
        if not (isinstance(offs, list) and len(offs) == 2 and all(isinstance(o, int) for o in offs)):
            raise WeightError(f"{where}: bad data_offsets {offs!r}")
        begin, end = data_start + offs[0], data_start + offs[1]
        if not (data_start <= begin <= end <= size):
            raise WeightError(f"{where}: data_offsets {offs} lie outside the file ({size} bytes; truncated shard?)")
        want = int(np.prod(shape, dtype=np.int64)) * _STORAGE[dtype].itemsize
        if end - begin != want:
            raise WeightError(f"{where}: {end - begin} bytes stored for shape {shape} {dtype} (needs {want})")
        return TensorInfo(name, dtype, tuple(shape), begin, end)

    def _check_overlaps(self) -> None:
        spans = sorted((t.start, t.end, t.name) for t in self.tensors.values() if t.end > t.start)
        for (s0, e0, n0), (s1, e1, n1) in zip(spans, spans[1:]):
            if s1 < e0:
                raise WeightError(f"{self.path}: tensors {n0!r} and {n1!r} overlap in the file")

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def keys(self) -> list[str]:
        return list(self.tensors)

    def raw(self, name: str) -> np.ndarray:
        """Zero-copy read-only view in the stored dtype (bf16 as uint16, fp8 as uint8)."""
        t = self.tensors[name]
        if t.nbytes == 0:
            return np.zeros(t.shape, _STORAGE[t.dtype])
        return np.frombuffer(self._mm, dtype=_STORAGE[t.dtype], count=t.nbytes // _STORAGE[t.dtype].itemsize,
                             offset=t.start).reshape(t.shape)

    def float32(self, name: str) -> np.ndarray:
        t = self.tensors[name]
        if t.dtype not in FLOAT_DTYPES:
            raise WeightError(f"{self.path}: tensor {name!r} has dtype {t.dtype}, expected a float type")
        return to_float32(self.raw(name), t.dtype)

    def close(self) -> None:
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:
                # Views handed out are still alive; the mapping is released when they are collected.
                pass
            self._mm = None


def write_safetensors(path: str | Path, tensors: dict[str, tuple[str, np.ndarray]], metadata: dict | None = None) -> None:
    """Write {name: (dtype, raw array in that dtype's storage)} as a safetensors file (used by tests and
    fixture scripts). Arrays are written in insertion order, each contiguous, little-endian."""
    header: dict[str, object] = {}
    off = 0
    blobs = []
    for name, (dtype, arr) in tensors.items():
        arr = np.ascontiguousarray(arr, dtype=_STORAGE[dtype])
        header[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [off, off + arr.nbytes]}
        off += arr.nbytes
        blobs.append(arr)
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    with open(path, "wb") as f:
        f.write(len(hb).to_bytes(8, "little"))
        f.write(hb)
        for a in blobs:
            f.write(a.tobytes())
