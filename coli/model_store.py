"""Where `coli up` gets its container from: a ColiStream container is used in place; a name `coli models` lists
(a pulled ORG/REPO) is looked up in the registry; a Hugging Face checkpoint is converted once into the cache with
`coli convert`'s defaults (--experts int4 --dense int8) unless told otherwise, and registered there with its source.
The built-in demo model is converted lossless (f32): its tokens are the reference the tests and the README quote.

The cache key is the checkpoint's content (config, index, every shard's size and header, the small files the
container copies) and the options, never a modification time: touching config.json finds the same entry, and an
edit that changes the content replaces the stale entry of the same checkpoint and options."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Callable

from coli.errors import ColiError

DEMO_DIR = Path(__file__).resolve().parent / "demo" / "model"


def cache_root() -> Path:
    from coli.hub.registry import home
    return home() / "containers"


def content_fingerprint(src: Path) -> str:
    """What a conversion of src depends on, cheaply: not the shards' data (hashing ~756 GB on each `coli up` would
    cost more than it protects), but their sizes and headers, as the converter's own resume check does."""
    from coli.container.writer import _copy_names
    from coli.weights import find_shards

    h = hashlib.sha256()
    for name in sorted(set(_copy_names(src)) | {"config.json", "model.safetensors.index.json"}):
        p = src / name
        if p.is_file():
            h.update(f"{name}\0".encode() + hashlib.sha256(p.read_bytes()).digest())
    shards, _ = find_shards(src)
    for p in shards:
        with open(p, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            head = f.read(min(n, 100 << 20))
        h.update(f"{p.name}\0{p.stat().st_size}\0".encode() + hashlib.sha256(head).digest())
    return h.hexdigest()[:16]


def unfinished_conversion(d: Path) -> str | None:
    """The error for a directory `coli convert` was writing when it stopped (its journal, no manifest yet), naming
    what to rerun (for a conversion from the Hub, its hf:// source); None for anything else."""
    import json

    from coli.container.format import JOURNAL_NAME, MANIFEST_NAME
    from coli.hub.journal import JOURNAL

    if (d / MANIFEST_NAME).is_file():
        return None
    if (d / JOURNAL).is_file():
        try:
            head = json.loads((d / JOURNAL).read_bytes().split(b"\n", 1)[0])
            ref = head["repo"] + (f"@{head['revision']}" if head.get("revision") else "")
        except (OSError, ValueError, KeyError, TypeError):
            ref = "ORG/REPO"
        return f"{d} is an unfinished conversion: rerun `coli convert hf://{ref} {d}` with its options to resume it"
    if not (d / JOURNAL_NAME).is_file():
        return None
    from coli.container.writer import Journal
    try:
        head, sums = Journal.read(d / JOURNAL_NAME)
    except Exception:   # noqa: BLE001 -- a torn journal is still an unfinished conversion; convert repairs it
        head, sums = None, []
    args = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in ((head or {}).get("args") or {}).items())
    return (f"{d} is an unfinished conversion ({len(sums)} units done): rerun `coli convert SRC {d}"
            f"{' ' + args if args else ''}` to resume it")


def check_model_dir(d: str | Path, option: str = "--model", names: bool = False) -> Path:
    """A model directory a command is given, or a one-line error naming what is wrong with it. With `names`, a
    path that does not exist may be the name of a pulled or converted model (`coli models`): its directory."""
    d = Path(d)
    lead = f"{option} " if option else ""
    if not d.exists():
        if names:
            return lookup(str(d), option)
        raise ColiError(f"{lead}{d} does not exist (no such directory)")
    if not d.is_dir():
        raise ColiError(f"{lead}{d}: not a directory (give the model's directory)")
    why = unfinished_conversion(d)
    if why:
        raise ColiError(lead + why)
    return d


def lookup(model: str, option: str = "--model") -> Path:
    """A name from the registry (`coli pull ORG/REPO`), usable only once verified."""
    from coli.hub import registry

    lead = f"{option} " if option else ""
    e = registry.get(model)
    if e is None:
        raise ColiError(f"{lead}{model} does not exist: no such directory, and no local model of that name "
                        f"(`coli models` lists them; `coli pull ORG/REPO` downloads a published container)")
    if not e.usable:
        raise ColiError(f"{lead}{model}: {e.path} is not verified (a pull was interrupted or found damage); "
                        f"rerun `coli pull {model}`")
    return Path(e.path)


def resolve_container(model: str | Path | None, report: Callable[[str], None] = print,
                      experts: str | None = None, dense: str | None = None,
                      progress: Callable[[int, int], None] | None = None) -> Path:
    from coli.container.format import MANIFEST_NAME
    from coli.container.writer import ConvertOptions, convert
    from coli.hub import registry

    src = DEMO_DIR if model is None else check_model_dir(model, names=True)
    if (src / MANIFEST_NAME).is_file():
        return src
    if not (src / "config.json").is_file():
        raise ColiError(f"{src} is neither a ColiStream container nor a Hugging Face checkpoint (no config.json)")
    demo = src.resolve() == DEMO_DIR.resolve()   # however it is named, the demo stays exact
    opts = ConvertOptions(experts=experts or ("f32" if demo else ConvertOptions.experts),
                          dense=dense or ("f32" if demo else ConvertOptions.dense))
    opts.validate()
    name = f"{'demo' if demo else src.resolve().name}-{opts.experts}-{opts.dense}-{content_fingerprint(src)}"
    dst = cache_root() / name
    source = "built-in demo model" if demo else str(src.resolve())
    fmt = registry.describe_format(opts.to_dict())
    if not (dst / MANIFEST_NAME).is_file():
        for old in registry.entries():   # the same checkpoint and options, converted before its content changed
            if old.kind == "converted" and old.source == source and old.format == fmt and old.name != name:
                registry.remove(old.name)
                report(f"removed the stale conversion {old.path} ({src} changed since)")
        dst.parent.mkdir(parents=True, exist_ok=True)
        _check_room(src, dst, opts)
        report(f"converting {src} into a container at {dst} (--experts {opts.experts} --dense {opts.dense}; once; "
               f"`coli models` lists it, `coli models rm {name}` removes it)")
        convert(src, dst, opts, report=report, progress=progress)
    if registry.get(name) is None:
        registry.put(registry.Entry(name, str(dst), "converted", source, fmt, registry.dir_size(dst), True))
    return dst


def _check_room(src: Path, dst: Path, opts) -> None:
    """Refuse before writing when the cache's disk cannot hold the container (a resumed one: what is left)."""
    import shutil

    from coli.config import load_config
    from coli.container.writer import make_plan
    from coli.hub.progress import human_bytes
    from coli.hub.registry import dir_size

    need = make_plan(load_config(src), opts).total_bytes - (dir_size(dst) if dst.is_dir() else 0)
    free = shutil.disk_usage(dst.parent).free
    if need > free:
        raise ColiError(f"converting {src} for --model needs {human_bytes(need)} in {dst.parent}, "
                        f"{human_bytes(free)} free: free space, point COLI_CACHE at a larger disk, or choose a "
                        f"smaller --experts/--dense")

