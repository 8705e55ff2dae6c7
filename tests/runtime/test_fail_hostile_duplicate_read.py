"""A ReadRequest from another process of the same user that is right in every field: the container's
record of an expert, into the very slot the RAM tier is loading with it (the residency table in /dev/shm
shows which). It passes every field check, yet a duplicate read can land after that slot was published,
used and recycled for another expert, and overwrite it. The reader serves the run's RAM tier alone (its
identity carries the run's secret); the duplicate is refused, the real read lands, the run serves.

The reader is held with SIGSTOP while both requests queue up, so the duplicate is checked while the slot
is still loading (no race in the test)."""

import os
import signal
import time

import pytest

from coli.protocol.arena import Arena
from coli.protocol.messages import ExpertReady, ExpertRelease, ExpertRequest, ReadDone
from coli.stages.ramtier.core import ResidencyTable
from hostile import Intruder, assert_still_serves, container_of, read_request
from oracles import load_oracle


@pytest.mark.timeout(240)
def test_a_read_right_in_every_field_is_served_for_the_ramtier_only(default_oracle, start_run):
    o = load_oracle(default_oracle)
    run = start_run(default_oracle, ram_gb=0.004)
    c = container_of(run)
    cfg = c.config
    E, layer = cfg.n_routed_experts, cfg.moe_layers[-1]
    experts, table_arena = (Arena.attach(n) for n in sorted(run.arenas, key=lambda n: not n.endswith("-experts")))
    table = ResidencyTable(table_arena.slot_view(0), cfg.num_hidden_layers * E, experts.n_slots)
    expert = next(e for e in range(E) if table.slot_of[layer * E + e] < 0)   # not in RAM yet
    asker, dup = Intruder(run, "ramtier", b"asker"), Intruder(run, "reader", b"duplicate")
    reader = run.stage_pids["reader"]
    try:
        os.kill(reader, signal.SIGSTOP)
        try:
            asker.send(ExpertRequest(1, layer, [expert], True))   # the RAM tier starts loading it
            deadline = time.monotonic() + 5
            while table.slot_of[layer * E + expert] < 0 and time.monotonic() < deadline:
                time.sleep(0.005)
            slot = int(table.slot_of[layer * E + expert])
            assert slot >= 0 and table.key_of[slot] == -1, "the RAM tier did not start the load"
            dup.send(read_request(c, layer, expert, slot))
            time.sleep(0.2)
        finally:
            os.kill(reader, signal.SIGCONT)
        (done,) = dup.replies(1)
        (ready,) = asker.replies(1)
        asker.send(ExpertRelease(list(ready.slots)))
    finally:
        asker.close()
        dup.close()
        del table
        for a in (experts, table_arena):
            a.close()
        c.close()
    assert isinstance(done, ReadDone) and not done.ok, done
    assert "served for the run's RAM tier only" in done.error, done.error
    assert isinstance(ready, ExpertReady) and ready.experts == [expert], ready
    assert_still_serves(run, o)
