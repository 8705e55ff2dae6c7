"""`coli verify DST`: recompute every checksum of a container."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from coli.cli.common import LazyProgress, clean_errors, stderr_note


def verify(
    model: Path = typer.Argument(..., help="Container directory."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    fail_fast: bool = typer.Option(False, "--fail-fast", help="Stop at the first bad record."),
    no_progress: bool = typer.Option(False, "--no-progress", help="No progress bar."),
) -> None:
    """Recompute every checksum (dense tensors, expert records, index, copied files).

    Exit 1 and name the first bad record, its file and offset, when any differs; exit 2 when the container cannot be read at all."""
    _verify(model, as_json, fail_fast, no_progress)


@clean_errors
def _verify(model, as_json, fail_fast, no_progress):
    from coli.container.check import verify_container
    from coli.model_store import check_model_dir

    check_model_dir(model, "")

    if no_progress or as_json:
        rep = verify_container(model, stop_at_first=fail_fast)
    else:
        with LazyProgress("verifying") as bar:   # appears once the container has opened
            rep = verify_container(model, progress=bar.update, stop_at_first=fail_fast)
    if as_json:
        print(json.dumps({"ok": rep.ok, "checked": rep.checked, "bytes": rep.bytes, "mtp_layer": rep.mtp_layer,
                          "bad": [{"file": b.file, "offset": b.offset, "length": b.length, "what": b.what,
                                   "expected_xxh64": f"{b.expected:016x}", "xxh64": f"{b.got:016x}"}
                                  for b in rep.bad]}))
    if rep.ok:
        if not as_json:
            mtp = f"; MTP layer {rep.mtp_layer} included" if rep.mtp_layer is not None else "; no MTP layer"
            print(f"{model}: OK ({rep.checked} checksums, {rep.bytes / 1e9:.3f} GB{mtp})")
        return
    if not as_json:
        typer.secho(f"error: {rep.bad[0].describe()}", err=True, fg=typer.colors.RED)
        if len(rep.bad) > 1:
            stderr_note(f"{len(rep.bad)} bad extents in all; the others:")
            for b in rep.bad[1:10]:
                stderr_note("  " + b.describe())
    raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command("verify")(verify)
