"""The RAM tier's arena as the GPU's host tier (coli.gpu.vram_experts.HostTier): leases through the
executor's RamTierExperts client, bytes read straight from the shared-memory slots (registered once as
pinned memory), speculative probes through the shared residency table without a message."""

from __future__ import annotations

from typing import Callable, Iterator

from coli.gpu.vram_experts import HostRecord
from coli.protocol.arena import Arena
from coli.protocol.messages import SlotRef
from coli.stages.executor.experts import RamTierExperts
from coli.stages.ramtier.core import NO_SLOT, ResidencyTable


class ArenaHostTier:
    def __init__(self, client: RamTierExperts, arena: Arena, table: ResidencyTable, n_experts: int):
        self.client, self.arena, self.table, self.E = client, arena, table, n_experts
        self._base = arena.address()
        self._reclaim: Callable[[], None] | None = None
        idle = client.idle

        def idle_and_reclaim() -> None:
            if self._reclaim is not None:
                self._reclaim()          # copies that landed give their leases back (the tier may be full)
            idle()

        client.idle = idle_and_reclaim

    def _record(self, layer: int, e: int, ref: SlotRef) -> HostRecord:
        arr = self.arena.ref_array(ref)                       # checks the ref stays inside its slot
        addr = self._base + self.arena.slot_offset(ref.slot) + ref.offset
        return HostRecord(layer, e, addr, ref.nbytes, arr, ref)

    def grants(self, layer: int, ids: list[int]) -> Iterator[HostRecord | None]:
        for item in self.client.grants(layer, ids):
            yield None if item is None else self._record(layer, item[0], item[1])

    def release(self, rec: HostRecord) -> None:
        self.client.release(rec.token)

    def probe(self, layer: int, expert: int) -> HostRecord | None:
        key = layer * self.E + expert
        slot, gen = self.table.probe(key)
        if slot == NO_SLOT:
            return None
        n = self.client.layout.nbytes
        ref = SlotRef(self.arena.name, slot, 0, n, gen)
        return self._record(layer, expert, ref)

    def still_valid(self, rec: HostRecord) -> bool:
        ref = rec.token
        return self.table.still_valid(rec.layer * self.E + rec.expert, ref.slot, ref.generation)

    def prefetch(self, layer: int, ids: list[int]) -> None:
        self.client.prefetch(layer, ids)

    def pinned_ranges(self) -> list[tuple[int, int]]:
        return [(self._base, self.arena.mapped_bytes)]

    def reclaim_hook(self, fn: Callable[[], None]) -> None:
        self._reclaim = fn
