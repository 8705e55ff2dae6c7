"""`coli pull ORG/REPO[@REVISION] [DIR]`: download a published container, verify it, register it (coli/hub/pull.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from coli.cli.common import clean_errors, stderr_note


def pull(
    repo: str = typer.Argument(..., metavar="ORG/REPO[@REVISION]", help="A ColiStream container on the Hub."),
    dest: Optional[Path] = typer.Argument(None, metavar="[DIR]", help="Where to put it (default: "
                                          "$COLI_CACHE/models/ORG--REPO--COMMIT)."),
    no_progress: bool = typer.Option(False, "--no-progress", help="No progress bars."),
) -> None:
    """Download a published ColiStream container (every file; progress of bytes, rate, ETA), verify every checksum
    of its manifest, and register it so `coli up --model ORG/REPO` finds it. Interrupted? Run it again: files
    already there are kept. Logs in with HF_TOKEN or `hf auth login`; HF_ENDPOINT picks another Hub."""
    _pull(repo, dest, no_progress)


@clean_errors
def _pull(repo, dest, no_progress):
    from coli.hub.progress import human_bytes, transfer_bars
    from coli.hub.pull import pull as run_pull

    with transfer_bars(not no_progress, ("downloading", "bytes"), ("verifying", "bytes")) as (note, dl, vf):
        r = run_pull(repo, dest, report=note, on_download=dl, on_verify=vf)
    stderr_note(f"{r.name}: verified ({r.checked} checksums, {human_bytes(r.size)}) at {r.path}; downloaded "
                f"{human_bytes(r.downloaded)}. Serve it with `coli up --model {r.name}`")


def register(app: typer.Typer) -> None:
    app.command("pull")(pull)
