"""Helpers shared by the CLI commands: clean error reporting and argument parsing."""

from __future__ import annotations

import functools
import sys
from typing import Callable, TypeVar

import typer

from coli.errors import ColiError

F = TypeVar("F", bound=Callable)


def fail(message: str, code: int = 2) -> None:
    typer.secho(f"error: {message}", err=True, fg=typer.colors.RED)
    raise typer.Exit(code)


def clean_errors(fn: F) -> F:
    """Report ColiError (and bad values) as one line on stderr with exit code 2, not a traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (ColiError, ValueError) as e:
            fail(str(e))
        except KeyboardInterrupt:
            typer.echo("", err=True)
            raise typer.Exit(130)

    return wrapper  # type: ignore[return-value]


def require_device(device: str) -> None:
    """Refuse --device gpu where PyCUDA is not installed, before any stage starts (found without importing it:
    only the GPU stage imports PyCUDA). A driver or device problem is still reported by the GPU stage."""
    import importlib.util

    if device in ("gpu", "cuda") and importlib.util.find_spec("pycuda") is None:
        raise ColiError(f"--device {device}: PyCUDA is not installed: pip install -e '.[gpu]' in a clone (or pip install "
                        f"'colistream[gpu]'; needs a CUDA driver), or use --device cpu")


class LazyProgress:
    """A rich progress bar on stderr that appears at the first progress report, not before: bad input is found
    before any work is reported, so its error stays one line with no empty bar above it."""

    def __init__(self, label: str, eta: bool = False):
        from rich.console import Console

        self.label, self.eta = label, eta
        self.console = Console(stderr=True)
        self._bar = self._task = None

    def update(self, done: int, total: int) -> None:
        if self._bar is None:
            from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                                       TransferSpeedColumn)
            cols = [TextColumn(self.label), BarColumn(), DownloadColumn(), TransferSpeedColumn()]
            self._bar = Progress(*cols, *([TimeRemainingColumn()] if self.eta else []), console=self.console)
            self._bar.start()
            self._task = self._bar.add_task(self.label, total=total)
        self._bar.update(self._task, completed=done, total=total)

    def print(self, message: str) -> None:
        self.console.print(message, highlight=False, markup=False)

    def __enter__(self) -> "LazyProgress":
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()


def parse_ids(text: str, option: str = "--prompt-ids") -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t != ""]
    except ValueError:
        raise ColiError(f"{option} must be comma-separated integers, got {text!r}") from None
    if not ids:
        raise ColiError(f"{option} is empty")
    if any(i < 0 for i in ids):
        raise ColiError(f"{option} holds a negative id: {text!r}")
    return ids


def sampling_from_options(greedy: bool, temperature: float | None, top_p: float, top_k: int, seed: int | None):
    """The CLI's sampling options as SamplingParams: greedy unless a sampling option is given; temperature 0
    means greedy (as in the OpenAI API); --greedy with a sampling option is a contradiction."""
    from coli.model.sampling import SamplingParams

    if temperature is not None and temperature < 0:
        raise ColiError(f"--temperature must be >= 0 (got {temperature}; 0 means greedy)")
    sampling = bool(temperature) or top_p != 1.0 or top_k != 0
    if greedy and sampling:
        raise ColiError("--greedy cannot be combined with --temperature/--top-p/--top-k")
    params = SamplingParams(greedy=not sampling, temperature=temperature or 1.0, top_p=top_p, top_k=top_k, seed=seed)
    params.validate()
    return params


def stderr_note(message: str) -> None:
    print(message, file=sys.stderr)
