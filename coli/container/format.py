"""The ColiStream container format, version 1: names, magics, layouts. The spec is docs/format.md.

A container directory holds

    coli-manifest.json   written last (tmp + fsync + rename): its presence means "complete"
    config.json, ...     the checkpoint's config and tokenizer files, copied verbatim
    dense.coli           the dense core: a 4 KiB file header, then one extent per tensor
    experts-NNNNN.coli   the expert store: a 4 KiB file header, then one record per routed expert
    experts.index        (layer, expert) -> (file, offset, length, xxh64), fixed-size binary entries

Every stored matrix — a dense weight or one of an expert's gate/up/down — is a run of **tiles**. A tile is
`r` whole rows of the matrix: first the rows' quantisation metadata (scales, offsets), then the rows' packed
data, each section padded to 16 bytes. Tiles of one matrix have the same row count except the last, so tile t
starts at `t * tile_bytes` from the matrix start and decodes with nothing but its own bytes.

An expert record is gate, up, down in that order, each matrix starting 4 KiB-aligned inside the record, the
record padded to a multiple of 4 KiB (the padding is zero and covered by the checksum).
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from coli.errors import WeightError

# ---- names and magics ------------------------------------------------------------------------------
MANIFEST_NAME = "coli-manifest.json"
MANIFEST_MAGIC = "colistream-container"
VERSION = 1                       # format version; a reader refuses any other
MAGIC = b"COLISTRM"               # first 8 bytes of every data file (dense.coli, experts-*.coli)
INDEX_MAGIC = b"COLIIDX\x00"      # first 8 bytes of experts.index
DENSE_NAME = "dense.coli"
INDEX_NAME = "experts.index"
JOURNAL_NAME = "coli-convert.journal"  # exists only while a conversion is unfinished


def expert_file_name(i: int) -> str:
    return f"experts-{i:05d}.coli"


ALIGN = 4096          # file header size, record/extent alignment (O_DIRECT)
SECTION_ALIGN = 16    # alignment of a tile's metadata and data sections (128-bit loads)
FILE_HEADER_BYTES = ALIGN
KIND_DENSE, KIND_EXPERTS = 0, 1

FORMATS = ("int4", "int8", "int2", "bf16", "f32")
GROUPS = (32, 64, 128)
FORMAT_HELP = {
    "int4": "symmetric 4-bit, one fp16 scale per --group inputs; value = (nibble - 8) * scale",
    "int8": "symmetric 8-bit, one fp16 scale per row; value = int8 * scale",
    "int2": "asymmetric 2-bit, fp16 scale and offset per --group inputs; value = q * scale + offset",
    "bf16": "bfloat16, lossless for bf16 sources",
    "f32": "float32, lossless",
}


class ContainerError(WeightError):
    """A container is missing, unfinished, of another version, or damaged (names the file and field)."""


def align(n: int, a: int = ALIGN) -> int:
    return -(-n // a) * a


# ---- matrix / tile layout --------------------------------------------------------------------------
def rows_per_tile(row_bytes: int, rows: int, tile_kb: int) -> int:
    """Whole rows per tile so a tile is about tile_kb KiB; a multiple of 16 once it is at least 16."""
    r = max(1, (tile_kb * 1024) // max(row_bytes, 1))
    if r >= 16:
        r -= r % 16
    return max(1, min(r, rows))


@dataclass(frozen=True)
class MatrixLayout:
    """Where and how one [rows, cols] matrix is stored: `offset` is relative to its record (experts) or
    absolute in dense.coli (dense tensors)."""

    rows: int
    cols: int
    fmt: str
    group: int            # int4/int2: inputs per scale group; 0 otherwise
    rows_per_tile: int
    offset: int = 0

    @staticmethod
    def make(rows: int, cols: int, fmt: str, group: int, tile_kb: int, offset: int = 0) -> "MatrixLayout":
        if fmt not in FORMATS:
            raise ValueError(f"unknown format {fmt!r} (known: {', '.join(FORMATS)})")
        g = group if fmt in ("int4", "int2") else 0
        probe = MatrixLayout(rows, cols, fmt, g, 1, offset)
        return MatrixLayout(rows, cols, fmt, g, rows_per_tile(probe.row_bytes, rows, tile_kb), offset)

    # per row -------------------------------------------------------------------------------------
    @property
    def n_groups(self) -> int:
        if self.fmt in ("int4", "int2"):
            return -(-self.cols // self.group)
        return 1 if self.fmt == "int8" else 0

    @property
    def padded_cols(self) -> int:
        """Columns actually packed: int4/int2 rows are padded to whole groups (padding decodes to junk, drop it)."""
        return self.n_groups * self.group if self.fmt in ("int4", "int2") else self.cols

    @property
    def row_data_bytes(self) -> int:
        c = self.padded_cols
        return {"int4": c // 2, "int2": c // 4, "int8": c, "bf16": 2 * c, "f32": 4 * c}[self.fmt]

    @property
    def row_meta_bytes(self) -> int:
        return {"int4": 2 * self.n_groups, "int2": 4 * self.n_groups, "int8": 2}.get(self.fmt, 0)

    @property
    def row_bytes(self) -> int:
        return self.row_data_bytes + self.row_meta_bytes

    # per tile ------------------------------------------------------------------------------------
    def meta_section(self, nrows: int) -> int:
        return align(nrows * self.row_meta_bytes, SECTION_ALIGN)

    def data_section(self, nrows: int) -> int:
        return align(nrows * self.row_data_bytes, SECTION_ALIGN)

    @property
    def tile_bytes(self) -> int:
        """Size of every tile but possibly the last."""
        r = self.rows_per_tile
        return self.meta_section(r) + self.data_section(r)

    @property
    def n_tiles(self) -> int:
        return -(-self.rows // self.rows_per_tile)

    def tile(self, t: int) -> tuple[int, int, int]:
        """(byte offset from the matrix start, rows in the tile, first row) of tile t."""
        if not 0 <= t < self.n_tiles:
            raise IndexError(f"tile {t} out of range (0..{self.n_tiles - 1})")
        r0 = t * self.rows_per_tile
        return t * self.tile_bytes, min(self.rows_per_tile, self.rows - r0), r0

    @property
    def nbytes(self) -> int:
        off, n, _ = self.tile(self.n_tiles - 1)
        return off + self.meta_section(n) + self.data_section(n)

    @property
    def end(self) -> int:
        return self.offset + self.nbytes

    @property
    def contiguous(self) -> bool:
        """True when the matrix is plain row-major data (lossless formats whose tiles need no padding)."""
        return self.row_meta_bytes == 0 and (self.n_tiles == 1 or
                                             self.rows_per_tile * self.row_data_bytes % SECTION_ALIGN == 0)

    def to_dict(self) -> dict[str, Any]:
        return {"rows": self.rows, "cols": self.cols, "format": self.fmt, "group": self.group,
                "rows_per_tile": self.rows_per_tile, "offset": self.offset, "tile_bytes": self.tile_bytes,
                "n_tiles": self.n_tiles, "nbytes": self.nbytes}

    @staticmethod
    def from_dict(d: dict[str, Any], where: str) -> "MatrixLayout":
        try:
            m = MatrixLayout(int(d["rows"]), int(d["cols"]), str(d["format"]), int(d["group"]),
                             int(d["rows_per_tile"]), int(d["offset"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ContainerError(f"{where}: bad matrix layout {d!r}: {e}") from None
        if m.fmt not in FORMATS:
            raise ContainerError(f"{where}: field 'format' is {m.fmt!r}; this reader knows {', '.join(FORMATS)}")
        if m.rows < 1 or m.cols < 1 or m.rows_per_tile < 1 or m.offset < 0 or \
                (m.fmt in ("int4", "int2") and m.group not in GROUPS):
            raise ContainerError(f"{where}: inconsistent matrix layout {d!r}")
        for k in ("tile_bytes", "n_tiles", "nbytes"):
            if k in d and int(d[k]) != getattr(m, k):
                raise ContainerError(f"{where}: field {k!r} is {d[k]}, the layout implies {getattr(m, k)}")
        return m


EXPERT_PARTS = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class RecordLayout:
    """One routed expert's record: gate [Im, H], up [Im, H], down [H, Im], each 4 KiB-aligned in the record."""

    gate: MatrixLayout
    up: MatrixLayout
    down: MatrixLayout

    @staticmethod
    def make(hidden: int, inter: int, fmt: str, group: int, tile_kb: int) -> "RecordLayout":
        gate = MatrixLayout.make(inter, hidden, fmt, group, tile_kb, 0)
        up = MatrixLayout.make(inter, hidden, fmt, group, tile_kb, align(gate.end))
        down = MatrixLayout.make(hidden, inter, fmt, group, tile_kb, align(up.end))
        return RecordLayout(gate, up, down)

    @property
    def matrices(self) -> tuple[MatrixLayout, MatrixLayout, MatrixLayout]:
        return self.gate, self.up, self.down

    @property
    def payload_bytes(self) -> int:
        return self.down.end

    @property
    def nbytes(self) -> int:
        """The record's length on disk (4 KiB multiple); this is what is read, checksummed and copied."""
        return align(self.down.end)

    @property
    def gate_up_bytes(self) -> int:
        """Bytes from the record start through the end of `up`: the first half the GPU may start on."""
        return self.up.end

    def to_dict(self) -> dict[str, Any]:
        return {"gate_proj": self.gate.to_dict(), "up_proj": self.up.to_dict(), "down_proj": self.down.to_dict(),
                "nbytes": self.nbytes}

    @staticmethod
    def from_dict(d: dict[str, Any], where: str) -> "RecordLayout":
        try:
            r = RecordLayout(*(MatrixLayout.from_dict(d[p], f"{where}.{p}") for p in EXPERT_PARTS))
        except (KeyError, TypeError) as e:
            raise ContainerError(f"{where}: record layout lacks {e}") from None
        if int(d.get("nbytes", r.nbytes)) != r.nbytes:
            raise ContainerError(f"{where}: field 'nbytes' is {d['nbytes']}, the layout implies {r.nbytes}")
        return r


# ---- data file header --------------------------------------------------------------------------------
_HEADER = struct.Struct("<8sIII")  # magic, version, kind, file number; the rest of the 4 KiB is zero


def file_header(kind: int, number: int) -> bytes:
    return _HEADER.pack(MAGIC, VERSION, kind, number).ljust(FILE_HEADER_BYTES, b"\0")


def check_file_header(path: Path, raw: bytes, kind: int, number: int) -> None:
    if len(raw) < _HEADER.size:
        raise ContainerError(f"{path}: truncated ({len(raw)} bytes; a container data file starts with a "
                             f"{FILE_HEADER_BYTES}-byte header)")
    magic, version, k, n = _HEADER.unpack_from(raw)
    if magic != MAGIC:
        raise ContainerError(f"{path}: field 'magic' is {magic!r}, expected {MAGIC!r} (not a ColiStream data file)")
    if version != VERSION:
        raise ContainerError(f"{path}: field 'version' is {version}; this reader reads container version {VERSION} "
                             f"(re-convert with this coli)")
    if (k, n) != (kind, number):
        raise ContainerError(f"{path}: header says kind {k} file {n}, the manifest expects kind {kind} file {number}")


# ---- expert index ---------------------------------------------------------------------------------------
INDEX_DTYPE = np.dtype([("layer", "<u4"), ("expert", "<u4"), ("file", "<u4"), ("flags", "<u4"),
                        ("offset", "<u8"), ("length", "<u8"), ("xxh64", "<u8")])  # 40 bytes
_INDEX_HEADER = struct.Struct("<8sIIQ")  # magic, version, entry size, entry count; padded to 64 bytes
INDEX_HEADER_BYTES = 64


def index_bytes(entries: np.ndarray) -> bytes:
    head = _INDEX_HEADER.pack(INDEX_MAGIC, VERSION, INDEX_DTYPE.itemsize, len(entries)).ljust(INDEX_HEADER_BYTES, b"\0")
    return head + np.ascontiguousarray(entries, INDEX_DTYPE).tobytes()


def parse_index(path: Path, raw: bytes) -> np.ndarray:
    if len(raw) < INDEX_HEADER_BYTES:
        raise ContainerError(f"{path}: truncated index ({len(raw)} bytes)")
    magic, version, esize, count = _INDEX_HEADER.unpack_from(raw)
    if magic != INDEX_MAGIC:
        raise ContainerError(f"{path}: field 'magic' is {magic!r}, expected {INDEX_MAGIC!r}")
    if version != VERSION:
        raise ContainerError(f"{path}: field 'version' is {version}; this reader reads version {VERSION}")
    if esize != INDEX_DTYPE.itemsize:
        raise ContainerError(f"{path}: field 'entry_size' is {esize}, expected {INDEX_DTYPE.itemsize}")
    if len(raw) != INDEX_HEADER_BYTES + count * esize:
        raise ContainerError(f"{path}: {len(raw)} bytes for {count} entries (expected "
                             f"{INDEX_HEADER_BYTES + count * esize})")
    return np.frombuffer(raw, INDEX_DTYPE, count, INDEX_HEADER_BYTES).copy()


# ---- manifest ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DenseEntry:
    name: str
    shape: tuple[int, ...]
    layout: MatrixLayout     # offset absolute in dense.coli
    length: int              # extent on disk (4 KiB multiple), covered by xxh64
    xxh64: int

    def to_dict(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "layout": self.layout.to_dict(), "length": self.length,
                "xxh64": f"{self.xxh64:016x}"}


@dataclass(frozen=True)
class FileEntry:
    name: str
    size: int
    xxh64: int | None = None  # for small files (index, copies); data files carry per-extent checksums

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"name": self.name, "size": self.size}
        if self.xxh64 is not None:
            d["xxh64"] = f"{self.xxh64:016x}"
        return d


@dataclass(frozen=True)
class Manifest:
    args: dict[str, Any]
    source: dict[str, Any]
    plan: str             # digest of the planned layout (resume refuses a different plan)
    writer: str
    dense_file: FileEntry
    dense: dict[str, DenseEntry]
    record: RecordLayout
    expert_files: list[FileEntry]
    index_file: FileEntry
    n_records: int
    copied: list[FileEntry]

    def to_json(self) -> str:
        d = {
            "magic": MANIFEST_MAGIC,
            "format_version": VERSION,
            "writer": self.writer,
            "args": self.args,
            "source": self.source,
            "plan": self.plan,
            "dense": {"file": self.dense_file.to_dict(), "tensors": {n: e.to_dict() for n, e in self.dense.items()}},
            "experts": {"record": self.record.to_dict(), "files": [f.to_dict() for f in self.expert_files],
                        "index": self.index_file.to_dict(), "records": self.n_records},
            "copied": [f.to_dict() for f in self.copied],
        }
        return json.dumps(d, indent=1, sort_keys=True) + "\n"


def _hex(v: Any, where: str) -> int:
    try:
        return int(v, 16)
    except (TypeError, ValueError):
        raise ContainerError(f"{where}: bad xxh64 {v!r}") from None


def _file_entry(d: Any, where: str) -> FileEntry:
    if not isinstance(d, dict) or not isinstance(d.get("name"), str) or not isinstance(d.get("size"), int):
        raise ContainerError(f"{where}: bad file entry {d!r}")
    if "/" in d["name"] or d["name"] in ("", ".", ".."):
        raise ContainerError(f"{where}: file name {d['name']!r} is not a plain name")
    return FileEntry(d["name"], d["size"], _hex(d["xxh64"], where) if "xxh64" in d else None)


def parse_manifest(path: Path) -> Manifest:
    """Read and check a manifest; every refusal names the file and the field."""
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ContainerError(f"{path}: not found (not a ColiStream container, or its conversion is unfinished)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ContainerError(f"{path}: cannot parse: {e}") from None
    if not isinstance(raw, dict):
        raise ContainerError(f"{path}: top level must be a JSON object")
    if raw.get("magic") != MANIFEST_MAGIC:
        raise ContainerError(f"{path}: field 'magic' is {raw.get('magic')!r}, expected {MANIFEST_MAGIC!r}")
    if raw.get("format_version") != VERSION:
        raise ContainerError(f"{path}: field 'format_version' is {raw.get('format_version')!r}; this reader reads "
                             f"container version {VERSION} (re-convert with this coli)")
    try:
        dense_raw, experts_raw = raw["dense"], raw["experts"]
        dense = {}
        for name, e in dense_raw["tensors"].items():
            w = f"{path}: dense.tensors[{name!r}]"
            lay = MatrixLayout.from_dict(e["layout"], w + ".layout")
            shape = tuple(int(s) for s in e["shape"])
            if math.prod(shape) != lay.rows * lay.cols:
                raise ContainerError(f"{w}: field 'shape' {list(shape)} does not match the layout {lay.rows}x{lay.cols}")
            if lay.offset % ALIGN or int(e["length"]) != align(lay.nbytes):
                raise ContainerError(f"{w}: field 'length'/'offset' not 4 KiB-aligned extents")
            dense[name] = DenseEntry(name, shape, lay, int(e["length"]), _hex(e["xxh64"], w))
        m = Manifest(
            args=dict(raw["args"]), source=dict(raw["source"]), plan=str(raw.get("plan", "")),
            writer=str(raw.get("writer", "")),
            dense_file=_file_entry(dense_raw["file"], f"{path}: dense.file"),
            dense=dense,
            record=RecordLayout.from_dict(experts_raw["record"], f"{path}: experts.record"),
            expert_files=[_file_entry(f, f"{path}: experts.files[{i}]") for i, f in enumerate(experts_raw["files"])],
            index_file=_file_entry(experts_raw["index"], f"{path}: experts.index"),
            n_records=int(experts_raw["records"]),
            copied=[_file_entry(f, f"{path}: copied[{i}]") for i, f in enumerate(raw["copied"])],
        )
    except KeyError as e:
        raise ContainerError(f"{path}: field {e.args[0]!r} is missing") from None
    except (TypeError, ValueError, AttributeError) as e:
        raise ContainerError(f"{path}: malformed manifest: {e}") from None
    return m
