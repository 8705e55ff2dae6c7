"""`coli verify` and `coli inspect` logic: recompute every checksum; summarise a container."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import xxhash

from coli.container.format import FORMAT_HELP, JOURNAL_NAME, MANIFEST_NAME, ContainerError
from coli.container.reader import ContainerReader

_READ_CHUNK = 16 << 20


@dataclass
class BadExtent:
    file: str
    offset: int
    length: int
    what: str            # "record layer 3 expert 7" / "tensor 'model.norm.weight'" / "copied file"
    expected: int
    got: int

    def describe(self) -> str:
        return (f"{self.file}: {self.what} at offset {self.offset} (length {self.length}): checksum mismatch "
                f"(xxh64 {self.got:016x}, expected {self.expected:016x})")


@dataclass
class VerifyReport:
    dir: Path
    mtp_layer: int | None = None      # the MTP layer, whose tensors and records were checked with the rest
    checked: int = 0
    bytes: int = 0
    bad: list[BadExtent] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.bad


def _hash_range(fd: int, offset: int, length: int, buf: np.ndarray) -> int:
    h = xxhash.xxh64()
    done = 0
    while done < length:
        n = min(length - done, buf.nbytes)
        got = os.preadv(fd, [buf[:n]], offset + done)
        if got <= 0:
            break
        h.update(buf[:got])
        done += got
    return h.intdigest()


def verify_container(model_dir: str | Path, progress: Callable[[int, int], None] | None = None,
                     stop_at_first: bool = False) -> VerifyReport:
    """Recompute the checksum of every dense tensor, expert record and copied file. Structural damage (manifest,
    index, sizes, headers) raises ContainerError; bad checksums are collected in file order."""
    d = Path(model_dir)
    r = ContainerReader(d, cache_dense=False, check_copied=False)  # copied files are checked (and listed) below
    m = r.manifest
    rep = VerifyReport(d, r.mtp_layer)
    total = sum(e.length for e in m.dense.values()) + len(r.index) * m.record.nbytes
    buf = np.empty(_READ_CHUNK, np.uint8)
    done = 0
    try:
        for f in m.copied:
            got = xxhash.xxh64((d / f.name).read_bytes()).intdigest()
            rep.checked += 1
            if got != f.xxh64:
                rep.bad.append(BadExtent(str(d / f.name), 0, f.size, "copied file", f.xxh64 or 0, got))
        dense_path = d / m.dense_file.name
        fd = os.open(dense_path, os.O_RDONLY)
        try:
            for e in sorted(m.dense.values(), key=lambda e: e.layout.offset):
                got = _hash_range(fd, e.layout.offset, e.length, buf)
                rep.checked += 1
                rep.bytes += e.length
                done += e.length
                if got != e.xxh64:
                    rep.bad.append(BadExtent(str(dense_path), e.layout.offset, e.length, f"tensor {e.name!r}",
                                             e.xxh64, got))
                    if stop_at_first:
                        return rep
                if progress:
                    progress(done, total)
        finally:
            os.close(fd)
        order = np.lexsort((r.index["offset"], r.index["file"]))
        fds = [os.open(p, os.O_RDONLY) for p in r.expert_paths]
        try:
            for i in order:
                row = r.index[i]
                f, off, n = int(row["file"]), int(row["offset"]), int(row["length"])
                got = _hash_range(fds[f], off, n, buf)
                rep.checked += 1
                rep.bytes += n
                done += n
                if got != int(row["xxh64"]):
                    rep.bad.append(BadExtent(str(r.expert_paths[f]), off, n,
                                             f"record layer {int(row['layer'])} expert {int(row['expert'])}",
                                             int(row["xxh64"]), got))
                    if stop_at_first:
                        return rep
                if progress:
                    progress(done, total)
        finally:
            for fd in fds:
                os.close(fd)
    finally:
        r.close()
    return rep


# ---- inspect ----------------------------------------------------------------------------------------------------
def _fmt_desc(fmt: str, group: int) -> str:
    return f"{fmt} g{group}" if fmt in ("int4", "int2") else fmt


def summarize(model_dir: str | Path) -> dict:
    """Everything `coli inspect` shows, as a JSON-able dict."""
    d = Path(model_dir)
    if not (d / MANIFEST_NAME).is_file() and (d / JOURNAL_NAME).is_file():
        from coli.container.writer import Journal
        head, sums = Journal.read(d / JOURNAL_NAME)
        args = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in ((head or {}).get("args") or {}).items())
        raise ContainerError(f"{d}: unfinished conversion ({len(sums)} units done; started with {args}); "
                             f"rerun coli convert with the same arguments to finish it")
    r = ContainerReader(d)
    try:
        c, m = r.config, r.manifest
        rec = m.record
        dense_bytes = m.dense_file.size
        kept = {n: e for n, e in m.dense.items() if e.layout.fmt == "f32" and m.args.get("dense") != "f32"}
        by_fmt: dict[str, int] = {}
        for e in m.dense.values():
            k = _fmt_desc(e.layout.fmt, e.layout.group)
            by_fmt[k] = by_fmt.get(k, 0) + e.length
        expert_bytes = sum(f.size for f in m.expert_files)
        per_layer: dict[int, dict] = {}
        for row in r.index:
            L = int(row["layer"])
            e = per_layer.setdefault(L, {"layer": L, "experts": 0, "files": set()})
            e["experts"] += 1
            e["files"].add(m.expert_files[int(row["file"])].name)
        layers = [{"layer": v["layer"], "experts": v["experts"], "files": sorted(v["files"])}
                  for _, v in sorted(per_layer.items())]
        n_moe = len(c.moe_layers)
        cold = c.num_experts_per_tok * n_moe * rec.nbytes
        mtp = None
        if r.mtp_layer is not None:
            p = f"model.layers.{r.mtp_layer}."
            mtp_dense = sum(e.length for n, e in m.dense.items() if n.startswith(p))
            mtp = {"layer": r.mtp_layer, "experts": c.n_routed_experts, "dense_bytes": mtp_dense,
                   "expert_bytes": c.n_routed_experts * rec.nbytes,
                   "bytes_per_draft_cold": c.num_experts_per_tok * rec.nbytes}
        return {
            "dir": str(d),
            "format_version": 1,
            "writer": m.writer,
            "args": m.args,
            "formats": {
                "experts": _fmt_desc(rec.gate.fmt, rec.gate.group),
                "dense": _fmt_desc(m.args.get("dense", "?"), m.args.get("group", 0)),
                "dense_kept_full_precision": len(kept),
                "tile_kb": m.args.get("tile_kb"),
            },
            "model": {"layers": c.num_hidden_layers, "moe_layers": n_moe, "experts_per_layer": c.n_routed_experts,
                      "experts_per_token": c.num_experts_per_tok, "hidden": c.hidden_size,
                      "moe_intermediate": c.moe_intermediate_size},
            "tiers": {
                "dense_core_bytes": dense_bytes,
                "dense_core_by_format": by_fmt,
                "expert_store_bytes": expert_bytes,
                "expert_files": len(m.expert_files),
                "index_bytes": m.index_file.size,
                "copied_files": [f.name for f in m.copied],
            },
            "record": {
                "bytes": rec.nbytes, "payload_bytes": rec.payload_bytes, "gate_up_bytes": rec.gate_up_bytes,
                "matrices": {p: {"offset": lay.offset, "bytes": lay.nbytes, "tiles": lay.n_tiles,
                                 "rows_per_tile": lay.rows_per_tile, "tile_bytes": lay.tile_bytes}
                             for p, lay in zip(("gate_proj", "up_proj", "down_proj"), rec.matrices)},
            },
            "experts_per_layer": layers,
            "mtp": mtp,     # None: the container has no MTP layer (`--mtp` is refused)
            "bytes_per_token_cold": {"routed": cold, "routed_plus_dense_core": cold + dense_bytes,
                                     "note": f"{c.num_experts_per_tok} experts x {n_moe} MoE layers x "
                                             f"{rec.nbytes} B records; the dense core is read once if it stays resident"},
        }
    finally:
        r.close()


def format_help() -> str:
    return "; ".join(f"{k}: {v}" for k, v in FORMAT_HELP.items())

