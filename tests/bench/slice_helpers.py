"""Helpers for the bench tests (a module of its own: `conftest` names collide across test folders)."""

from __future__ import annotations

from pathlib import Path

from coli.bench.slice import SliceOptions, make_slice
from coli.model.forward import WeightExperts


def write_tiny(path: Path, **kw) -> Path:
    """A slice of the `tiny` preset (1 MoE layer unless given), written in a few milliseconds."""
    make_slice(path, SliceOptions(**{"preset": "tiny", "layers": 1, **kw}))
    return path


class AskedExperts(WeightExperts):
    """The model's expert source, recording (layer, ids) for each stream() call: which experts a decode asked for."""

    def __init__(self, weights):
        super().__init__(weights)
        self.asked: list[tuple[int, list[int]]] = []

    def stream(self, layer, ids):
        self.asked.append((layer, list(ids)))
        return super().stream(layer, ids)
