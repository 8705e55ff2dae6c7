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


def stderr_note(message: str) -> None:
    print(message, file=sys.stderr)
