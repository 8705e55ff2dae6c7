"""An ExpertRelease from another process of the same user for a slot leased to someone else (the
residency table in /dev/shm tells anyone which slot and generation hold which expert). The RAM tier
used to take any release of a leased slot: the lease went back, the slot could be recycled while its
holder still computed from it. Now only the peer that holds a lease can give it back: the holder's slot
keeps its expert and generation through a run of evictions, and the run serves the exact tokens."""

import pytest

from coli.protocol.arena import Arena
from coli.protocol.messages import ExpertReady, ExpertRelease, ExpertRequest
from coli.stages.ramtier.core import ResidencyTable
from hostile import Intruder, assert_still_serves, container_of, log_events
from oracles import load_oracle


@pytest.mark.timeout(240)
def test_only_the_holder_releases_a_lease(default_oracle, start_run):
    o = load_oracle(default_oracle)
    run = start_run(default_oracle, ram_gb=0.0004)  # a few slots: the chat below evicts all the others
    c = container_of(run)
    cfg = c.config
    c.close()
    E, layer = cfg.n_routed_experts, cfg.moe_layers[0]
    holder, thief = Intruder(run, "ramtier", b"holder"), Intruder(run, "ramtier", b"thief")
    experts, table_arena = (Arena.attach(n) for n in sorted(run.arenas, key=lambda n: not n.endswith("-experts")))
    table = ResidencyTable(table_arena.slot_view(0), cfg.num_hidden_layers * E, experts.n_slots)
    try:
        holder.send(ExpertRequest(1, layer, [0], True))
        (ready,) = holder.replies(1)
        assert isinstance(ready, ExpertReady), ready
        ref = ready.slots[0]
        thief.send(ExpertRelease([ref]))
        thief.send(ExpertRelease([ref]))
        assert_still_serves(run, o)  # every other slot is recycled meanwhile
        kept = bool(table.still_valid(layer * E + 0, ref.slot, ref.generation))
        holder.send(ExpertRelease([ref]))
    finally:
        holder.close()
        thief.close()
        del table
        for a in (experts, table_arena):
            a.close()
    assert kept, "the held slot was recycled: another peer's release freed its lease"
    assert log_events(run, "ramtier", "release_refused")
    assert_still_serves(run, o)
