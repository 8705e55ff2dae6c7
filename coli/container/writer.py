"""`coli convert`: a Hugging Face glm_moe_dsa checkpoint -> a ColiStream container, streamed and resumable.

How it streams. The whole layout — every dense tensor's extent in dense.coli, every expert record's file and
offset — is a pure function of the config and the options, so it is planned before a byte is written. The work
is a list of *units* (a file header, a dense tensor, an expert record), each with a fixed byte range. Units are
produced in plan order; a dense tensor is read and quantised in row chunks and an expert record from its three
matrices, so memory stays within a small multiple of one tensor, never the checkpoint. Source tensors are read
with pread into private buffers (not through a long-lived mmap) so resident memory does not grow with the
checkpoint.

How it resumes. DST/coli-convert.journal starts with one JSON line (options, source fingerprint, plan hash) and
then gets one line per finished unit (`<unit number> <xxh64>`). A unit is journaled only after its bytes have been
fsync'd, and journal lines are fsync'd in batches (every few seconds / hundreds of MB), so after any crash —
SIGKILL or power loss — every journaled unit is on disk. A rerun with the same arguments truncates each data file
to the end of its last journaled unit and continues from the first unjournaled one; because every unit's bytes
depend only on the input and the options, the result is byte-identical to an uninterrupted run. A rerun with
different options or a changed source is refused. The manifest is written last (tmp + fsync + rename, then the
directory is fsync'd) and only its presence makes a container complete; the journal is removed after it.
"""

from __future__ import annotations

from contextlib import contextmanager

import errno
import json
import math
import os
import queue
import shutil
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import xxhash

from coli import __version__
from coli.config import ModelConfig, load_config
from coli.container.dir_lock import sole_writer
from coli.container.format import (
    ALIGN, DENSE_NAME, FILE_HEADER_BYTES, FORMATS, GROUPS, INDEX_DTYPE, INDEX_NAME, JOURNAL_NAME, KIND_DENSE,
    KIND_EXPERTS, MANIFEST_NAME, VERSION, ContainerError, DenseEntry, FileEntry, Manifest, MatrixLayout,
    RecordLayout, align, expert_file_name, file_header, index_bytes,
)
from coli.container.quant import QuantError, fp8_to_float32, pack_tiles, quantize, quantize_fp8_int4
from coli.errors import WeightError
from coli.model.tensors import dense_shapes, expert_tensor_name, keep_full_precision, mtp_dense_shapes, mtp_layer
from coli.safetensors_io import FLOAT_DTYPES, TensorInfo, to_float32
from coli.weights import FP8_BLOCK, HFCheckpoint, find_shards

_STORAGE = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": "<u2", "F8_E4M3": "u1"}
_COPY_SUFFIXES = (".json", ".jinja", ".txt", ".model", ".tiktoken")
_OWN_NAMES = {MANIFEST_NAME, JOURNAL_NAME, INDEX_NAME, DENSE_NAME}
_CHUNK_ELEMS = 8 << 20            # dense tensors are converted in row chunks of about this many weights
COMMIT_BYTES = 256 << 20          # journal commit after this many written bytes ...
COMMIT_SECONDS = 2.0              # ... or this much time, whichever comes first


# ---- options ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ConvertOptions:
    experts: str = "int4"
    dense: str = "int8"
    group: int = 64
    tile_kb: int = 512
    expert_file_mb: int = 16384
    mtp: bool = True          # keep the MTP layer (when the source has a complete one); --no-mtp leaves it out

    def validate(self) -> None:
        for opt, v in (("--experts", self.experts), ("--dense", self.dense)):
            if v not in FORMATS:
                raise ContainerError(f"{opt} {v!r} is not a format (choose from {', '.join(FORMATS)})")
        if self.group not in GROUPS:
            raise ContainerError(f"--group {self.group} is not supported (choose from {', '.join(map(str, GROUPS))})")
        if not 4 <= self.tile_kb <= 65536:
            raise ContainerError(f"--tile-kb {self.tile_kb} is out of range (4..65536)")
        if self.expert_file_mb < 1:
            raise ContainerError(f"--expert-file-mb {self.expert_file_mb} must be at least 1")

    def to_dict(self) -> dict:
        d = {"experts": self.experts, "dense": self.dense, "group": self.group, "tile_kb": self.tile_kb,
             "expert_file_mb": self.expert_file_mb}
        if not self.mtp:   # only when off: containers and journals made before the MTP layer was kept match
            d["mtp"] = False
        return d

    def flags(self) -> str:
        return " ".join("--no-mtp" if k == "mtp" else f"--{k.replace('_', '-')} {v}" for k, v in self.to_dict().items())


# ---- the source ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SrcMatrix:
    """A 2-D view of (part of) a source tensor: rows [row0, row0 + rows) of a row-major [*, cols] tensor."""

    name: str
    path: Path
    info: TensorInfo
    rows: int
    cols: int
    row0: int = 0
    scale: "SrcMatrix | None" = None   # the FP8 weight_scale_inv companion

    @property
    def dtype(self) -> str:
        return self.info.dtype

    @property
    def itemsize(self) -> int:
        return np.dtype(_STORAGE[self.dtype]).itemsize

    @property
    def nbytes(self) -> int:
        return self.rows * self.cols * self.itemsize + (self.scale.nbytes if self.scale else 0)


class Source:
    """The checkpoint, validated up front (names, shapes, dtypes, FP8 companions), read with pread."""

    def __init__(self, src: Path, report: Callable[[str], None] | None = None):
        self.dir = src
        self.config: ModelConfig = load_config(src)
        self.ck = HFCheckpoint(src, self.config, report=report)   # completeness + shapes + the MTP layer apart
        self.shards, _ = find_shards(src)
        self._names = set(self.ck.names()) | set(self.ck.mtp_names())
        self._fds: dict[Path, int] = {}
        for p in self.shards:   # opened up front: worker threads read concurrently
            try:
                self._fds[p] = os.open(p, os.O_RDONLY)
            except OSError as e:
                raise WeightError(f"{p}: cannot open: {e.strerror}") from None
        self.skipped_layers = self.ck.skipped_layers

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self.ck.close()

    # -- lookup ----------------------------------------------------------------------------------
    def _info(self, name: str) -> tuple[Path, TensorInfo]:
        return self.ck.tensor_info(name)

    def matrix(self, name: str, shape: tuple[int, ...]) -> SrcMatrix:
        path, info = self._info(name)
        if info.dtype not in FLOAT_DTYPES:
            raise WeightError(f"{path}: tensor {name!r} has dtype {info.dtype}; coli convert reads "
                              f"{', '.join(FLOAT_DTYPES)} (F8_E4M3 with a weight_scale_inv companion)")
        rows, cols = (shape if len(shape) == 2 else (1, int(np.prod(shape))))
        scale = None
        if info.dtype == "F8_E4M3":
            sname = name + "_scale_inv"
            if len(shape) != 2:
                raise WeightError(f"{path}: tensor {name!r} is float8 but not a matrix (shape {list(shape)})")
            if sname not in self._names:
                raise WeightError(f"{path}: float8 tensor {name!r} has no {sname!r} companion")
            spath, sinfo = self._info(sname)
            want = (-(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK))
            if sinfo.shape != want:
                raise WeightError(f"{spath}: tensor {sname!r} has shape {list(sinfo.shape)}, a [{rows}, {cols}] "
                                  f"weight in {FP8_BLOCK}x{FP8_BLOCK} blocks needs {list(want)}")
            if sinfo.dtype not in ("F32", "BF16", "F16"):
                raise WeightError(f"{spath}: tensor {sname!r} has dtype {sinfo.dtype}, expected F32")
            scale = SrcMatrix(sname, spath, sinfo, want[0], want[1])
        return SrcMatrix(name, path, info, rows, cols, 0, scale)

    def expert_matrix(self, layer: int, e: int, part: str) -> SrcMatrix:
        c = self.config
        H, Im = c.hidden_size, c.moe_intermediate_size
        name = expert_tensor_name(layer, e, part)
        if name in self._names:
            return self.matrix(name, (Im, H) if part != "down_proj" else (H, Im))
        # transformers' in-memory fused layout (a checkpoint saved without the per-expert converters)
        p = f"model.layers.{layer}.mlp.experts."
        fused = p + ("down_proj" if part == "down_proj" else "gate_up_proj")
        path, info = self._info(fused)
        if info.dtype not in FLOAT_DTYPES or info.dtype == "F8_E4M3":
            raise WeightError(f"{path}: fused expert tensor {fused!r} has dtype {info.dtype}; coli convert reads "
                              f"fused experts only in F32/F16/BF16 (FP8 checkpoints store experts one by one)")
        if part == "down_proj":
            return SrcMatrix(fused, path, info, H, Im, e * H)
        return SrcMatrix(fused, path, info, Im, H, e * 2 * Im + (Im if part == "up_proj" else 0))

    # -- reading -----------------------------------------------------------------------------------
    def _fd(self, path: Path) -> int:
        return self._fds[path]

    def read_rows(self, m: SrcMatrix, r0: int = 0, r1: int | None = None) -> np.ndarray:
        """Rows [r0, r1) of m in the stored dtype (bf16 as uint16, fp8 as uint8), a private array."""
        r1 = m.rows if r1 is None else r1
        dt = np.dtype(_STORAGE[m.dtype])
        out = np.empty((r1 - r0, m.cols), dt)
        view = out.reshape(-1).view(np.uint8)
        start = m.info.start + (m.row0 + r0) * m.cols * dt.itemsize
        fd, done = self._fd(m.path), 0
        while done < view.nbytes:
            try:
                n = os.preadv(fd, [view[done:]], start + done)
            except OSError as e:
                raise WeightError(f"{m.path}: reading tensor {m.name!r}: {e.strerror}") from None
            if n <= 0:
                raise WeightError(f"{m.path}: tensor {m.name!r} ends early (file truncated while converting?)")
            done += n
        return out

    def fingerprint(self) -> dict:
        """What identifies the source for resume: config, index and every shard's size and header (not the
        data: hashing ~756 GB on each start would cost more than the conversion)."""
        files = []
        for p in self.shards:
            with open(p, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                head = f.read(n)
            files.append({"name": p.name, "size": p.stat().st_size, "header_xxh64": f"{xxhash.xxh64(head).intdigest():016x}"})
        fp = {"config_xxh64": f"{xxhash.xxh64((self.dir / 'config.json').read_bytes()).intdigest():016x}",
              "files": files, "skipped_layers": self.skipped_layers}
        idx = self.dir / "model.safetensors.index.json"
        if idx.is_file():
            fp["index_xxh64"] = f"{xxhash.xxh64(idx.read_bytes()).intdigest():016x}"
        return fp


# ---- the plan ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Unit:
    kind: str                 # "header" | "dense" | "expert"
    file: str
    offset: int
    length: int
    name: str = ""            # dense tensor name
    layer: int = -1
    expert: int = -1
    file_number: int = 0


@dataclass
class Plan:
    dense: dict[str, tuple[tuple[int, ...], MatrixLayout]]
    record: RecordLayout
    units: list[Unit]
    file_sizes: dict[str, int]          # data file -> final size
    expert_files: list[str]

    def digest(self) -> str:
        d = {"dense": {n: [list(s), lay.to_dict()] for n, (s, lay) in self.dense.items()},
             "record": self.record.to_dict(),
             "units": [[u.kind, u.file, u.offset, u.length, u.name, u.layer, u.expert] for u in self.units]}
        return f"{xxhash.xxh64(json.dumps(d, sort_keys=True).encode()).intdigest():016x}"

    @property
    def total_bytes(self) -> int:
        return sum(self.file_sizes.values())


def dense_format(name: str, shape: tuple[int, ...], opts: ConvertOptions) -> str:
    return "f32" if len(shape) != 2 or keep_full_precision(name) else opts.dense


def make_plan(c: ModelConfig, opts: ConvertOptions, mtp: bool = False) -> Plan:
    """The layout; `mtp` adds the MTP layer: its dense tensors after the main ones in dense.coli, its routed experts
    as records of layer num_hidden_layers after the main layers' (a source without it plans exactly as before)."""
    units = [Unit("header", DENSE_NAME, 0, FILE_HEADER_BYTES, file_number=0)]
    dense: dict[str, tuple[tuple[int, ...], MatrixLayout]] = {}
    off = FILE_HEADER_BYTES
    shapes = dict(dense_shapes(c))
    if mtp:
        shapes.update(mtp_dense_shapes(c))
    for name, shape in shapes.items():
        rows, cols = shape if len(shape) == 2 else (1, int(np.prod(shape)))
        lay = MatrixLayout.make(rows, cols, dense_format(name, shape, opts), opts.group, opts.tile_kb, off)
        dense[name] = (tuple(shape), lay)
        units.append(Unit("dense", DENSE_NAME, off, align(lay.nbytes), name=name))
        off += align(lay.nbytes)
    sizes = {DENSE_NAME: off}
    record = RecordLayout.make(c.hidden_size, c.moe_intermediate_size, opts.experts, opts.group, opts.tile_kb)
    limit = opts.expert_file_mb << 20
    files: list[str] = []
    cur = None
    for layer in c.moe_layers + ([mtp_layer(c)] if mtp else []):
        for e in range(c.n_routed_experts):
            if cur is None or (sizes[cur] + record.nbytes > limit and sizes[cur] > FILE_HEADER_BYTES):
                cur = expert_file_name(len(files))
                files.append(cur)
                units.append(Unit("header", cur, 0, FILE_HEADER_BYTES, file_number=len(files) - 1))
                sizes[cur] = FILE_HEADER_BYTES
            units.append(Unit("expert", cur, sizes[cur], record.nbytes, layer=layer, expert=e,
                              file_number=len(files) - 1))
            sizes[cur] += record.nbytes
    return Plan(dense, record, units, sizes, files)


# ---- unit production ----------------------------------------------------------------------------------------
def _encode_rows(src: Source, m: SrcMatrix, lay: MatrixLayout, r0: int, r1: int) -> tuple[np.ndarray, np.ndarray]:
    raw = src.read_rows(m, r0, r1)
    try:
        if m.dtype == "F8_E4M3":
            assert m.scale is not None and r0 % FP8_BLOCK == 0
            s = to_float32(src.read_rows(m.scale, r0 // FP8_BLOCK, -(-r1 // FP8_BLOCK)), m.scale.dtype)
            if lay.fmt == "int4" and FP8_BLOCK % lay.group == 0:
                return quantize_fp8_int4(raw, s, lay.group, FP8_BLOCK)
            w = fp8_to_float32(raw, s, FP8_BLOCK)
        else:
            w = to_float32(raw, m.dtype)
        return quantize(w, lay.fmt, lay.group)
    except (QuantError, ValueError) as e:
        raise WeightError(f"{m.path}: tensor {m.name!r}: {e}") from None


def _expert_record(src: Source, record: RecordLayout, layer: int, e: int) -> np.ndarray:
    buf = np.zeros(record.nbytes, np.uint8)
    for part, lay in zip(("gate_proj", "up_proj", "down_proj"), record.matrices):
        m = src.expert_matrix(layer, e, part)
        data, meta = _encode_rows(src, m, lay, 0, lay.rows)
        pack_tiles(lay, data, meta, 0, buf[lay.offset:lay.end])
    return buf


# ---- output files ------------------------------------------------------------------------------------------
class _Out:
    def __init__(self, dst: Path, total_bytes: int):
        self.dst = dst
        self.total = total_bytes
        self.fds: dict[str, int] = {}
        self.dirty: set[str] = set()
        self.new_files = False

    def fd(self, name: str) -> int:
        if name not in self.fds:
            self.fds[name] = os.open(self.dst / name, os.O_WRONLY | os.O_CREAT, 0o644)
            self.new_files = True   # the directory entry must be durable before units in it are journaled
        return self.fds[name]

    def write(self, name: str, offset: int, buf, what: str) -> None:
        mv = memoryview(buf).cast("B")
        done = 0
        try:
            fd = self.fd(name)
            while done < len(mv):
                done += os.pwrite(fd, mv[done:], offset + done)
        except OSError as e:
            raise _write_error(self.dst / name, e, f"{what} at offset {offset + done}", self.total) from None
        self.dirty.add(name)

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


def _write_error(path: Path, e: OSError, what: str, total: int) -> ContainerError:
    if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        why = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "disk quota exceeded",
               errno.EFBIG: "file too large for this file system or process limit"}[e.errno]
        need = f"; the container needs {total / 1e9:.2f} GB in all" if total else ""
        return ContainerError(f"{path}: {why} while writing {what}{need}. Free space and rerun the same command "
                              f"to resume (the finished part is kept)")
    return ContainerError(f"{path}: write failed during {what}: {e.strerror}")


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write(path: Path, data: bytes, total: int = 0) -> None:
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        raise _write_error(path, e, "the file", total) from None


# ---- journal -----------------------------------------------------------------------------------------------
class Journal:
    def __init__(self, path: Path):
        self.path = path
        self.fd: int | None = None

    @staticmethod
    def read(path: Path) -> tuple[dict | None, list[int]]:
        """(header, checksums of the finished units in order). A torn or malformed tail is ignored."""
        try:
            text = path.read_bytes()
        except FileNotFoundError:
            return None, []
        lines = text.split(b"\n")
        try:
            header = json.loads(lines[0])
        except (ValueError, UnicodeDecodeError):
            return None, []
        sums: list[int] = []
        for line in lines[1:-1]:   # the last piece has no newline: torn or empty
            parts = line.split(b" ")
            if len(parts) != 2 or not parts[0].isdigit() or int(parts[0]) != len(sums) or len(parts[1]) != 16:
                break
            try:
                sums.append(int(parts[1], 16))
            except ValueError:
                break
        return header, sums

    def create(self, header: dict) -> None:
        _atomic_write(self.path, (json.dumps(header, sort_keys=True) + "\n").encode())
        self.open_append()

    def open_append(self, keep_lines: int | None = None) -> None:
        if keep_lines is not None:
            # drop a torn tail so appended lines follow the last good one
            raw = self.path.read_bytes().split(b"\n")
            good = b"\n".join(raw[:1 + keep_lines]) + b"\n"
            if good != self.path.read_bytes():
                _atomic_write(self.path, good)
        self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)

    def append(self, entries: list[tuple[int, int]]) -> None:
        if entries and self.fd is not None:
            data = "".join(f"{i} {h:016x}\n" for i, h in entries).encode()
            try:
                done = 0
                while done < len(data):
                    done += os.write(self.fd, data[done:])
                os.fsync(self.fd)
            except OSError as e:
                raise _write_error(self.path, e, "the journal", 0) from None

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


# ---- convert -------------------------------------------------------------------------------------------------
@dataclass
class ConvertResult:
    dst: Path
    status: str                      # "converted" | "resumed" | "already complete"
    units_total: int
    units_skipped: int               # finished by an earlier run
    bytes_in: int                    # source bytes converted by this run
    seconds: float
    manifest: Manifest | None = None
    notes: list[str] = field(default_factory=list)


def _check_paths(src: Path, dst: Path) -> None:
    rs, rd = src.resolve(), dst.resolve()
    if rs == rd:
        raise ContainerError(f"DST {dst} is the source checkpoint directory; choose a new directory")
    if rs in rd.parents:
        raise ContainerError(f"DST {dst} lies inside the source checkpoint directory {src}; choose a directory outside it")
    if rd in rs.parents:
        raise ContainerError(f"DST {dst} contains the source checkpoint {src}; choose another directory")
    if not src.is_dir():
        raise ContainerError(f"SRC {src} is not a directory")


def _copy_names(src: Path) -> list[str]:
    out = []
    for p in sorted(src.iterdir()):
        if p.is_file() and p.suffix in _COPY_SUFFIXES and not p.name.startswith(".") and \
                p.name != "model.safetensors.index.json" and p.name not in _OWN_NAMES:
            out.append(p.name)
    return out


def _diff_args(old: dict, new: dict) -> str:
    keys = sorted(set(old) | set(new))
    return ", ".join(f"--{k.replace('_', '-')} {old.get(k)} (now {new.get(k)})" for k in keys if old.get(k) != new.get(k))


def unit_input_bytes(src: Source, plan: Plan, u: Unit) -> int:
    if u.kind == "dense":
        return src.matrix(u.name, plan.dense[u.name][0]).nbytes
    if u.kind == "expert":
        return sum(src.expert_matrix(u.layer, u.expert, p).nbytes for p in ("gate_proj", "up_proj", "down_proj"))
    return 0


def convert(src: str | Path, dst: str | Path, opts: ConvertOptions, *,
            progress: Callable[[int, int], None] | None = None,
            report: Callable[[str], None] | None = None, threads: int = 2,
            commit_bytes: int = COMMIT_BYTES, commit_seconds: float = COMMIT_SECONDS) -> ConvertResult:
    """Convert (or resume converting) SRC into DST. progress(done_bytes, total_bytes) is called as input is
    consumed; report(message) gets one-line notes. Finished units are journaled (fsync'd) at least every
    commit_bytes written or commit_seconds elapsed: what a crash can cost in redone work."""
    t_start = time.monotonic()
    src, dst = Path(src), Path(dst)
    opts.validate()
    _check_paths(src, dst)
    source = Source(src, report=report)
    try:
        return _convert(source, src, dst, opts, progress, report or (lambda m: None), threads, t_start,
                        (commit_bytes, commit_seconds))
    except OSError as e:   # anything not already reported with its context
        where = e.filename or dst
        raise ContainerError(f"{where}: {e.strerror or e}") from None
    finally:
        source.close()


def _convert(source: Source, src: Path, dst: Path, opts: ConvertOptions, progress, report, threads, t_start, commit):
    keep_mtp = opts.mtp and source.ck.mtp_layer is not None
    if source.ck.mtp_layer is not None and not opts.mtp:
        report("leaving the MTP layer out (--no-mtp): the container cannot draft with `--mtp`")
    plan = make_plan(source.config, opts, mtp=keep_mtp)
    # every tensor is looked up (dtype, FP8 companion, shapes) here, so bad input fails before a byte is written
    in_bytes = [unit_input_bytes(source, plan, u) for u in plan.units]
    header = {"journal": "coli-convert", "format_version": VERSION, "writer": f"coli {__version__}",
              "args": opts.to_dict(), "source": source.fingerprint(), "plan": plan.digest()}

    dst.mkdir(parents=True, exist_ok=True)
    with sole_writer(dst, "coli convert", ContainerError):
        return _convert_locked(source, src, dst, opts, plan, in_bytes, header, progress, report, threads, t_start,
                               commit)


def _check_header(dst: Path, old: dict, header: dict, what: str) -> None:
    if old.get("args") != header["args"]:
        raise ContainerError(f"{dst} holds {what} made with different options: {_diff_args(old.get('args') or {}, header['args'])}. "
                             f"Rerun with the original options to {'resume' if 'unfinished' in what else 'reuse it'}, "
                             f"or choose another DST")
    if old.get("source") != header["source"]:
        raise ContainerError(f"{dst} holds {what} from a different source checkpoint (config, index or shard "
                             f"headers/sizes differ); choose another DST or delete it")
    if old.get("plan") != header["plan"] or old.get("format_version") != VERSION:
        raise ContainerError(f"{dst} holds {what} written by another converter version ({old.get('writer')}); "
                             f"delete it and convert again")


def _convert_locked(source, src, dst, opts, plan, in_bytes, header, progress, report, threads, t_start,
                    commit) -> ConvertResult:
    journal_path = dst / JOURNAL_NAME
    manifest_path = dst / MANIFEST_NAME
    units = plan.units
    if manifest_path.is_file():
        from coli.container.format import parse_manifest
        m = parse_manifest(manifest_path)
        _check_header(dst, {"args": m.args, "source": m.source, "plan": m.plan, "format_version": VERSION,
                            "writer": m.writer}, header, "a complete container")
        if journal_path.exists():
            journal_path.unlink()
            _fsync_dir(dst)
        from coli.container.reader import ContainerReader
        ContainerReader(dst).close()   # sizes, headers, index: a damaged container is reported, not blessed
        return ConvertResult(dst, "already complete", len(units), len(units), 0, time.monotonic() - t_start, m)

    # temporaries of an interrupted atomic write (journal, copies, index, manifest) are ours to drop
    ours = _OWN_NAMES | set(_copy_names(src))
    for p in dst.glob("*.tmp"):
        if p.name[:-4] in ours:
            p.unlink()
    old, sums = Journal.read(journal_path)
    journal = Journal(journal_path)
    if old is None:
        leftovers = [p.name for p in dst.iterdir()]
        if leftovers:
            raise ContainerError(f"DST {dst} is not empty and holds no unfinished conversion "
                                 f"(found {', '.join(sorted(leftovers)[:4])}{' ...' if len(leftovers) > 4 else ''}); "
                                 f"choose an empty or new directory")
        journal.create(header)
        done = 0
        status = "converted"
    else:
        _check_header(dst, old, header, "an unfinished conversion")
        done = min(len(sums), len(units))
        sums = sums[:done]
        journal.open_append(keep_lines=done)
        status = "resumed" if done else "converted"

    out = _Out(dst, plan.total_bytes)
    try:
        # Truncate each data file to the end of its last finished unit: whatever lies beyond is redone.
        ends: dict[str, int] = {}
        for u in units[:done]:
            ends[u.file] = max(ends.get(u.file, 0), u.offset + u.length)
        for name in plan.file_sizes:
            p = dst / name
            if p.exists() and p.stat().st_size != ends.get(name, 0):
                os.truncate(p, ends.get(name, 0))
        needed = plan.total_bytes - sum(ends.values())
        free = shutil.disk_usage(dst).free
        if needed > free:
            raise ContainerError(f"{dst}: no space left on the device: the container needs {needed / 1e9:.2f} GB more, "
                                 f"{free / 1e9:.2f} GB are free. Free space and rerun the same command")
        copied = _copy_files(src, dst, plan.total_bytes)

        total_in = sum(in_bytes)
        done_in = sum(in_bytes[:done])
        if progress:
            progress(done_in, total_in)
        bytes_in = _run_units(source, plan, in_bytes, done, sums, out, journal, progress, done_in, total_in,
                              threads, commit)
        manifest = _finish(source, dst, opts, plan, header, sums, out, copied)
    finally:
        out.close()
        journal.close()
    try:
        journal_path.unlink()
        _fsync_dir(dst)
    except FileNotFoundError:
        pass
    return ConvertResult(dst, status, len(units), done, bytes_in, time.monotonic() - t_start, manifest)


def _copy_files(src: Path, dst: Path, total: int) -> list[FileEntry]:
    entries = []
    for name in _copy_names(src):
        data = (src / name).read_bytes()
        p = dst / name
        if not (p.is_file() and p.read_bytes() == data):
            _atomic_write(p, data, total)
        entries.append(FileEntry(name, len(data), xxhash.xxh64(data).intdigest()))
    return entries


class _Committer(threading.Thread):
    """fsyncs data files and then appends journal lines, in the order batches were handed over, off the main
    thread, so writing the next units overlaps the disk flush. A failure is re-raised in the main thread."""

    def __init__(self, journal: Journal, dst: Path, total: int):
        super().__init__(name="coli-convert-commit", daemon=True)
        self.journal, self.dst, self.total = journal, dst, total
        self.q: queue.Queue = queue.Queue(maxsize=2)
        self.error: BaseException | None = None

    def run(self) -> None:
        while True:
            item = self.q.get()
            try:
                if item is None:
                    return
                if self.error is None:
                    fds, entries, sync_dir = item
                    for name, fd in fds:
                        try:
                            os.fsync(fd)
                        except OSError as e:
                            raise _write_error(self.dst / name, e, "fsync", self.total) from None
                    if sync_dir:
                        _fsync_dir(self.dst)
                    self.journal.append(entries)
            except BaseException as e:  # noqa: BLE001 - handed to the main thread
                self.error = e
            finally:
                self.q.task_done()

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    def submit(self, fds: list[tuple[str, int]], entries: list[tuple[int, int]], sync_dir: bool) -> None:
        self.check()
        self.q.put((fds, entries, sync_dir))

    def drain(self) -> None:
        self.q.join()
        self.check()

    def stop(self) -> None:
        self.q.put(None)
        self.join()


@dataclass(frozen=True)
class _Job:
    unit: int
    offset: int               # where the piece goes in the unit's file
    last: bool                # the unit's last piece
    fn: Callable[[], object]  # produces the piece's bytes


def _dense_piece(source: Source, m: SrcMatrix, lay: MatrixLayout, r0: int, r1: int, pad: int) -> np.ndarray:
    """The tiles of rows [r0, r1) (r0 on a tile boundary), followed by `pad` zero bytes."""
    data, meta = _encode_rows(source, m, lay, r0, r1)
    return pack_row_range(lay, data, meta, r0, r1, pad)


def pack_row_range(lay: MatrixLayout, data: np.ndarray, meta: np.ndarray, r0: int, r1: int, pad: int) -> np.ndarray:
    """Encoded rows [r0, r1) of a matrix (r0 on a tile boundary) packed as its tiles, then `pad` zero bytes."""
    t0, t_end = r0 // lay.rows_per_tile, -(-r1 // lay.rows_per_tile)
    start = lay.tile(t0)[0]
    stop = lay.nbytes if t_end == lay.n_tiles else lay.tile(t_end)[0]
    out = np.empty(stop - start + pad, np.uint8)
    pack_tiles(lay, data, meta, r0, out[:stop - start])
    out[stop - start:] = 0
    return out


def _dense_steps(m: SrcMatrix, lay: MatrixLayout) -> list[tuple[int, int]]:
    step = lay.rows_per_tile
    if m.dtype == "F8_E4M3":
        step = step * FP8_BLOCK // math.gcd(step, FP8_BLOCK)   # whole tiles and whole fp8 block rows
    step *= max(1, _CHUNK_ELEMS // max(step * lay.cols, 1))
    return [(r0, min(lay.rows, r0 + step)) for r0 in range(0, lay.rows, step)]


def _jobs(source: Source, plan: Plan, start: int) -> Iterator[_Job]:
    for i in range(start, len(plan.units)):
        yield from unit_jobs(source, plan, i)


def unit_jobs(source: Source, plan: Plan, i: int) -> Iterator[_Job]:
    """The pieces of unit i, in order (the hub converter produces units out of plan order, shard by shard)."""
    u = plan.units[i]
    if u.kind == "header":
        head = file_header(KIND_DENSE if u.file == DENSE_NAME else KIND_EXPERTS, u.file_number)
        yield _Job(i, u.offset, True, lambda head=head: head)
    elif u.kind == "dense":
        shape, lay = plan.dense[u.name]
        m = source.matrix(u.name, shape)
        steps = _dense_steps(m, lay)
        for k, (r0, r1) in enumerate(steps):
            last = k == len(steps) - 1
            pos = u.offset + lay.tile(r0 // lay.rows_per_tile)[0]
            pad = u.length - lay.nbytes if last else 0
            yield _Job(i, pos, last, partial(_dense_piece, source, m, lay, r0, r1, pad))
    else:
        yield _Job(i, u.offset, True, partial(_expert_record, source, plan.record, u.layer, u.expert))


def _what(u: Unit) -> str:
    return {"header": "the file header", "dense": f"tensor {u.name!r}",
            "expert": f"record layer {u.layer} expert {u.expert}"}[u.kind]


def _run_units(source, plan, in_bytes, done, sums, out, journal, progress, done_in, total_in, threads, policy) -> int:
    """Produce units[done:] in order — pieces computed by `threads` workers (numpy releases the GIL), written by
    this thread in plan order — journaling finished units in fsync'd batches. Returns the input bytes converted."""
    commit_bytes, commit_seconds = policy
    units = plan.units
    pending: list[tuple[int, int]] = []
    pending_bytes = 0
    last_commit = time.monotonic()
    consumed = 0
    committer = _Committer(journal, out.dst, plan.total_bytes)
    committer.start()

    def commit() -> None:
        nonlocal pending_bytes, last_commit
        if pending:
            fds = [(name, out.fds[name]) for name in sorted(out.dirty)]
            out.dirty.clear()
            committer.submit(fds, list(pending), out.new_files)
            out.new_files = False
            pending.clear()
        pending_bytes = 0
        last_commit = time.monotonic()

    try:
        with pieces_in_order(_jobs(source, plan, done), threads) as pieces:
            h = xxhash.xxh64()
            for job, buf in pieces:
                u = units[job.unit]
                out.write(u.file, job.offset, buf, _what(u))
                h.update(buf)
                if job.last:
                    sums.append(h.intdigest())
                    pending.append((job.unit, sums[-1]))
                    h = xxhash.xxh64()
                    pending_bytes += u.length
                    consumed += in_bytes[job.unit]
                    if progress:
                        progress(done_in + consumed, total_in)
                    if pending_bytes >= commit_bytes or time.monotonic() - last_commit >= commit_seconds:
                        commit()
            commit()
            committer.drain()
    finally:
        # whatever finished before an error or interrupt is kept for the next run
        try:
            commit()
            committer.drain()
        except ContainerError:
            pass
        finally:
            committer.stop()
    return consumed


@contextmanager
def pieces_in_order(jobs, threads: int):
    """Each job's bytes (`job.fn()`), made by `threads` workers a bounded window ahead (numpy releases the GIL)
    and handed out in job order as (job, bytes). Leaving the block cancels what was not started and waits for
    the rest, so an error or interrupt leaves no worker writing."""
    pool = ThreadPoolExecutor(max_workers=threads) if threads > 1 else None
    window: deque = deque()

    def refill() -> None:
        while len(window) < (threads + 1 if pool else 1):
            job = next(jobs, None)
            if job is None:
                return
            window.append((job, pool.submit(job.fn) if pool else None))

    def in_order():
        refill()
        while window:
            job, fut = window.popleft()
            refill()
            yield job, (fut.result() if fut is not None else job.fn())

    try:
        yield in_order()
    finally:
        for _, fut in window:
            if fut is not None:
                fut.cancel()
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)


def _finish(source, dst, opts, plan, header, sums, out: _Out, copied) -> Manifest:
    for name, size in plan.file_sizes.items():
        fd = out.fd(name)
        try:
            os.ftruncate(fd, size)
            os.fsync(fd)
        except OSError as e:
            raise _write_error(dst / name, e, "the final size", plan.total_bytes) from None
    dense: dict[str, DenseEntry] = {}
    entries = []
    for u, h in zip(plan.units, sums):
        if u.kind == "dense":
            shape, lay = plan.dense[u.name]
            dense[u.name] = DenseEntry(u.name, shape, lay, u.length, h)
        elif u.kind == "expert":
            entries.append((u.layer, u.expert, u.file_number, 0, u.offset, u.length, h))
    index = np.array(entries, dtype=INDEX_DTYPE)
    raw_index = index_bytes(index)
    _atomic_write(dst / INDEX_NAME, raw_index, plan.total_bytes)
    manifest = Manifest(
        args=opts.to_dict(),
        source=header["source"],
        plan=header["plan"],
        writer=header["writer"],
        dense_file=FileEntry(DENSE_NAME, plan.file_sizes[DENSE_NAME]),
        dense=dense,
        record=plan.record,
        expert_files=[FileEntry(n, plan.file_sizes[n]) for n in plan.expert_files],
        index_file=FileEntry(INDEX_NAME, len(raw_index), xxhash.xxh64(raw_index).intdigest()),
        n_records=len(entries),
        copied=copied,
    )
    _fsync_dir(dst)
    _atomic_write(dst / MANIFEST_NAME, manifest.to_json().encode(), plan.total_bytes)
    _fsync_dir(dst)
    return manifest
