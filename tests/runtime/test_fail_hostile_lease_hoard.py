"""Another process of the same user asks for a lease on every RAM-tier slot (well-formed ExpertRequests,
one expert each) and keeps them. On main it got them all: no slot could be recycled, the executor's next
miss waited forever and the run stalled with no error. Now peers other than the run's executor (whose
identity carries the run's secret) together hold at most half the slots; the rest of the requests are
refused naming the limit, the run serves the exact tokens meanwhile, and when the hoarder goes away the
RAM tier hears of it (its socket monitor) and gives its leases back."""

import json
import time

import pytest

from coli.protocol.messages import ExpertFailed, ExpertReady, ExpertRequest
from hostile import Intruder, assert_still_serves, container_of
from oracles import load_oracle


def ramtier_stats(run) -> dict:
    return json.loads(run.coli("stats", "--name", run.name, "--once", "--json").stdout).get("ramtier", {})


@pytest.mark.timeout(240)
def test_a_hoarder_gets_half_the_slots_at_most_and_gives_them_back_when_it_goes(default_oracle, start_run):
    o = load_oracle(default_oracle)
    run = start_run(default_oracle, ram_gb=0.0004)
    n_slots = json.loads(run.coli("status", "--name", run.name, "--json").stdout)["ram_slots"]
    c = container_of(run)
    cfg = c.config
    c.close()
    layer = cfg.moe_layers[0]
    assert n_slots <= cfg.n_routed_experts
    hoarder = Intruder(run, "ramtier", b"hoarder")
    try:
        for e in range(n_slots):
            hoarder.send(ExpertRequest(e + 1, layer, [e], True))
        got = hoarder.replies(n_slots, timeout=10)
        granted = [m for m in got if isinstance(m, ExpertReady)]
        refused = [m for m in got if isinstance(m, ExpertFailed)]
        assert len(granted) == n_slots // 2 and len(refused) == n_slots - n_slots // 2, got
        assert f"(at most {n_slots // 2})" in refused[0].reason and "field 'experts'" in refused[0].reason
        assert_still_serves(run, o)  # while the hoarder holds its leases
    finally:
        hoarder.close()
    deadline = time.monotonic() + 10
    while ramtier_stats(run).get("leases_held") != 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ramtier_stats(run).get("leases_held") == 0, "the leases of the peer that went away are still held"
    assert_still_serves(run, o)
