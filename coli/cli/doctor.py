"""`coli doctor`: read-only readiness checks, each pass / warn / fail with the fix (coli/doctor.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from coli.cli.common import clean_errors


def doctor(
    model: Optional[Path] = typer.Option(None, "--model", "-m", help="Also check this container: manifest, sampled "
                                         "checksums, its volume's O_DIRECT read speed, GPU memory for it."),
    ram_gb: float = typer.Option(4.0, "--ram-gb", min=0.0, help="The RAM tier you will ask `coli up` for."),
    http: str = typer.Option("127.0.0.1:8000", "--http", help="[HOST:]PORT `coli serve` will listen on."),
    sample: int = typer.Option(16, "--sample", min=1, help="Expert records whose checksums are recomputed."),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON array."),
) -> None:
    """Check that this machine (and a model) is ready: Python and packages, CUDA driver and PyCUDA, GPU memory,
    locked-memory limit, /dev/shm, free RAM, disk read speed, the container, free ports. Changes nothing."""
    _doctor(model, ram_gb, http, sample, as_json)


@clean_errors
def _doctor(model, ram_gb, http, sample, as_json):
    from coli.cli.serve import parse_http
    from coli.doctor import FAIL, Context, run_checks, to_dicts

    if model is not None and not model.is_dir():
        from coli.errors import ColiError
        raise ColiError(f"--model {model}: no such directory")
    host, port = parse_http(http)
    checks = run_checks(Context(model=model, ram_gb=ram_gb, port=port, host=host, sample=sample))
    if as_json:
        print(json.dumps(to_dicts(checks), indent=1))
    else:
        from rich.console import Console
        from rich.markup import escape
        from rich.table import Table

        style = {"pass": "green", "warn": "yellow", "fail": "red", "skip": "dim"}
        t = Table("check", "status", "found", "fix")
        for c in checks:
            t.add_row(c.name, f"[{style[c.status]}]{c.status}[/]", escape(c.message), escape(c.fix))
        con = Console(highlight=False)
        con.print(t)
        n = {s: sum(c.status == s for c in checks) for s in style}
        con.print(f"{n['pass']} pass, {n['warn']} warn, {n['fail']} fail, {n['skip']} skipped")
    if any(c.status == FAIL for c in checks):
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command("doctor")(doctor)
