"""What is local: one registry ($COLI_CACHE/models.json, default ~/.cache/coli) of the containers `coli pull`
downloaded and the ones `coli up --model <checkpoint>` converted into its cache, each with its source, format, size
and whether it was verified. `coli models` lists it, `coli models rm` removes an entry (and its files), and
`coli up --model ORG/REPO` finds a pulled container through it. Writes are atomic and under a lock, so two commands
at once cannot lose an entry."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator

from coli.errors import ColiError


@dataclass
class Entry:
    name: str             # ORG/REPO for pulls, the cache directory's name for conversions
    path: str
    kind: str             # "pulled" | "converted"
    source: str           # hf://ORG/REPO@COMMIT, or the checkpoint directory a conversion read
    format: str = ""      # e.g. "experts int4, dense int8"
    size: int = 0
    verified: bool = False
    added: float = 0.0

    @property
    def usable(self) -> bool:
        return self.verified and (Path(self.path) / "coli-manifest.json").is_file()


def home() -> Path:
    return Path(os.environ.get("COLI_CACHE") or os.path.join(os.environ.get("XDG_CACHE_HOME") or
                                                             os.path.expanduser("~/.cache"), "coli"))


def registry_path() -> Path:
    return home() / "models.json"


def _read(path: Path) -> dict[str, Entry]:
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise ColiError(f"{path}: unreadable model registry ({e}); move it away and `coli pull` again") from None
    out = {}
    for d in raw.get("models", []) if isinstance(raw, dict) else []:
        try:
            e = Entry(**d)
        except TypeError:
            continue   # an entry of a newer coli: left out of the listing, not fatal
        out[e.name] = e
    return out


@contextmanager
def _locked() -> Iterator[dict[str, Entry]]:
    """The registry for a read-modify-write under an exclusive lock; written back atomically on exit."""
    path = registry_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        entries = _read(path)
        yield entries
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"models": [asdict(e) for e in sorted(entries.values(), key=lambda e: e.name)]},
                                  indent=1))
        os.replace(tmp, path)


def entries() -> list[Entry]:
    return sorted(_read(registry_path()).values(), key=lambda e: e.name)


def get(name: str) -> Entry | None:
    return _read(registry_path()).get(name)


def put(entry: Entry) -> None:
    entry.added = entry.added or time.time()
    with _locked() as reg:
        reg[entry.name] = entry


def set_verified(name: str, verified: bool) -> None:
    with _locked() as reg:
        if name in reg:
            reg[name].verified = verified


def remove(name: str, delete_files: bool = True) -> Entry:
    with _locked() as reg:
        e = reg.pop(name, None)
        if e is None:
            raise ColiError(f"no local model named {name!r}; `coli models` lists them")
        if delete_files and Path(e.path).exists():
            shutil.rmtree(e.path)
    return e


def dir_size(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total


def describe_format(manifest_args: dict) -> str:
    return f"experts {manifest_args.get('experts', '?')}, dense {manifest_args.get('dense', '?')}"
