"""`coli models` / `coli models rm NAME`: what is local (pulled containers and `coli up`'s conversion cache)."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from coli.cli.common import clean_errors, stderr_note

app = typer.Typer(help="List or remove local models: containers from `coli pull` and the conversions `coli up "
                       "--model <checkpoint>` keeps in its cache.", invoke_without_command=True,
                  no_args_is_help=False)


@app.callback()
def models(ctx: typer.Context,
           as_json: bool = typer.Option(False, "--json", help="One JSON object per line.")) -> None:
    """List every local model: name, size, format, source, verified, path."""
    if ctx.invoked_subcommand is None:
        _list(as_json)


def _rows() -> list[dict]:
    from coli.hub import registry
    from coli.model_store import cache_root

    rows = [{**e.__dict__, "verified": e.verified, "present": Path(e.path).is_dir()} for e in registry.entries()]
    known = {Path(r["path"]).resolve() for r in rows}
    root = cache_root()
    if root.is_dir():   # conversions an older coli made before the registry: listed so they can be removed
        for d in sorted(p for p in root.iterdir() if p.is_dir() and p.resolve() not in known):
            rows.append({"name": d.name, "path": str(d), "kind": "converted", "source": "unknown (older coli)",
                         "format": "", "size": registry.dir_size(d), "verified": False, "present": True})
    return rows


@clean_errors
def _list(as_json: bool) -> None:
    rows = _rows()
    if as_json:
        for r in rows:
            print(json.dumps(r))
        return
    if not rows:
        stderr_note("no local models yet: `coli pull ORG/REPO` downloads a container; `coli up --model DIR` "
                    "converts a checkpoint into the cache")
        return
    from rich.console import Console
    from rich.table import Table

    from coli.hub.progress import human_bytes

    t = Table(box=None, pad_edge=False)
    for col in ("NAME", "SIZE", "FORMAT", "SOURCE", "VERIFIED", "PATH"):
        t.add_column(col, overflow="fold")
    for r in rows:
        ver = "yes" if r["verified"] else "no"
        if not r["present"]:
            ver = "missing"
        t.add_row(r["name"], human_bytes(r["size"]), r["format"], r["source"], ver, r["path"])
    Console(width=200).print(t)


@app.command("rm")
def rm(name: str = typer.Argument(..., help="A NAME from `coli models`."),
       keep_files: bool = typer.Option(False, "--keep-files", help="Forget it, but leave its directory.")) -> None:
    """Remove a local model: its registry entry and (unless --keep-files) its directory."""
    _rm(name, keep_files)


@clean_errors
def _rm(name: str, keep_files: bool) -> None:
    import shutil

    from coli.errors import ColiError
    from coli.hub import registry

    if registry.get(name) is not None:
        e = registry.remove(name, delete_files=not keep_files)
        stderr_note(f"removed {name}" + ("" if keep_files else f" ({e.path})"))
        return
    for r in _rows():
        if r["name"] == name:   # an unregistered conversion in the cache
            if not keep_files:
                shutil.rmtree(r["path"])
            stderr_note(f"removed {name} ({r['path']})")
            return
    raise ColiError(f"no local model named {name!r}; `coli models` lists them")


def register(root: typer.Typer) -> None:
    root.add_typer(app, name="models")
