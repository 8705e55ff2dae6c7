"""`coli bench make-slice`: a GLM-5-shaped container of L MoE layers with random weights, for streaming benchmarks.

The slice has GLM-5's real shapes (hidden 6144, 256 experts of 3 x 2048 x 6144, top-8, the MLA/indexer shapes, a
shared expert; the `glm5` preset) but only L decoder layers, every one MoE (first_k_dense_replace = 0), so its
expert records are byte for byte the size the full model's are (20,054,016 B at int4 g64) and a layer's 256 of
them weigh what a real layer's do (5.13 GB). It is an ordinary container — the layout is planned by the
converter's own `make_plan`, tiles are laid out by `pack_tiles`, the index and manifest are written by the
converter's `_finish` — so `ContainerReader`, `coli verify` and `coli inspect` read it like any other.

Weights are not quantised from random floats (slow on two cores): each stored row is made directly, random
packed bytes plus fp16 scales chosen so the dequantised weights have a standard deviation of about 0.02:

    int4  every nibble odd (q in +-1, +-3, +-5, +-7: valid, mean 0), scales 0.0043 x U(0.75, 1.25) per group
    int8  q uniform in [-127, 127], one scale per row;  int2: q uniform in 0..3, offset = -1.5 x scale
    bf16/f32  sign, mantissa and the lowest exponent bit random, magnitudes in [2^-7, 2^-5)
    1-D tensors (norm weights: 1, biases: 0)

Each expert record and each dense tensor piece has its own random stream, seeded by (seed, layer, expert) or
(seed, tensor name, first row): the same options give a byte-identical container.

The slice is written to DIR.tmp and renamed to DIR once complete (manifest last, as the converter does), so DIR
never holds a half container. An error or Ctrl-C removes DIR.tmp; one left by a killed run is recognised and removed
by the next run. There is no resume: a slice is cheap to redo.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import xxhash

from coli import __version__
from coli.bench.trace_router import MAX_LAYERS, TRACE_NAME, build_slice_trace, write_slice_trace
from coli.config import PRESETS, ModelConfig
from coli.container.format import (
    DENSE_NAME, FORMATS, GROUPS, KIND_DENSE, KIND_EXPERTS, MANIFEST_NAME, ContainerError, FileEntry, Manifest,
    MatrixLayout, RecordLayout, file_header, parse_manifest,
)
from coli.container.quant import pack_tiles
from coli.container.writer import ConvertOptions, Plan, _finish, _fsync_dir, _Out, make_plan, pack_row_range, pieces_in_order
from coli.errors import ColiError

SLICE_PRESETS = ("glm5", "tiny")
GENERATOR = "coli bench make-slice"
STD = 0.02                         # target standard deviation of the dequantised random weights
_U2 = 1.0 + 0.5 ** 2 / 12          # E[u^2] of the scale jitter u ~ U(0.75, 1.25)
# standard deviation of the stored integer q per format (int4: odd nibbles; int8: uniform -127..127; int2: 0..3)
_Q_STD = {"int4": 21 ** 0.5, "int8": ((255 ** 2 - 1) / 12) ** 0.5, "int2": 1.25 ** 0.5}
_CHUNK_ELEMS = 8 << 20             # dense tensors are written in pieces of whole tiles, about this many weights
UNFINISHED = ".coli-make-slice-unfinished"   # in DIR.tmp while it is being written


class SliceError(ColiError):
    """Bad make-slice options or a destination it must not touch (names the option or path)."""


# ---- options and config ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SliceOptions:
    layers: int = 2
    experts: int | None = None      # routed experts per layer; None: the preset's (256 for glm5)
    fmt: str = "int4"               # routed expert format
    group: int = 64
    # dense core format (norms, routers, biases, weights_proj stay f32): what `coli convert` stores by default, so a
    # benchmark's dense layer reads the bytes a user's converted model reads (bf16 reads 2x int8's, 3.8x int4's)
    dense_fmt: str = ConvertOptions.dense
    tile_kb: int = 512
    trace: str = "glm52"            # 'uniform' | 'glm52' | a recorded trace file
    tokens: int | None = None       # trace tokens; None: 256 (synthetic) or all of FILE
    seed: int = 0
    vocab: int | None = None        # None: the preset's (154880 for glm5)
    preset: str = "glm5"
    expert_file_mb: int = 16384

    def validate(self) -> None:
        if self.preset not in SLICE_PRESETS:
            raise SliceError(f"--preset {self.preset!r} is not known (choose from {' | '.join(SLICE_PRESETS)})")
        base = PRESETS[self.preset]
        if not 1 <= self.layers <= MAX_LAYERS:
            raise SliceError(f"--layers {self.layers}: a slice has 1..{MAX_LAYERS} MoE layers")
        for opt, v in (("--format", self.fmt), ("--dense-format", self.dense_fmt)):
            if v not in FORMATS:
                raise SliceError(f"{opt} {v!r} is not a format (choose from {' | '.join(FORMATS)})")
        if self.group not in GROUPS:
            raise SliceError(f"--group {self.group} is not supported (choose from {' | '.join(map(str, GROUPS))})")
        if self.experts is not None and not base.num_experts_per_tok <= self.experts <= 65535:
            raise SliceError(f"--experts {self.experts}: needs {base.num_experts_per_tok}..65535 (the model routes "
                             f"top-{base.num_experts_per_tok})")
        if self.vocab is not None and not 2 <= self.vocab <= base.vocab_size:
            raise SliceError(f"--vocab {self.vocab}: shrinks the vocabulary, so 2..{base.vocab_size}")
        if not 4 <= self.tile_kb <= 65536:
            raise SliceError(f"--tile-kb {self.tile_kb} is out of range (4..65536)")
        if self.tokens is not None and self.tokens < 1:
            raise SliceError(f"--tokens {self.tokens}: the trace needs at least one token")

    def convert_options(self) -> ConvertOptions:
        return ConvertOptions(experts=self.fmt, dense=self.dense_fmt, group=self.group, tile_kb=self.tile_kb,
                              expert_file_mb=self.expert_file_mb)


def slice_config(opts: SliceOptions) -> ModelConfig:
    """The preset's dimensions with `layers` decoder layers, all MoE with a full indexer; fewer experts or a smaller
    vocabulary when asked (eos ids outside a shrunk vocabulary are dropped)."""
    base = PRESETS[opts.preset]
    L = opts.layers
    vocab = opts.vocab or base.vocab_size
    return dataclasses.replace(
        base, num_hidden_layers=L, mlp_layer_types=("sparse",) * L, indexer_types=("full",) * L,
        n_routed_experts=opts.experts or base.n_routed_experts, vocab_size=vocab,
        eos_token_ids=tuple(e for e in base.eos_token_ids if e < vocab))


# ---- random stored rows -----------------------------------------------------------------------------------------
def random_rows(rng: np.random.Generator, lay: MatrixLayout, n: int) -> tuple[np.ndarray, np.ndarray]:
    """n stored rows of `lay`'s format made directly (module docstring): (data [n, row_data_bytes] uint8,
    meta [n, row_meta_bytes] uint8), what `quantize` would return for weights of std ~STD."""
    nd = n * lay.row_data_bytes
    raw = rng.bit_generator.random_raw(-(-nd // 8)).view(np.uint8)[:nd]   # random bytes, ~3 GB/s
    if lay.fmt == "int4":
        np.bitwise_or(raw, 0x11, out=raw)                  # odd nibbles: q = nibble - 8 in {+-1, +-3, +-5, +-7}
    elif lay.fmt == "int8":
        v = raw.view(np.int8)
        np.maximum(v, -127, out=v)
    elif lay.fmt == "bf16":
        v = raw.view("<u2")
        np.bitwise_and(v, 0x80FF, out=v)                   # sign | lowest exponent bit | 7 mantissa bits
        np.bitwise_or(v, 0x3C00, out=v)                    # exponent 2^-7 or 2^-6
    elif lay.fmt == "f32":
        v = raw.view("<u4")
        np.bitwise_and(v, 0x80FFFFFF, out=v)
        np.bitwise_or(v, 0x3C000000, out=v)
    meta = np.empty((n, lay.row_meta_bytes), np.uint8)
    if lay.row_meta_bytes:
        ng = lay.n_groups
        s0 = STD / (_Q_STD[lay.fmt] * _U2 ** 0.5)
        scale = ((rng.random((n, ng), np.float32) * np.float32(0.5) + np.float32(0.75)) * np.float32(s0))
        m16 = meta.view("<f2")
        m16[:, :ng] = scale
        if lay.fmt == "int2":
            m16[:, ng:] = scale * np.float32(-1.5)         # offset: q in 0..3 centred on 0
    return raw.reshape(n, lay.row_data_bytes), meta


def _const_rows(value: float, lay: MatrixLayout) -> tuple[np.ndarray, np.ndarray]:
    """A 1-D tensor stored as f32 [1, n]: norm weights 1, biases 0."""
    assert lay.fmt == "f32" and lay.rows == 1
    return np.full(lay.cols, value, "<f4").view(np.uint8).reshape(1, -1), np.empty((1, 0), np.uint8)


def _name_key(name: str) -> int:
    return xxhash.xxh32(name.encode()).intdigest()


def _rng(*key: int) -> np.random.Generator:
    """An independent stream per (seed, ...) key; PCG64DXSM makes raw bytes ~1.5x faster than the default PCG64."""
    return np.random.Generator(np.random.PCG64DXSM(np.random.SeedSequence(list(key))))


def dense_piece(seed: int, name: str, shape: tuple[int, ...], lay: MatrixLayout, r0: int, r1: int,
                pad: int) -> np.ndarray:
    """The tiles of rows [r0, r1) of a dense tensor (r0 on a tile boundary), then `pad` zero bytes."""
    if len(shape) == 1:
        data, meta = _const_rows(0.0 if name.endswith("bias") else 1.0, lay)
    else:
        data, meta = random_rows(_rng(seed, 0, _name_key(name), r0), lay, r1 - r0)
    return pack_row_range(lay, data, meta, r0, r1, pad)


def expert_record(seed: int, record: RecordLayout, layer: int, expert: int) -> np.ndarray:
    """One whole expert record (gate, up, down tiles, zero padding), random as the module docstring says."""
    rng = _rng(seed, 1, layer, expert)
    buf = np.zeros(record.nbytes, np.uint8)
    for lay in record.matrices:
        data, meta = random_rows(rng, lay, lay.rows)
        pack_tiles(lay, data, meta, 0, buf[lay.offset:lay.end])
    return buf


def _dense_steps(lay: MatrixLayout) -> list[tuple[int, int]]:
    step = lay.rows_per_tile * max(1, _CHUNK_ELEMS // max(lay.rows_per_tile * lay.cols, 1))
    return [(r0, min(lay.rows, r0 + step)) for r0 in range(0, lay.rows, step)]


@dataclass(frozen=True)
class _Job:
    unit: int
    offset: int               # where the piece goes in the unit's file
    last: bool                # the unit's last piece
    fn: Callable[[], object]


def _jobs(plan: Plan, seed: int) -> Iterator[_Job]:
    for i, u in enumerate(plan.units):
        if u.kind == "header":
            head = file_header(KIND_DENSE if u.file == DENSE_NAME else KIND_EXPERTS, u.file_number)
            yield _Job(i, u.offset, True, lambda head=head: head)
        elif u.kind == "dense":
            shape, lay = plan.dense[u.name]
            steps = _dense_steps(lay)
            for k, (r0, r1) in enumerate(steps):
                last = k == len(steps) - 1
                pos = u.offset + lay.tile(r0 // lay.rows_per_tile)[0]
                yield _Job(i, pos, last, partial(dense_piece, seed, u.name, shape, lay, r0, r1,
                                                 u.length - lay.nbytes if last else 0))
        else:
            yield _Job(i, u.offset, True, partial(expert_record, seed, plan.record, u.layer, u.expert))


# ---- the plan and its size ----------------------------------------------------------------------------------------
@dataclass
class SlicePlan:
    opts: SliceOptions
    config: ModelConfig
    plan: Plan                 # the converter's plan: every extent of dense.coli and the expert files
    trace_idx: np.ndarray      # [T, L, K] int32
    trace_w: np.ndarray        # [T, L, K] float32
    trace_meta: dict

    @property
    def expert_bytes(self) -> int:
        return sum(s for n, s in self.plan.file_sizes.items() if n != DENSE_NAME)

    @property
    def dense_bytes(self) -> int:
        return self.plan.file_sizes[DENSE_NAME]

    @property
    def total_bytes(self) -> int:
        return self.plan.total_bytes

    def source(self) -> dict[str, Any]:
        """What the manifest's 'source' and config.json's 'coli_bench_slice' say about the slice."""
        o, c = self.opts, self.config
        full_vocab = PRESETS[o.preset].vocab_size
        return {"generator": GENERATOR, "preset": o.preset, "layers": o.layers, "experts": c.n_routed_experts,
                "seed": o.seed, "vocab": c.vocab_size, "vocab_full": full_vocab,
                "vocab_shrunk": c.vocab_size != full_vocab,
                "weights": f"random stored tiles, not trained or quantised (std ~{STD}; norm weights 1, biases 0)",
                "trace": {"stored_as": TRACE_NAME, **self.trace_meta}}

    def describe(self) -> str:
        o, c = self.opts, self.config
        fmt = f"{o.fmt} g{o.group}" if o.fmt in ("int4", "int2") else o.fmt
        dfmt = f"{o.dense_fmt} g{o.group}" if o.dense_fmt in ("int4", "int2") else o.dense_fmt
        vocab = f"vocab {c.vocab_size}" + (" (shrunk)" if self.source()["vocab_shrunk"] else "")
        return (f"{o.preset} slice: {o.layers} MoE layer(s) x {c.n_routed_experts} experts x "
                f"{self.plan.record.nbytes:,} B ({fmt}) = {human_bytes(self.expert_bytes)} of experts "
                f"({human_bytes(self.expert_bytes / o.layers)} per layer) + {human_bytes(self.dense_bytes)} dense "
                f"core ({dfmt}, {vocab}) = {human_bytes(self.total_bytes)}")


def human_bytes(n: float) -> str:
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return f"{int(n)} B"


def plan_slice(opts: SliceOptions) -> SlicePlan:
    """Validate the options, build the routing trace (reading FILE) and plan every byte; writes nothing."""
    opts.validate()
    c = slice_config(opts)
    copts = opts.convert_options()
    copts.validate()
    idx, w, meta = build_slice_trace(opts.trace, opts.layers, c.n_routed_experts, c.num_experts_per_tok,
                                     opts.tokens, opts.seed)
    return SlicePlan(opts, c, make_plan(c, copts), idx, w, meta)


# ---- writing -------------------------------------------------------------------------------------------------------
@dataclass
class SliceResult:
    dir: Path
    manifest: Manifest
    bytes: int
    seconds: float


def _tmp_dir(dst: Path) -> Path:
    return dst.with_name(dst.name + ".tmp")


def _ours(tmp: Path) -> bool:
    """Is DIR.tmp an earlier make-slice run's (unfinished, or finished but not yet renamed)?"""
    if (tmp / UNFINISHED).is_file():
        return True
    try:
        return parse_manifest(tmp / MANIFEST_NAME).source.get("generator") == GENERATOR
    except ContainerError:
        return False


def check_destination(dst: Path, force: bool, sp: "SlicePlan | None" = None) -> None:
    """Refuse a DIR that must not be touched, or (given the plan) a disk without room for the slice; called before
    anything is written (write_slice checks again)."""
    dst = Path(dst)
    if dst.exists() and not dst.is_dir():
        raise SliceError(f"DIR {dst} exists and is not a directory; choose another DIR")
    if dst.is_dir() and any(dst.iterdir()) and not force:
        raise SliceError(f"DIR {dst} exists and is not empty; pass --force to replace it (it is removed only once "
                         f"the new slice is complete), or choose another DIR")
    tmp = _tmp_dir(dst)
    if tmp.exists() and not _ours(tmp):
        raise SliceError(f"{tmp} exists and was not made by coli bench make-slice (it writes there before renaming "
                         f"to DIR); remove it or choose another DIR")
    if sp is not None:
        need = sp.total_bytes + (1 << 20)
        free = _free_bytes(dst) + (_allocated(tmp) if tmp.exists() else 0)   # a stale DIR.tmp is removed first
        if need > free:
            raise SliceError(f"{dst}: the slice needs {human_bytes(need)}, {human_bytes(free)} are free there "
                             f"(fewer --layers, a smaller --vocab or another DIR)")


def _allocated(d: Path) -> int:
    return sum(p.stat().st_blocks * 512 for p in d.rglob("*") if p.is_file())


def _free_bytes(p: Path) -> int:
    while not p.exists():
        p = p.parent
    return shutil.disk_usage(p).free


def _write_file(path: Path, data: bytes | None = None) -> FileEntry:
    """Write (or, data None, keep) a small file, fsync it, and describe it for the manifest's 'copied' list."""
    with open(path, "wb" if data is not None else "r+b") as f:
        if data is None:
            data = f.read()
        else:
            f.write(data)
            f.flush()
        os.fsync(f.fileno())
    return FileEntry(path.name, len(data), xxhash.xxh64(data).intdigest())


def write_slice(dst: str | Path, sp: SlicePlan, *, force: bool = False,
                progress: Callable[[int, int], None] | None = None, report: Callable[[str], None] | None = None,
                threads: int = 2) -> SliceResult:
    """Write the planned slice to dst (via dst.tmp, renamed when complete). progress(done, total) in bytes."""
    t0 = time.monotonic()
    dst = Path(dst)
    report = report or (lambda m: None)
    check_destination(dst, force, sp)
    tmp = _tmp_dir(dst)
    if tmp.exists():
        report(f"removing {tmp} (left by an interrupted make-slice)")
        shutil.rmtree(tmp)
    try:
        manifest = _write_tmp(tmp, sp, progress, report, threads)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)   # Ctrl-C, a full disk: leave nothing behind (SIGKILL: the next run)
        if isinstance(e, ContainerError):        # the converter's write errors speak of resuming; we start over
            raise SliceError(str(e).replace("rerun the same command to resume (the finished part is kept)",
                                            "rerun (make-slice starts over)")) from None
        if isinstance(e, OSError):
            raise SliceError(f"{e.filename or tmp}: {e.strerror or e}") from None
        raise
    _install(tmp, dst)
    return SliceResult(dst, manifest, sp.total_bytes, time.monotonic() - t0)


def _write_tmp(tmp: Path, sp: SlicePlan, progress, report, threads: int) -> Manifest:
    tmp.mkdir(parents=True)
    (tmp / UNFINISHED).write_bytes(b"")
    source = sp.source()
    cfg = sp.config.to_hf_dict()
    cfg["coli_bench_slice"] = source      # ignored by config readers; says what this is and that vocab shrank
    copied = [_write_file(tmp / "config.json", (json.dumps(cfg, indent=1, sort_keys=True) + "\n").encode())]
    write_slice_trace(tmp / TRACE_NAME, sp.trace_idx, sp.trace_w, sp.config.n_routed_experts, sp.trace_meta)
    copied.append(_write_file(tmp / TRACE_NAME))
    header = {"source": source, "plan": sp.plan.digest(), "writer": f"coli {__version__} ({GENERATOR})"}
    out = _Out(tmp, sp.total_bytes)
    try:
        sums = _write_units(sp.plan, sp.opts.seed, out, progress, threads)
        report("syncing to disk ...")
        manifest = _finish(None, tmp, sp.opts.convert_options(), sp.plan, header, sums, out, copied)
    finally:
        out.close()
    (tmp / UNFINISHED).unlink()
    _fsync_dir(tmp)
    return manifest


def _write_units(plan: Plan, seed: int, out: _Out, progress, threads: int) -> list[int]:
    """Every unit in plan order: pieces made by `threads` workers (numpy releases the GIL), written and hashed here.
    Returns each unit's xxh64, in unit order."""
    total = plan.total_bytes
    sums: list[int] = []
    done = 0
    with pieces_in_order(_jobs(plan, seed), threads) as pieces:
        h = xxhash.xxh64()
        for job, buf in pieces:
            u = plan.units[job.unit]
            out.write(u.file, job.offset, buf, f"unit {job.unit}")
            h.update(buf)
            done += len(memoryview(buf).cast("B"))
            if job.last:
                sums.append(h.intdigest())
                h = xxhash.xxh64()
            if progress:
                progress(done, total)
    return sums


def _install(tmp: Path, dst: Path) -> None:
    """Rename the complete tmp directory to dst; a replaced dst is moved aside first and removed after."""
    trash = None
    if dst.exists() and any(dst.iterdir()):
        trash = Path(tempfile.mkdtemp(prefix=dst.name + ".replaced-", dir=dst.parent))
        os.rename(dst, trash / dst.name)
    os.rename(tmp, dst)               # replaces an empty dst
    _fsync_dir(dst.parent)
    if trash is not None:
        shutil.rmtree(trash)


def make_slice(dst: str | Path, opts: SliceOptions, *, force: bool = False, progress=None, report=None,
               threads: int = 2) -> SliceResult:
    sp = plan_slice(opts)
    if report:
        report(sp.describe())
    return write_slice(dst, sp, force=force, progress=progress, report=report, threads=threads)
