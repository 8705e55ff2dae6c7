"""Read a ColiStream container: the WeightSource interface plus raw record access for the runtime.

    r = ContainerReader(dir)                  # checks manifest, config, file sizes/headers, index checksum
    r.config                                  # ModelConfig (from the copied config.json)
    r.mtp_layer                               # the MTP layer's index (num_hidden_layers) if it was kept, else None
    r.dense(name) -> float32 ndarray          # dequantised on first use, checksum-verified then, cached
    r.experts(layer, ids) -> {id: ExpertWeights}   # each record read with pread and checksum-verified
    r.record_location(layer, e) -> RecordLocation(path, offset, length, xxh64)
    r.record_layout                           # RecordLayout: where gate/up/down and their tiles sit in a record
    decode_expert_record(buf, layout) -> ExpertWeights   # from raw bytes (e.g. a shared-memory slot)

What is verified, and when: opening checks the manifest, file sizes, data file headers and the index checksum
(not the data). `read_record`/`experts` verify each record's xxh64 on every read; `dense` verifies a tensor's
extent the first time it is decoded. `decode_expert_record` and `decode_matrix` do **not** verify: a caller that
reads records itself (the runtime's O_DIRECT reader stage) must call `verify_record(buf, location.xxh64)` on the
bytes it read before decoding or uploading them. `coli verify` checks everything.
"""

from __future__ import annotations

import mmap
import os
import threading
from pathlib import Path
from typing import Callable, Iterable, NamedTuple

import numpy as np
import xxhash

from coli.config import ModelConfig, load_config
from coli.container.format import (
    EXPERT_PARTS, FILE_HEADER_BYTES, INDEX_NAME, KIND_DENSE, KIND_EXPERTS, MANIFEST_NAME, ContainerError,
    Manifest, MatrixLayout, RecordLayout, check_file_header, parse_index, parse_manifest,
)
from coli.container.quant import decode_matrix
from coli.errors import ConfigError
from coli.model.tensors import dense_shapes, layer_of, mtp_dense_shapes, mtp_layer
from coli.weights import ExpertWeights


class RecordLocation(NamedTuple):
    path: str       # absolute path of the expert file
    offset: int     # byte offset of the record (4 KiB-aligned)
    length: int     # bytes to read (4 KiB multiple); the xxh64 covers exactly these bytes
    xxh64: int


def record_checksum(buf) -> int:
    return xxhash.xxh64(memoryview(buf).cast("B")).intdigest()


def verify_record(buf, expected: int, where: str = "record") -> None:
    got = record_checksum(buf)
    if got != expected:
        raise ContainerError(f"{where}: checksum mismatch (xxh64 {got:016x}, the index says {expected:016x}); "
                             f"the container is damaged (run coli verify)")


def decode_expert_part(buf: np.ndarray, layout: RecordLayout, part: str) -> np.ndarray:
    """One matrix ('gate_proj' | 'up_proj' | 'down_proj') of a record, float32."""
    lay = dict(zip(EXPERT_PARTS, layout.matrices))[part]
    return decode_matrix(buf[lay.offset:lay.end], lay)


def decode_expert_record(buf: np.ndarray, layout: RecordLayout) -> ExpertWeights:
    """Dequantise one expert record from its raw bytes (uint8, at least layout.payload_bytes long, starting at
    the record start). Works on any buffer, e.g. a numpy view of a shared-memory slot; does not verify."""
    buf = np.frombuffer(buf, np.uint8) if not isinstance(buf, np.ndarray) else buf.reshape(-1).view(np.uint8)
    if buf.shape[0] < layout.payload_bytes:
        raise ContainerError(f"expert record buffer holds {buf.shape[0]} bytes, the layout needs {layout.payload_bytes}")
    g, u, d = (decode_matrix(buf[m.offset:m.end], m) for m in layout.matrices)
    return ExpertWeights(g, u, d)


class ContainerReader:
    """A complete container directory, opened read-only. Implements coli.weights.WeightSource."""

    def __init__(self, model_dir: str | Path, cache_dense: bool = True, check_copied: bool = True):
        """`check_copied` False skips the checksums of the copied files (config.json, tokenizer, ...), for
        `coli verify`, which checks them itself and lists every bad one."""
        self.dir = Path(model_dir)
        self.manifest: Manifest = parse_manifest(self.dir / MANIFEST_NAME)
        m = self.manifest
        if check_copied:
            self._check_copied()
        try:
            self.config: ModelConfig = load_config(self.dir)
        except ConfigError as e:
            raise ContainerError(str(e)) from None
        c = self.config
        mp = self.dir / MANIFEST_NAME
        # the manifest must describe exactly the tensors this config needs, plus the whole MTP layer or none of it
        want = dict(dense_shapes(c))
        L = mtp_layer(c)
        self.mtp_layer: int | None = L if any(layer_of(n) == L for n in m.dense) else None
        if self.mtp_layer is not None:
            want.update(mtp_dense_shapes(c))
        if set(want) != set(m.dense):
            missing = sorted(set(want) - set(m.dense))
            extra = sorted(set(m.dense) - set(want))
            raise ContainerError(f"{mp}: field 'dense.tensors' does not match config.json "
                                 f"(missing {missing[:3]}, unexpected {extra[:3]})")
        for name, shape in want.items():
            if m.dense[name].shape != tuple(shape):
                raise ContainerError(f"{mp}: dense.tensors[{name!r}] has shape {list(m.dense[name].shape)}, "
                                     f"config.json needs {list(shape)}")
        H, Im = c.hidden_size, c.moe_intermediate_size
        r = m.record
        if (r.gate.rows, r.gate.cols, r.up.rows, r.up.cols, r.down.rows, r.down.cols) != (Im, H, Im, H, H, Im):
            raise ContainerError(f"{mp}: field 'experts.record' describes other expert shapes than config.json")
        self.record_layout: RecordLayout = r
        # files: sizes and headers
        self._check_file(m.dense_file.name, m.dense_file.size, KIND_DENSE, 0)
        self.expert_paths = [self.dir / f.name for f in m.expert_files]
        # record_location runs once per read: resolve (syscalls) here, once
        self._resolved_paths = [str(p.resolve()) for p in self.expert_paths]
        for i, f in enumerate(m.expert_files):
            self._check_file(f.name, f.size, KIND_EXPERTS, i)
        for f in m.copied:
            p = self.dir / f.name
            if not p.is_file() or p.stat().st_size != f.size:
                raise ContainerError(f"{p}: missing or not {f.size} bytes as the manifest's field 'copied' says")
        for name, e in m.dense.items():
            if e.layout.offset + e.length > m.dense_file.size:
                raise ContainerError(f"{mp}: dense.tensors[{name!r}] extends past the end of {m.dense_file.name}")
        # index
        ip = self.dir / INDEX_NAME
        try:
            raw = ip.read_bytes()
        except OSError as e:
            raise ContainerError(f"{ip}: cannot read: {e.strerror}") from None
        if len(raw) != m.index_file.size or xxhash.xxh64(raw).intdigest() != m.index_file.xxh64:
            raise ContainerError(f"{ip}: size/xxh64 differ from the manifest's field 'experts.index' (damaged index)")
        self.index: np.ndarray = parse_index(ip, raw)
        self.expert_layers: list[int] = c.moe_layers + ([L] if self.mtp_layer is not None else [])
        expected = len(self.expert_layers) * c.n_routed_experts
        if len(self.index) != expected or m.n_records != expected:
            raise ContainerError(f"{ip}: {len(self.index)} records, config.json needs {expected}")
        self._slot: dict[tuple[int, int], int] = {}
        for i, row in enumerate(self.index):
            key = (int(row["layer"]), int(row["expert"]))
            f = int(row["file"])
            if f >= len(m.expert_files) or int(row["length"]) != r.nbytes or \
                    int(row["offset"]) + int(row["length"]) > m.expert_files[f].size or int(row["offset"]) % 4096:
                raise ContainerError(f"{ip}: entry {i} (layer {key[0]} expert {key[1]}) points outside its file")
            self._slot[key] = i
        for layer in self.expert_layers:
            for e in range(c.n_routed_experts):
                if (layer, e) not in self._slot:
                    raise ContainerError(f"{ip}: no record for layer {layer} expert {e}")
        self._columns: tuple[list, list, list, list] | None = None  # index columns for record_location
        self._fds: dict[int, int] = {}
        self._lock = threading.Lock()
        self._dense_mm: mmap.mmap | None = None
        self._dense_cache: dict[str, np.ndarray] | None = {} if cache_dense else None
        self._dense_verified: set[str] = set()

    def _check_copied(self) -> None:
        """config.json and the tokenizer files decide what is served: an edit after conversion, even one that
        keeps the size, must not be served silently. They are small; xxh64 runs at GB/s."""
        for f in self.manifest.copied:
            p = self.dir / f.name
            try:
                raw = p.read_bytes()
            except OSError as e:
                raise ContainerError(f"{p}: cannot read ({e.strerror}); the manifest's field 'copied' lists it") \
                    from None
            if len(raw) != f.size:
                raise ContainerError(f"{p}: {len(raw)} bytes, the manifest's field 'copied' says {f.size}: it changed "
                                     f"after conversion; rerun `coli convert` (or `coli verify {self.dir}`)")
            got = xxhash.xxh64(raw).intdigest()
            if f.xxh64 is not None and got != f.xxh64:
                raise ContainerError(f"{p}: contents differ from the manifest's field 'copied' (xxh64 {got:016x}, "
                                     f"recorded {f.xxh64:016x}): it was edited after conversion; rerun `coli convert` "
                                     f"(or `coli verify {self.dir}`)")

    def _check_file(self, name: str, size: int, kind: int, number: int) -> None:
        p = self.dir / name
        try:
            st = p.stat()
        except FileNotFoundError:
            raise ContainerError(f"{p}: missing (the manifest lists it)") from None
        if st.st_size != size:
            raise ContainerError(f"{p}: {st.st_size} bytes, the manifest's field 'size' says {size} (truncated or damaged)")
        with open(p, "rb") as f:
            check_file_header(p, f.read(FILE_HEADER_BYTES), kind, number)

    # ---- dense core -------------------------------------------------------------------------------------
    def dense_names(self) -> list[str]:
        return list(self.manifest.dense)

    def _mm(self) -> mmap.mmap:
        if self._dense_mm is None:
            with open(self.dir / self.manifest.dense_file.name, "rb") as f:
                self._dense_mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        return self._dense_mm

    def dense_raw(self, name: str, verify: bool = True) -> np.ndarray:
        """The stored bytes of a dense tensor (its whole 4 KiB extent), a read-only view of the mapping."""
        e = self._entry(name)
        buf = np.frombuffer(self._mm(), np.uint8, e.length, e.layout.offset)
        if verify and name not in self._dense_verified:
            verify_record(buf, e.xxh64, f"{self.dir / self.manifest.dense_file.name}: tensor {name!r} at offset "
                                        f"{e.layout.offset} (length {e.length})")
            self._dense_verified.add(name)
        return buf

    def dense_layout(self, name: str) -> MatrixLayout:
        return self._entry(name).layout

    def _entry(self, name: str):
        try:
            return self.manifest.dense[name]
        except KeyError:
            raise ContainerError(f"{self.dir}: tensor {name!r} is not in the container's dense core") from None

    def dense(self, name: str) -> np.ndarray:
        """float32 tensor in its original shape. f32-stored tensors are zero-copy views of the mapping."""
        if self._dense_cache is not None and name in self._dense_cache:
            return self._dense_cache[name]
        e = self._entry(name)
        lay = e.layout
        buf = self.dense_raw(name)
        if lay.fmt == "f32" and lay.contiguous:
            w = buf[:lay.rows * lay.cols * 4].view("<f4").reshape(e.shape)
        else:
            w = decode_matrix(buf, lay).reshape(e.shape)
        if self._dense_cache is not None:
            self._dense_cache[name] = w
        return w

    # ---- experts -------------------------------------------------------------------------------------------
    def record_location(self, layer: int, expert: int) -> RecordLocation:
        if self._columns is None:
            # called for every read of the runtime: plain lists (~1 us a lookup) instead of a numpy row (~14 us);
            # GLM-5's 19,200 records cost ~3 MB here, built on first use
            ix = self.index
            self._columns = (ix["file"].tolist(), ix["offset"].tolist(), ix["length"].tolist(), ix["xxh64"].tolist())
        f, off, n, h = self._columns
        i = self._index_row(layer, expert)
        return RecordLocation(self._resolved_paths[f[i]], off[i], n[i], h[i])

    def _index_row(self, layer: int, expert: int) -> int:
        try:
            return self._slot[(int(layer), int(expert))]
        except KeyError:
            raise ContainerError(f"{self.dir}: no expert record for layer {layer} expert {expert}") from None

    def _fd(self, f: int) -> int:
        with self._lock:
            if f not in self._fds:
                self._fds[f] = os.open(self.expert_paths[f], os.O_RDONLY)
            return self._fds[f]

    def read_record(self, layer: int, expert: int, out: np.ndarray | None = None, verify: bool = True,
                    fd_of: Callable[[int], int] | None = None) -> np.ndarray:
        """The raw record bytes (uint8 [length]), checksum-verified unless verify=False. `fd_of(file index)`
        gives the descriptor to read from (default: this reader's own; O_DIRECT readers pass theirs)."""
        row = self.index[self._index_row(layer, expert)]
        f, off, n = int(row["file"]), int(row["offset"]), int(row["length"])
        buf = np.empty(n, np.uint8) if out is None else out[:n]
        fd, done = (fd_of or self._fd)(f), 0
        while done < n:
            k = os.preadv(fd, [buf[done:]], off + done)
            if k <= 0:
                raise ContainerError(f"{self.expert_paths[f]}: record layer {layer} expert {expert} at offset {off} "
                                     f"(length {n}) ends early: the file is truncated")
            done += k
        if verify:
            verify_record(buf, int(row["xxh64"]), f"{self.expert_paths[f]}: record layer {layer} expert {expert} "
                                                  f"at offset {off} (length {n})")
        return buf

    def expert(self, layer: int, e: int) -> ExpertWeights:
        return decode_expert_record(self.read_record(layer, e), self.record_layout)

    def experts(self, layer: int, ids: Iterable[int]) -> dict[int, ExpertWeights]:
        return {int(e): self.expert(layer, int(e)) for e in ids}

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._dense_cache = {} if self._dense_cache is not None else None
        if self._dense_mm is not None:
            try:
                self._dense_mm.close()
            except BufferError:
                pass   # views are still alive; released when they are collected
            self._dense_mm = None
