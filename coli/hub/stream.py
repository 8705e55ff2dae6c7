"""`coli convert hf://ORG/REPO[@REVISION] DST`: convert a checkpoint on the Hub shard by shard, so the disk never
holds more than the container plus `max_shards` shards.

The container's layout is a pure function of the config and the options (writer.make_plan), so every unit (a file
header, a dense tensor, an expert record) has its byte range before any shard is fetched, and units can be written
in any order. Shards are fetched in the index's order; after each one, every unit whose inputs are all at hand is
produced (by the writer's own code, so the bytes are those of a local conversion). A shard nothing pending needs
is deleted from the cache. When `max_shards` are on disk and the oldest is still needed — a record whose
gate/up/down lie in shards not yet fetched — only the tensors still needed are copied out of it into a small
staging safetensors file under DST, and the shard goes. The journal (coli/hub/journal.py) makes each step
durable, so a killed run resumes where it stopped, never fetches a consumed shard again, and ends with the same
bytes as an uninterrupted run (and as `coli convert` of a local copy: the manifest's source fingerprint is taken
from each shard's size and header as it arrives, exactly as the local converter takes it)."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Callable

import xxhash

from coli import __version__
from coli.config import load_config
from coli.container.dir_lock import sole_writer
from coli.container.format import MANIFEST_NAME, VERSION, ContainerError
from coli.container.writer import (
    _COPY_SUFFIXES, ConvertOptions, Source, _copy_files, _finish, _fsync_dir, _Out, _what, make_plan,
    pieces_in_order, unit_jobs,
)
from coli.errors import WeightError
from coli.hub.client import HubClient, HubError, HubRef, hub_errors
from coli.hub.journal import JOURNAL, JournalWriter, read_journal
from coli.hub.progress import human_bytes as _size
from coli.model.tensors import (
    MTP_DUPLICATES, dense_shapes, expert_shapes, expert_tensor_name, layer_of, mtp_dense_shapes, mtp_layer,
)
from coli.safetensors_io import SafetensorsFile, TensorInfo

STAGE_DIR = ".coli-hub-stage"
INDEX = "model.safetensors.index.json"
_PARTS = ("gate_proj", "up_proj", "down_proj")


@dataclass
class HubConvertResult:
    dst: Path
    status: str            # "converted" | "resumed" | "already complete"
    units_total: int
    units_skipped: int
    shards_fetched: int
    bytes_downloaded: int
    seconds: float
    manifest: object = None


class StreamSource(Source):
    """The writer's Source over whatever shards and staging files are on disk at the moment."""

    def __init__(self, config, names: set[str], keep_mtp: bool = False):   # noqa: D107 - Source.__init__ opens a whole checkpoint
        self.keep_mtp = keep_mtp       # the MTP layer's tensors are read too (writer.make_plan(mtp=True))
        self.dir = None
        self.config = config
        self.ck = None
        self.shards = []
        self._names = set(names)
        self._fds: dict[Path, int] = {}
        self._where: dict[str, tuple[Path, TensorInfo]] = {}
        self._by_file: dict[Path, list[str]] = {}
        self.skipped_layers: list[int] = []

    def add_file(self, path: Path) -> dict[str, TensorInfo]:
        f = SafetensorsFile(path)   # validates the header against the file (offsets, sizes, dtypes)
        tensors = dict(f.tensors)
        f.close()
        L = self.config.num_hidden_layers
        kept = [n for n in tensors if (layer_of(n) is None or layer_of(n) < L) or
                (self.keep_mtp and layer_of(n) == L and not n.endswith(MTP_DUPLICATES))]
        try:
            self._fds[path] = os.open(path, os.O_RDONLY)
        except OSError as e:
            raise WeightError(f"{path}: cannot open: {e.strerror}") from None
        for n in kept:
            self._where[n] = (path, tensors[n])
            self._names.add(n)
        self._by_file[path] = kept
        return tensors

    def drop_file(self, path: Path) -> None:
        for n in self._by_file.pop(path, []):
            if self._where.get(n, (None,))[0] == path:
                del self._where[n]
        fd = self._fds.pop(path, None)
        if fd is not None:
            os.close(fd)

    def has(self, name: str) -> bool:
        return name in self._where

    def _info(self, name: str) -> tuple[Path, TensorInfo]:
        try:
            return self._where[name]
        except KeyError:
            raise WeightError(f"tensor {name!r} is needed but neither downloaded nor staged") from None

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


# ---- what each unit reads ------------------------------------------------------------------------------------------
def _with_scales(names):
    return [x for n in names for x in (n, n + "_scale_inv")]


def unit_inputs(plan, u) -> set[str]:
    """Every tensor the unit may read (both expert layouts, FP8 companions included)."""
    if u.kind == "dense":
        return set(_with_scales([u.name]))
    if u.kind == "expert":
        p = f"model.layers.{u.layer}.mlp.experts."
        return set(_with_scales(expert_tensor_name(u.layer, u.expert, part) for part in _PARTS)) | \
            {p + "gate_up_proj", p + "down_proj"}
    return set()


def _have(src: StreamSource, name: str) -> bool:
    """The tensor and, for FP8 weights, its scale companion are at hand."""
    if not src.has(name):
        return False
    return src._where[name][1].dtype != "F8_E4M3" or src.has(name + "_scale_inv")


def unit_ready(src: StreamSource, u) -> bool:
    if u.kind == "header":
        return True
    if u.kind == "dense":
        return _have(src, u.name)
    per = [expert_tensor_name(u.layer, u.expert, part) for part in _PARTS]
    if all(_have(src, n) for n in per):
        return True
    p = f"model.layers.{u.layer}.mlp.experts."
    return not any(n in src._names for n in per) and src.has(p + "gate_up_proj") and src.has(p + "down_proj")


def expected_shapes(c, mtp: bool = False) -> dict[str, tuple[int, ...]]:
    want = dict(dense_shapes(c))
    if mtp:
        want.update(mtp_dense_shapes(c))
    es = expert_shapes(c)
    for layer in c.moe_layers + ([mtp_layer(c)] if mtp else []):
        p = f"model.layers.{layer}.mlp.experts."
        want[p + "gate_up_proj"] = (c.n_routed_experts, 2 * c.moe_intermediate_size, c.hidden_size)
        want[p + "down_proj"] = (c.n_routed_experts, c.hidden_size, c.moe_intermediate_size)
        for e in range(c.n_routed_experts):
            for part, shape in es.items():
                want[expert_tensor_name(layer, e, part)] = tuple(shape)
    return want


def check_complete(c, names: set[str], where: str) -> None:
    """Before any shard is fetched: the index names every tensor the forward needs (as HFCheckpoint checks)."""
    for name in dense_shapes(c):
        if name not in names:
            raise WeightError(f"{where}: tensor {name!r} is missing from the checkpoint")
    fused = any(n.endswith("mlp.experts.gate_up_proj") for n in names)
    for layer in c.moe_layers:
        p = f"model.layers.{layer}.mlp.experts."
        need = [p + "gate_up_proj", p + "down_proj"] if fused else \
            [expert_tensor_name(layer, e, part) for e in range(c.n_routed_experts) for part in _PARTS]
        for name in need:
            if name not in names:
                raise WeightError(f"{where}: tensor {name!r} is missing from the checkpoint")


def mtp_complete(c, names: set[str]) -> bool:
    """The index names every tensor of the MTP layer (as HFCheckpoint's check, by name; shapes are checked as each
    shard opens): then the container keeps it, as `coli convert` of the same files does."""
    L = mtp_layer(c)
    if not set(mtp_dense_shapes(c)) <= names:
        return False
    p = f"model.layers.{L}.mlp.experts."
    if p + "gate_up_proj" in names:
        return p + "down_proj" in names
    return all(expert_tensor_name(L, e, part) in names for e in range(c.n_routed_experts) for part in _PARTS)


def shard_fingerprint(path: Path, name: str) -> dict:
    """The entry Source.fingerprint() makes for this shard: its size and the xxh64 of its header."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        head = f.read(n)
    return {"name": name, "size": path.stat().st_size, "header_xxh64": f"{xxhash.xxh64(head).intdigest():016x}"}


def write_stage(path: Path, src: StreamSource, names: list[str]) -> None:
    """The named tensors, copied byte for byte into a new safetensors file (tmp, fsync, rename)."""
    header, off = {}, 0
    for n in names:
        info = src._where[n][1]
        header[n] = {"dtype": info.dtype, "shape": list(info.shape), "data_offsets": [off, off + info.nbytes]}
        off += info.nbytes
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as out:
            out.write(len(hb).to_bytes(8, "little") + hb)
            for n in names:
                p, info = src._where[n]
                with open(p, "rb") as f:
                    f.seek(info.start)
                    left = info.nbytes
                    while left:
                        chunk = f.read(min(left, 8 << 20))
                        if not chunk:
                            raise WeightError(f"{p}: tensor {n!r} ends early")
                        out.write(chunk)
                        left -= len(chunk)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise ContainerError(f"{path}: cannot stage tensors a pending record still needs: {e.strerror}. Free space "
                             f"and rerun the same command to resume (the finished part is kept)") from None


# ---- the driver ----------------------------------------------------------------------------------------------------
def plan_shards(client: HubClient) -> tuple[list[str], dict[str, str] | None, Path]:
    """(shard names in the local converter's order, the index's tensor -> shard map or None, the snapshot dir
    holding config.json, the index and the small files the container copies)."""
    files = client.listing().files
    if "config.json" not in files:
        raise HubError(f"{client.ref}: the revision has no config.json; is it a Hugging Face checkpoint?")
    small = [n for n in files if "/" not in n and not n.startswith(".") and
             (n.endswith(_COPY_SUFFIXES) or n == INDEX)]
    for n in sorted(small):
        client.download(n)
    snap = client.cached("config.json").parent
    if INDEX in files:
        try:
            weight_map = json.loads((snap / INDEX).read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise WeightError(f"{client.ref}: {INDEX} unreadable or without 'weight_map': {e}") from None
        shards = sorted(set(weight_map.values()))
        for s in shards:
            if s not in files:
                raise WeightError(f"{client.ref}: {INDEX} names shard {s}, which the revision does not have")
        return shards, weight_map, snap
    if "model.safetensors" in files:
        return ["model.safetensors"], None, snap
    shards = sorted(n for n in files if "/" not in n and n.endswith(".safetensors"))
    if not shards:
        raise WeightError(f"{client.ref}: no model.safetensors, {INDEX} or *.safetensors in the revision")
    return shards, None, snap


def _free(path: Path) -> tuple[int, int]:
    p = path
    while not p.exists():
        p = p.parent
    return os.stat(p).st_dev, shutil.disk_usage(p).free


def check_disk(dst: Path, cache: Path, container_bytes: int, shard_bytes: int, max_shards: int,
               report: Callable[[str], None]) -> None:
    """Refuse to start when the container plus `max_shards` of the largest shards cannot fit; say what it needs."""
    (dev_d, free_d), (dev_c, free_c) = _free(dst), _free(cache)
    report(f"disk: the container needs {_size(container_bytes)} more in {dst}, at most {max_shards} shard(s) at "
           f"once up to {_size(shard_bytes)} in {cache}; free: {_size(free_d)}"
           + ("" if dev_d == dev_c else f" there, {_size(free_c)} in the cache"))
    problem = disk_shortfall(dst, cache, container_bytes, shard_bytes, max_shards, free_d,
                             None if dev_d == dev_c else free_c)
    if problem:
        raise HubError(problem)


def disk_shortfall(dst, cache, container_bytes: int, shard_bytes: int, max_shards: int, free_dst: int,
                   free_cache: int | None) -> str | None:
    """Why the disk cannot hold the conversion, or None. free_cache None: the cache is on DST's file system."""
    fix = "free space, convert to a DST on a larger disk, or lower --max-shards-on-disk"
    if free_cache is None:
        if container_bytes + shard_bytes > free_dst:
            return (f"not enough disk: {_size(container_bytes + shard_bytes)} needed (container "
                    f"{_size(container_bytes)} + {max_shards} shard(s) {_size(shard_bytes)}), {_size(free_dst)} free "
                    f"at {dst}: {fix}")
        return None
    if container_bytes > free_dst:
        return (f"not enough disk at {dst}: the container needs {_size(container_bytes)}, {_size(free_dst)} free: "
                f"{fix}")
    if shard_bytes > free_cache:
        return (f"not enough disk for the download cache {cache}: {max_shards} shard(s) need {_size(shard_bytes)}, "
                f"{_size(free_cache)} free: {fix} (or point HF_HUB_CACHE elsewhere)")
    return None


def hub_convert(ref: HubRef, dst: str | Path, opts: ConvertOptions, *, max_shards: int = 2, threads: int = 2,
                cache_dir: str | Path | None = None, report: Callable[[str], None] | None = None,
                on_download: Callable[[int, int], None] | None = None,
                on_convert: Callable[[int, int], None] | None = None,
                commit_bytes: int = 256 << 20) -> HubConvertResult:
    """Convert (or resume converting) the Hub checkpoint `ref` into DST; see the module docstring.
    on_download(done, total) counts shard bytes; on_convert(done, total) counts units."""
    t0 = time.monotonic()
    dst = Path(dst)
    report = report or (lambda m: None)
    opts.validate()
    if max_shards < 1:
        raise HubError(f"--max-shards-on-disk {max_shards} must be at least 1")
    if (dst / MANIFEST_NAME).is_file() and not (dst / JOURNAL).exists():
        from coli.container.format import parse_manifest
        m = parse_manifest(dst / MANIFEST_NAME)
        if m.args != opts.to_dict():
            raise ContainerError(f"{dst} holds a complete container made with other options ({m.args}); "
                                 f"choose another DST")
        return HubConvertResult(dst, "already complete", 0, 0, 0, 0, time.monotonic() - t0, m)
    dst.mkdir(parents=True, exist_ok=True)
    with sole_writer(dst, "coli convert", ContainerError):
        return _Run(ref, dst, opts, max_shards, threads, cache_dir, report, on_download, on_convert,
                    commit_bytes, t0).run()


class _Run:
    def __init__(self, ref, dst, opts, max_shards, threads, cache_dir, report, on_download, on_convert,
                 commit_bytes, t0):
        self.ref, self.dst, self.opts, self.max_shards, self.threads = ref, dst, opts, max_shards, threads
        self.cache_dir, self.report, self.on_download, self.on_convert = cache_dir, report, on_download, on_convert
        self.commit_bytes, self.t0 = commit_bytes, t0
        self.jpath = dst / JOURNAL
        self._skip_reported: set[int] = set()
        self.stage = dst / STAGE_DIR

    # -- set-up: listing, small files, plan, journal ------------------------------------------------------------
    def run(self) -> HubConvertResult:
        state = read_journal(self.jpath)
        old = state.header
        ref = self.ref
        if old is not None:
            if old.get("repo") != ref.repo or old.get("revision") != ref.revision:
                raise ContainerError(f"{self.dst} holds an unfinished conversion of "
                                     f"{HubRef(old.get('repo', '?'), old.get('revision'))}, not {ref}; rerun that "
                                     f"command to resume it, or choose another DST")
            ref = HubRef(ref.repo, old["commit"])   # resume the commit it started from, even if a branch moved
        elif any(self.dst.iterdir()):
            names = sorted(p.name for p in self.dst.iterdir())
            raise ContainerError(f"DST {self.dst} is not empty and holds no unfinished conversion (found "
                                 f"{', '.join(names[:4])}{' ...' if len(names) > 4 else ''}); choose an empty or new "
                                 f"directory")
        client = self.client = HubClient(ref, self.cache_dir)
        client.sweep_partials()
        shards, weight_map, snap = plan_shards(client)
        config = load_config(snap)
        L = config.num_hidden_layers
        # the MTP layer is kept when the index names all of it (a repo without an index: left out, said below)
        keep_mtp = self.opts.mtp and weight_map is not None and mtp_complete(config, set(weight_map))
        plan = make_plan(config, self.opts, mtp=keep_mtp)
        header = {"journal": "coli-hub-convert", "repo": self.ref.repo, "revision": self.ref.revision,
                  "commit": client.listing().commit, "args": self.opts.to_dict(), "plan": plan.digest(),
                  "format_version": VERSION, "writer": f"coli {__version__}"}
        if old is not None and (old.get("args") != header["args"] or old.get("plan") != header["plan"]):
            raise ContainerError(f"{self.dst} holds an unfinished conversion made with other options "
                                 f"({old.get('args')}); rerun with the original options to resume, or choose "
                                 f"another DST")
        names = set(weight_map or ())
        if weight_map is not None:
            names = {n for n in names if layer_of(n) is None or layer_of(n) < L or
                     (keep_mtp and layer_of(n) == L and not n.endswith(MTP_DUPLICATES))}
            check_complete(config, names, str(ref))
        src = self.src = StreamSource(config, names, keep_mtp)
        self.keep_mtp = keep_mtp
        self.plan, self.shards, self.weight_map, self.snap, self.state = plan, shards, weight_map, snap, state
        self.want_shapes = expected_shapes(config, keep_mtp)
        try:
            return self._convert(header, old is not None)
        finally:
            src.close()

    def _convert(self, header: dict, resuming: bool) -> HubConvertResult:
        plan, st, files = self.plan, self.state, self.client.listing().files
        done = {i: h for i, h in st.units.items() if i < len(plan.units)}
        skipped_before = len(done)
        # Leftovers of a killed run: shards journaled as consumed but not yet deleted, stage files not journaled.
        for s in st.consumed:
            p = self.client.cached(s)
            if p.exists() or p.is_symlink():
                self.client.evict(p)
        todo = [s for s in self.shards if s not in st.consumed]
        remaining = plan.total_bytes - sum(plan.units[i].length for i in done)
        biggest = sorted((files[s].size for s in todo), reverse=True)[:self.max_shards]
        check_disk(self.dst, self.client.storage, remaining, sum(biggest), self.max_shards, self.report)
        self.journal = JournalWriter(self.jpath, None if resuming else header)
        self.stage.mkdir(exist_ok=True)
        journaled_stage = set(st.staged.values())
        for p in self.stage.iterdir():
            if f"{STAGE_DIR}/{p.name}" not in journaled_stage:
                p.unlink()
        for rel in sorted(journaled_stage):
            if (self.dst / rel).is_file():
                self.src.add_file(self.dst / rel)
        self.out = _Out(self.dst, plan.total_bytes)
        self.done = done
        total_dl = sum(files[s].size for s in self.shards)
        self.dl_done = sum(files[s].size for s in st.consumed)
        fetched = 0
        present: list[str] = []              # shards on disk, oldest first (a prefetch in flight counts)
        paths: dict[str, Path] = {}
        ahead: _Fetch | None = None          # the next shard, downloading while this one converts
        try:
            self._progress(total_dl)
            self._produce()                  # units that need nothing (headers) or only staged tensors
            for k, s in enumerate(todo):
                if ahead is None:
                    while len(present) >= self.max_shards:
                        self._stage_out(present.pop(0), paths)
                    ahead = _Fetch(self, s, total_dl)
                    present.append(s)
                path = ahead.result()
                ahead = None
                fetched += 1
                self._open_shard(s, path)
                paths[s] = path
                self._progress(total_dl)
                if k + 1 < len(todo) and len(present) < self.max_shards:
                    ahead = _Fetch(self, todo[k + 1], total_dl)   # bounded: it takes a free place in `present`
                    present.append(todo[k + 1])
                self._produce()
                for q in [q for q in present if q in paths and not self._needed(paths[q])]:
                    present.remove(q)
                    self._consume(q, paths[q])
                self._drop_unneeded_stage()
            for q in list(present):
                self._stage_out(q, paths) if self._needed(paths[q]) else self._consume(q, paths[q])
            missing = [i for i in range(len(plan.units)) if i not in self.done]
            if missing:
                u = plan.units[missing[0]]
                raise WeightError(f"{self.ref}: {_what(u)} cannot be converted: its tensors are not in the "
                                  f"checkpoint ({len(missing)} unit(s) left)")
            source_fp = self._fingerprint(st)
            sums = [self.done[i] for i in range(len(plan.units))]
            copied = _copy_files(self.snap, self.dst, plan.total_bytes)
            manifest = _finish(self.src, self.dst, self.opts, plan, {**header, "source": source_fp}, sums,
                               self.out, copied)
        finally:
            self.out.close()
            self.journal.close()
        shutil.rmtree(self.stage, ignore_errors=True)
        self.jpath.unlink(missing_ok=True)
        _fsync_dir(self.dst)
        return HubConvertResult(self.dst, "resumed" if resuming else "converted", len(plan.units), skipped_before,
                                fetched, sum(files[s].size for s in todo),
                                time.monotonic() - self.t0, manifest)

    def _download(self, name: str, total_dl: int) -> Path:
        before = [0]

        def on_bytes(n: int) -> None:
            before[0] += n
            if self.on_download:
                self.on_download(self.dl_done + before[0], total_dl)
        path = self.client.download(name, on_bytes=on_bytes)
        self.dl_done += self.client.remote(name).size
        return path

    def _progress(self, total_dl: int) -> None:
        if self.on_download:
            self.on_download(self.dl_done, total_dl)
        if self.on_convert:
            self.on_convert(len(self.done), len(self.plan.units))

    # -- shards -----------------------------------------------------------------------------------------------
    def _open_shard(self, name: str, path: Path) -> None:
        tensors = self.src.add_file(path)
        for n, info in tensors.items():
            want = self.want_shapes.get(n)
            if want is not None and info.shape != want and (layer_of(n) is None or layer_of(n) <
                                                            self.src.config.num_hidden_layers + self.keep_mtp):
                raise WeightError(f"{self.ref}: {name}: tensor {n!r} has shape {list(info.shape)}, the config "
                                  f"needs {list(want)}")
            if self.weight_map is not None and self.weight_map.get(n, name) != name:
                raise WeightError(f"{self.ref}: {name} holds tensor {n!r}, which {INDEX} places in "
                                  f"{self.weight_map[n]}")
        if self.weight_map is not None:
            lost = [n for n, f in self.weight_map.items() if f == name and n not in tensors]
            if lost:
                raise WeightError(f"{self.ref}: {INDEX} places tensor {lost[0]!r} in {name}, which does not hold it "
                                  f"({len(lost)} missing); the repo's index and shards disagree")
        if name not in self.state.shards:
            L = self.src.config.num_hidden_layers
            skipped = sorted({layer_of(n) for n in tensors if layer_of(n) is not None and layer_of(n) >= L})
            self.journal.append({"shard": name, "fp": shard_fingerprint(path, name), "skipped": skipped})
            self.state.shards[name] = {"fp": shard_fingerprint(path, name), "skipped": skipped}
            dropped = [x for x in skipped if not (self.keep_mtp and x == L)]
            if set(dropped) - self._skip_reported:
                self._skip_reported |= set(dropped)
                self.report(f"skipping tensors of layer(s) {dropped} in {name} (>= num_hidden_layers {L}: the MTP "
                            f"layer is left out{' (--no-mtp)' if not self.opts.mtp else ''})")

    def _pending_inputs(self) -> set[str]:
        if not hasattr(self, "_inputs"):   # per unit, once: GLM-5 has ~20k units
            self._inputs = [unit_inputs(self.plan, u) for u in self.plan.units]
        out: set[str] = set()
        for i, names in enumerate(self._inputs):
            if i not in self.done:
                out |= names
        return out

    def _needed(self, path: Path) -> list[str]:
        pend = self._pending_inputs()
        return [n for n in self.src._by_file.get(path, []) if n in pend and self.src._where[n][0] == path]

    def _consume(self, name: str, path: Path) -> None:
        self.src.drop_file(path)
        self.journal.append({"consumed": name})
        self.state.consumed.add(name)
        self.client.evict(path)

    def _stage_out(self, name: str, paths: dict[str, Path]) -> None:
        path = paths[name]
        need = self._needed(path)
        if need:
            rel = f"{STAGE_DIR}/{name}"
            write_stage(self.dst / rel, self.src, need)
            _fsync_dir(self.stage)
            self.journal.append({"staged": name, "file": rel})
            self.src.drop_file(path)
            self.src.add_file(self.dst / rel)
            self.report(f"{name}: {len(need)} tensor(s) of records that span shards staged in {rel}")
        self._consume(name, path)

    def _drop_unneeded_stage(self) -> None:
        for p in list(self.src._by_file):
            if p.parent == self.stage and not self._needed(p):
                self.src.drop_file(p)
                p.unlink(missing_ok=True)

    # -- units --------------------------------------------------------------------------------------------------
    def _produce(self) -> None:
        """Every unfinished unit whose inputs are at hand, in plan order, journaled in fsync'd batches."""
        plan, out = self.plan, self.out
        ready = [i for i, u in enumerate(plan.units) if i not in self.done and unit_ready(self.src, u)]
        if not ready:
            return
        pending: list[list[int]] = []
        written = 0

        def commit() -> None:
            nonlocal written
            if not pending:
                return
            for name in sorted(out.dirty):
                os.fsync(out.fds[name])
            out.dirty.clear()
            if out.new_files:
                _fsync_dir(self.dst)
                out.new_files = False
            self.journal.append({"units": list(pending)})
            for i, h in pending:
                self.done[i] = h
            pending.clear()
            written = 0
            if self.on_convert:
                self.on_convert(len(self.done), len(plan.units))

        jobs = chain.from_iterable(unit_jobs(self.src, plan, i) for i in ready)
        try:
            with pieces_in_order(jobs, self.threads) as pieces:
                h = xxhash.xxh64()
                for job, buf in pieces:
                    u = plan.units[job.unit]
                    out.write(u.file, job.offset, buf, _what(u))
                    h.update(buf)
                    if job.last:
                        pending.append([job.unit, h.intdigest()])
                        h = xxhash.xxh64()
                        written += u.length
                        if written >= self.commit_bytes:
                            commit()
        finally:
            try:   # whatever finished before an error or interrupt is kept for the next run
                commit()
            except OSError:
                pass

    def _fingerprint(self, st) -> dict:
        files = [self.state.shards[s]["fp"] for s in self.shards]
        skipped = sorted({x for s in self.shards for x in self.state.shards[s]["skipped"]})
        fp = {"config_xxh64": f"{xxhash.xxh64((self.snap / 'config.json').read_bytes()).intdigest():016x}",
              "files": files, "skipped_layers": skipped}
        if self.weight_map is not None:
            fp["index_xxh64"] = f"{xxhash.xxh64((self.snap / INDEX).read_bytes()).intdigest():016x}"
        return fp


class _Fetch:
    """One shard downloading on a daemon thread (an interrupted run does not wait for it to finish)."""

    def __init__(self, run: _Run, name: str, total_dl: int):
        self.path: Path | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._go, args=(run, name, total_dl), daemon=True,
                                       name=f"coli-hub-fetch-{name}")
        self.thread.start()

    def _go(self, run: _Run, name: str, total_dl: int) -> None:
        try:
            self.path = run._download(name, total_dl)
        except BaseException as e:  # noqa: BLE001 - handed to the converting thread
            self.error = e

    def result(self) -> Path:
        self.thread.join()
        if self.error is not None:
            raise self.error
        assert self.path is not None
        return self.path


def convert_hf(ref_text: str, dst: Path, opts: ConvertOptions, **kw) -> HubConvertResult:
    ref = HubRef.parse(ref_text)
    with hub_errors(ref, "converting"):
        return hub_convert(ref, dst, opts, **kw)
