"""Where `coli up` gets its container from: the built-in demo model or a Hugging Face checkpoint are
converted once (lossless f32, so served tokens match the reference exactly) into a cache directory;
a ColiStream container is used in place."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Callable

from coli.errors import ColiError

DEMO_DIR = Path(__file__).resolve().parent / "demo" / "model"


def cache_root() -> Path:
    base = os.environ.get("COLI_CACHE") or os.path.join(os.environ.get("XDG_CACHE_HOME") or
                                                        os.path.expanduser("~/.cache"), "coli")
    return Path(base) / "containers"


def _fingerprint(src: Path) -> str:
    h = hashlib.sha256(str(src.resolve()).encode())
    for p in sorted(src.iterdir()):
        if p.is_file():
            st = p.stat()
            h.update(f"{p.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def unfinished_conversion(d: Path) -> str | None:
    """The error for a directory `coli convert` was writing when it stopped (its journal, no manifest yet), naming
    the options it was started with; None for anything else."""
    from coli.container.format import JOURNAL_NAME, MANIFEST_NAME

    if (d / MANIFEST_NAME).is_file() or not (d / JOURNAL_NAME).is_file():
        return None
    from coli.container.writer import Journal
    try:
        head, sums = Journal.read(d / JOURNAL_NAME)
    except Exception:   # noqa: BLE001 -- a torn journal is still an unfinished conversion; convert repairs it
        head, sums = None, []
    args = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in ((head or {}).get("args") or {}).items())
    return (f"{d} is an unfinished conversion ({len(sums)} units done): rerun `coli convert SRC {d}"
            f"{' ' + args if args else ''}` to resume it")


def check_model_dir(d: str | Path, option: str = "--model") -> Path:
    """A model directory a command is given, or a one-line error naming what is wrong with it."""
    d = Path(d)
    lead = f"{option} " if option else ""
    if not d.exists():
        raise ColiError(f"{lead}{d} does not exist (no such directory)")
    if not d.is_dir():
        raise ColiError(f"{lead}{d}: not a directory (give the model's directory)")
    why = unfinished_conversion(d)
    if why:
        raise ColiError(lead + why)
    return d


def resolve_container(model: str | Path | None, report: Callable[[str], None] = print,
                      experts: str = "f32", dense: str = "f32") -> Path:
    from coli.container.format import MANIFEST_NAME
    from coli.container.writer import ConvertOptions, convert

    src = DEMO_DIR if model is None else check_model_dir(model)
    if (src / MANIFEST_NAME).is_file():
        return src
    if not (src / "config.json").is_file():
        raise ColiError(f"{src} is neither a ColiStream container nor a Hugging Face checkpoint (no config.json)")
    name = "demo" if model is None else src.resolve().name
    dst = cache_root() / f"{name}-{experts}-{dense}-{_fingerprint(src)}"
    if (dst / MANIFEST_NAME).is_file():
        return dst
    dst.parent.mkdir(parents=True, exist_ok=True)
    report(f"converting {src} into a container at {dst} (--experts {experts} --dense {dense}; once)")
    convert(src, dst, ConvertOptions(experts=experts, dense=dense), report=report)
    return dst
