"""Prefetches (ExpertRequest with demand=False: never answered) from another process of the same user,
for every expert of every MoE layer, over and over. On main each one evicted resident experts and
issued disk reads: a silent way to turn every later hit into a miss. Only the run's executor (whose
pilot prefetches) may prefetch now; the others are dropped and logged once, and no read is issued."""

import json
import time

import pytest

from coli.protocol.messages import ExpertRequest
from hostile import Intruder, assert_still_serves, container_of, log_events
from oracles import load_oracle


def ramtier_stats(run) -> dict:
    time.sleep(0.6)  # a stats tick
    return json.loads(run.coli("stats", "--name", run.name, "--once", "--json").stdout)["ramtier"]


@pytest.mark.timeout(240)
def test_foreign_prefetches_are_dropped(default_oracle, start_run):
    o = load_oracle(default_oracle)
    run = start_run(default_oracle, ram_gb=0.004)  # 40 of the 48 experts fit
    c = container_of(run)
    cfg = c.config
    c.close()
    assert_still_serves(run, o)
    before = ramtier_stats(run)
    spy = Intruder(run, "ramtier")
    try:
        for _ in range(20):
            for layer in cfg.moe_layers:
                spy.send(ExpertRequest(1, layer, list(range(cfg.n_routed_experts)), False))
        time.sleep(1.0)
    finally:
        spy.close()
    after = ramtier_stats(run)
    assert after["reads_issued"] == before["reads_issued"], (before, after)
    assert after["evictions"] == before["evictions"], (before, after)
    assert log_events(run, "ramtier", "prefetch_refused")
    assert_still_serves(run, o)
