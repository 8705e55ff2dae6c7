"""Progress rows for downloads (bytes, rate, ETA) and conversions, on stderr; plain notes when turned off."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator


def human_bytes(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


@contextmanager
def transfer_bars(enabled: bool, *rows: tuple[str, str]) -> Iterator[tuple[Callable, ...]]:
    """Yields (note, update_row_1, update_row_2, ...): note(message) prints a line above the bars; update(done,
    total) moves a row. A row is (label, "bytes" | "units")."""
    from coli.cli.common import stderr_note

    if not enabled:
        yield (stderr_note, *[(lambda d, t: None) for _ in rows])
        return
    from rich.console import Console
    from rich.progress import (BarColumn, DownloadColumn, MofNCompleteColumn, Progress, TextColumn,
                               TimeRemainingColumn, TransferSpeedColumn)

    console = Console(stderr=True)
    # The bars appear at the first progress report, not before: input is checked before any work is reported,
    # so an error about it stays one line with no empty bars above it.
    bar = Progress(TextColumn("{task.description:<12}"), BarColumn(), TextColumn("{task.fields[amount]}"),
                   TextColumn("{task.fields[rate]}"), TimeRemainingColumn(), console=console)
    started = []
    tasks, updates = [], []
    dl, speed, mofn = DownloadColumn(), TransferSpeedColumn(), MofNCompleteColumn()
    for label, kind in rows:
        t = bar.add_task(label, total=None, amount="", rate="")
        tasks.append(t)

        def update(done: int, total: int, t=t, kind=kind) -> None:
            if not started:
                bar.start()
                started.append(True)
            bar.update(t, completed=done, total=total or None)
            task = bar.tasks[t]
            if kind == "bytes":
                bar.update(t, amount=dl.render(task), rate=speed.render(task))
            else:
                bar.update(t, amount=mofn.render(task))
        updates.append(update)
    try:
        yield (lambda m: console.print(m, soft_wrap=True, highlight=False), *updates)
    finally:
        if started:
            bar.stop()
