"""The run's own geometry, and the checks of data-plane fields against it.

`messages.py` refuses what no run could accept (a negative slot); this refuses what *this* run cannot
accept: a slot past the arena, a dense layer in an ExpertRequest, a record that is not the container's.
Every stage socket is reachable by any process of the same user, so a well-formed message from a peer
that is not the one the stage expects must cost that peer an error reply, never the run. Each check
returns None or a one-line reason that names the field (`field 'slot': ...`), for the error reply.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple


class RecordSpec(NamedTuple):
    """Where the container's index says a record lies (what a ReadRequest must name exactly)."""

    file: str      # absolute path
    offset: int
    length: int
    checksum: int  # xxh64 of the record's `length` bytes


def _span(values: tuple[int, ...]) -> str:
    if not values:
        return "none"
    if list(values) == list(range(values[0], values[-1] + 1)):
        return f"{values[0]}..{values[-1]}"
    return ", ".join(map(str, values))


@dataclass(frozen=True)
class RunGeometry:
    n_layers: int
    moe_layers: tuple[int, ...]  # layers with routed experts (the others are dense: no records)
    n_experts: int               # routed experts per MoE layer
    n_slots: int                 # arena slots
    slot_bytes: int

    def layer_problem(self, layer: int) -> str | None:
        if layer in self.moe_layers:
            return None
        if 0 <= layer < self.n_layers:
            return f"field 'layer': layer {layer} is a dense layer (MoE layers are {_span(self.moe_layers)})"
        return f"field 'layer': {layer} is out of range (the model has layers 0..{self.n_layers - 1})"

    def experts_problem(self, experts: list[int]) -> str | None:
        bad = [e for e in experts if not 0 <= e < self.n_experts]
        if bad:
            return f"field 'experts': {bad[0]} is out of range (experts 0..{self.n_experts - 1})"
        return None

    def slot_problem(self, slot: int, field: str = "slot") -> str | None:
        if 0 <= slot < self.n_slots:
            return None
        return f"field '{field}': slot {slot} is out of range (the arena has slots 0..{self.n_slots - 1})"

    def expert_request_problem(self, layer: int, experts: list[int]) -> str | None:
        return self.layer_problem(layer) or self.experts_problem(experts)

    def read_request_problem(self, layer: int, expert: int, slot: int, file: str, offset: int, length: int,
                             checksum: int, record_of: Callable[[int, int], RecordSpec]) -> str | None:
        """A ReadRequest must name a slot of the arena and exactly the container's record of (layer,
        expert): its file, offset, length and checksum. `file` is resolved by the caller."""
        why = self.layer_problem(layer) or self.experts_problem([expert]) or self.slot_problem(slot)
        if why:
            return why.replace("field 'experts'", "field 'expert'")
        want = record_of(layer, expert)
        for name, got, need in (("file", file, want.file), ("offset", offset, want.offset),
                                ("length", length, want.length), ("checksum", checksum, want.checksum)):
            if got != need:
                shown = (f"{got:016x}", f"{need:016x}") if name == "checksum" else (got, need)
                return (f"field '{name}': {shown[0]} is not the container's record of layer {layer} expert "
                        f"{expert} ({name} {shown[1]})")
        if length > self.slot_bytes:
            return f"field 'length': {length} B does not fit a {self.slot_bytes} B slot"
        return None
