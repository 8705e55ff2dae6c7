"""Helpers for the bench tests (a module of its own: `conftest` names collide across test folders)."""

from __future__ import annotations

from pathlib import Path

from coli.bench.slice import SliceOptions, make_slice


def write_tiny(path: Path, **kw) -> Path:
    """A slice of the `tiny` preset (1 MoE layer unless given), written in a few milliseconds."""
    make_slice(path, SliceOptions(**{"preset": "tiny", "layers": 1, **kw}))
    return path
