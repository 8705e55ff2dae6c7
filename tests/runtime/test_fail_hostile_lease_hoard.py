"""Another process of the same user takes leases on every RAM-tier slot (well-formed ExpertRequests)
and goes away without releasing them. The leases used to stay for the rest of the run: no slot could be
recycled, the executor's next miss waited forever and the run stalled with no error. Now the RAM tier
hears of the disconnect (its socket monitor) and gives the peer's leases back; the run serves the exact
tokens."""

import json

import pytest

from coli.protocol.messages import ExpertReady, ExpertRequest
from hostile import Intruder, assert_still_serves, container_of
from oracles import load_oracle


@pytest.mark.timeout(240)
def test_leases_of_a_peer_that_left_go_back(default_oracle, start_run):
    o = load_oracle(default_oracle)
    run = start_run(default_oracle, ram_gb=0.0004)
    st = json.loads(run.coli("status", "--name", run.name, "--json").stdout)
    n_slots = st["ram_slots"]
    c = container_of(run)
    cfg = c.config
    c.close()
    layer = cfg.moe_layers[0]
    assert n_slots <= cfg.n_routed_experts
    hoarder = Intruder(run, "ramtier", b"hoarder")
    try:
        hoarder.send(ExpertRequest(1, layer, list(range(n_slots)), True))
        got = hoarder.replies(n_slots, timeout=10)
        granted = sum(len(m.experts) for m in got if isinstance(m, ExpertReady))
    finally:
        hoarder.close()  # gone, every slot still leased to it
    assert granted == n_slots, got
    assert_still_serves(run, o)
