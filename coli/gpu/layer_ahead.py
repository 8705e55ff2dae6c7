"""Layer-ahead copies for long prefills (issue 15 §1): once a MoE layer's step has asked for nearly every expert of
its layer, the next MoE layer will too (a prompt of hundreds of tokens routes to every expert: docs/runtime.md), so
there is nothing to predict -- its experts go on the speculative copy lane at once, and copy while this layer's last
experts compute and the next layer's attention runs, when the demand lane is idle. The demand step of the next layer
then finds them resident (or takes over the copy in flight: VramExperts' handoff) and copies only the rest.

An expert source wrapper around a VramExperts, off unless asked for (`coli bench stream --prefill-ahead`, measured
first: docs/perf-notes.md "TTFT"). The decision is the pure `ahead_of`; the copies are VramExperts.prefetch's, so
they need its `speculate` on and a `spec_budget` of a layer's experts (a governor sized for decode's guesses would
allow one or two)."""

from __future__ import annotations

from typing import Any, Iterator

AHEAD_FRACTION = 0.75     # a step that asks for at least this share of a layer's experts is a long prefill


def ahead_of(layer: int, asked: int, moe_layers: list[int], n_experts: int,
             fraction: float = AHEAD_FRACTION) -> tuple[int, list[int]] | None:
    """(next MoE layer, every expert of it) when `layer`'s step asked for >= fraction of its n_experts; None for a
    short step or the forward's last MoE layer."""
    if asked < fraction * n_experts:
        return None
    later = [m for m in moe_layers if m > layer]
    if not later:
        return None
    return later[0], list(range(n_experts))


class LayerAhead:
    """ExpertSource: `vx.stream(layer, ids)`, then, once the step's experts are all handed out (its copies issued),
    `vx.prefetch` of the next MoE layer's experts when ahead_of says so. Counts the layers it copied ahead for."""

    def __init__(self, vx, moe_layers: list[int], n_experts: int, fraction: float = AHEAD_FRACTION):
        self.vx, self.moe_layers, self.E, self.fraction = vx, list(moe_layers), int(n_experts), float(fraction)
        self.layers_ahead = 0

    def stream(self, layer: int, ids: list[int]) -> Iterator[Any]:
        yield from self.vx.stream(layer, ids)
        nxt = ahead_of(layer, len(ids), self.moe_layers, self.E, self.fraction)
        if nxt is not None:
            self.layers_ahead += 1
            self.vx.prefetch(*nxt)
