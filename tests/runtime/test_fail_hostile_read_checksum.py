"""ReadRequests from another process of the same user that name live RAM-tier slots (each holding a
published expert the executor computes from): one with a wrong checksum, one with the exact record of
another expert. Both used to be read straight into the slot (the checksum was checked after the bytes
had landed): the slot held another expert's weights under its old name and the run served different
tokens with no error. Now the reader refuses both before a byte moves, naming the field, and a read
only ever fills a slot the RAM tier is loading with that very expert."""

import numpy as np
import pytest
import xxhash

from coli.protocol.arena import Arena
from coli.protocol.messages import ReadDone
from coli.stages.ramtier.core import ResidencyTable
from hostile import Intruder, assert_still_serves, container_of, read_request
from oracles import load_oracle


@pytest.mark.timeout(240)
def test_live_slot_is_never_overwritten(default_oracle, start_run):
    o = load_oracle(default_oracle)
    run = start_run(default_oracle, ram_gb=1.0)  # every expert fits: after one request they stay resident
    assert_still_serves(run, o)
    c = container_of(run)
    E = c.config.n_routed_experts
    experts, table_arena = (Arena.attach(n) for n in sorted(run.arenas, key=lambda n: not n.endswith("-experts")))
    table = ResidencyTable(table_arena.slot_view(0), c.config.num_hidden_layers * E, experts.n_slots)
    live = [(s, int(table.key_of[s])) for s in range(experts.n_slots) if table.key_of[s] >= 0]
    assert live, "the warm-up request left no expert resident"
    spy = Intruder(run, "reader")
    try:
        for s, key in live:
            layer, e = divmod(key, E)
            other = (e + 1) % E
            wrong = read_request(c, layer, other, s).checksum ^ 0x5A5A
            spy.send(read_request(c, layer, other, s, checksum=wrong))
            spy.send(read_request(c, layer, other, s))
        got = spy.replies(2 * len(live))
    finally:
        spy.close()
    assert len(got) == 2 * len(live) and all(isinstance(m, ReadDone) and not m.ok for m in got), got
    assert "field 'checksum'" in got[0].error, got[0].error
    assert "field 'slot'" in got[1].error and "never overwritten" in got[1].error, got[1].error
    for s, key in live:  # every published slot still holds exactly its own record
        loc = c.record_location(*divmod(key, E))
        assert xxhash.xxh64_intdigest(np.asarray(experts.slot_array(s)[:loc.length])) == loc.xxh64, (s, key)
    del table
    for a in (experts, table_arena):
        a.close()
    c.close()
    assert_still_serves(run, o)
