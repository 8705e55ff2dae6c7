"""`coli logs`: the merged, time-ordered JSON-line logs of every stage of a run (kept after `coli down`)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Optional

import typer

from coli.cli.common import clean_errors
from coli.errors import ColiError

LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40, "critical": 50}
COLORS = {"debug": "dim", "info": "cyan", "warning": "yellow", "error": "red", "critical": "bold red"}


def parse_line(line: str) -> dict | None:
    try:
        d = json.loads(line)
    except ValueError:
        return None
    return d if isinstance(d, dict) else None


def keep(rec: dict, stage: str | None, level: str | None) -> bool:
    if stage and rec.get("stage") != stage:
        return False
    if level and LEVELS.get(str(rec.get("level", "info")).lower(), 20) < LEVELS[level]:
        return False
    return True


def pretty(rec: dict) -> str:
    """One record as a rich-markup line: time, stage, level, event, then the other fields."""
    from rich.markup import escape

    lvl = str(rec.get("level", "info")).lower()
    if rec.get("event") == "run_started":  # where one run of this name ends and the next begins
        return (f"[bold]──── run {escape(str(rec.get('run', '?')))} started {escape(str(rec.get('date', rec.get('ts', ''))))} "
                f"(supervisor pid {rec.get('supervisor_pid', '?')}, model {escape(str(rec.get('model', '?')))}) ────[/]")
    ts = str(rec.get("ts", ""))[11:23]
    rest = " ".join(f"{k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in rec.items()
                    if k not in ("ts", "stage", "level", "event", "pid"))
    return (f"[dim]{ts}[/] [bold]{escape(str(rec.get('stage', '?'))):>10}[/] [{COLORS.get(lvl, 'white')}]"
            f"{lvl:>7}[/] {escape(str(rec.get('event', '')))} [dim]{escape(rest)}[/]")


def merged(files: list[Path]) -> list[dict]:
    recs = []
    for f in files:
        for line in f.read_text(errors="replace").splitlines():
            r = parse_line(line)
            if r is not None:
                recs.append(r)
    recs.sort(key=lambda r: str(r.get("ts", "")))
    return recs


def logs(
    name: str = typer.Option("default", "--name", help="Run name."),
    stage: Optional[str] = typer.Option(None, "--stage", help="Only this stage (supervisor, reader, ramtier, executor)."),
    level: Optional[str] = typer.Option(None, "--level", help="Minimum level: debug | info | warning | error."),
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing new lines as they are written."),
    tail: Optional[int] = typer.Option(None, "--tail", "-n", help="Only the last N records (after --stage/--level)."),
    as_json: bool = typer.Option(False, "--json", help="Raw JSON lines."),
) -> None:
    """Show the run's logs, merged across stages in time order."""
    _logs(name, stage, level, follow, as_json, tail)


KNOWN_STAGES = ("supervisor", "reader", "ramtier", "executor", "gateway")


@clean_errors
def _logs(name, stage, level, follow, as_json, tail=None):
    from rich.console import Console

    from coli.protocol.rundir import default_base

    if level is not None and level not in LEVELS:
        raise ColiError(f"--level {level!r}: choose from {', '.join(LEVELS)}")
    if tail is not None and tail < 0:
        raise ColiError(f"--tail {tail}: give a number of records >= 0")
    d = default_base() / name / "logs"
    if not d.is_dir():
        raise ColiError(f"no logs for run {name!r} (looked in {d})")
    if stage is not None:
        valid = sorted(set(KNOWN_STAGES) | {f.stem for f in d.glob("*.jsonl")})
        if stage not in valid:
            raise ColiError(f"--stage {stage!r} is not a stage of run {name!r}: choose from {', '.join(valid)}")
    con = Console(highlight=False, soft_wrap=True)

    def show(rec: dict) -> None:
        if keep(rec, stage, level):
            if as_json:
                print(json.dumps(rec), flush=True)
            else:
                con.print(pretty(rec))

    files = sorted(d.glob("*.jsonl"))
    recs = [r for r in merged(files) if keep(r, stage, level)]
    for rec in recs[-tail:] if tail else ([] if tail == 0 else recs):
        show(rec)
    if follow:
        try:
            asyncio.run(_follow(d, {f: f.stat().st_size for f in files}, show))
        except KeyboardInterrupt:
            pass


async def _follow(d: Path, offsets: dict[Path, int], show) -> None:
    import aiofiles

    partial: dict[Path, str] = {}
    while True:
        batch = []
        for f in sorted(d.glob("*.jsonl")):
            pos = offsets.get(f, 0)
            async with aiofiles.open(f, "r", errors="replace") as fh:
                await fh.seek(pos)
                chunk = await fh.read()
                offsets[f] = pos + len(chunk.encode())
            text = partial.pop(f, "") + chunk
            lines = text.split("\n")
            if lines[-1]:
                partial[f] = lines[-1]
            for line in lines[:-1]:
                rec = parse_line(line)
                if rec is not None:
                    batch.append(rec)
        for rec in sorted(batch, key=lambda r: str(r.get("ts", ""))):
            show(rec)
        await asyncio.sleep(0.25)


def register(app: typer.Typer) -> None:
    app.command("logs")(logs)
