"""ExpertRequests from another process of the same user that this run cannot serve: a dense layer (it has
no expert records: the RAM tier used to crash looking one up, taking the run down), a layer past the
model, an expert past the layer. Each is answered with ExpertFailed naming the field; a prefetch of a
dense layer is dropped; the RAM tier keeps serving the exact tokens."""

import pytest

from coli.protocol.messages import ExpertFailed, ExpertRequest
from hostile import Intruder, assert_still_serves, container_of, log_events
from oracles import load_oracle


@pytest.mark.timeout(240)
def test_ramtier_refuses_requests_outside_the_models_experts(default_oracle, start_run):
    o = load_oracle(default_oracle)
    run = start_run(default_oracle, ram_gb=0.0004)
    c = container_of(run)
    cfg = c.config
    c.close()
    dense = next(i for i in range(cfg.num_hidden_layers) if i not in cfg.moe_layers)
    moe = cfg.moe_layers[0]
    spy = Intruder(run, "ramtier")
    try:
        spy.send(ExpertRequest(7, dense, [0, 1], False))   # prefetch: never answered, must not crash either
        spy.send(ExpertRequest(8, dense, [0, 1], True))
        spy.send(ExpertRequest(9, cfg.num_hidden_layers + 5, [0], True))
        spy.send(ExpertRequest(10, moe, [cfg.n_routed_experts], True))
        got = spy.replies(3)
    finally:
        spy.close()
    assert [type(m) for m in got] == [ExpertFailed] * 3, got
    assert [m.request_id for m in got] == [8, 9, 10]
    assert f"field 'layer': layer {dense} is a dense layer" in got[0].reason, got[0].reason
    assert "field 'layer'" in got[1].reason and "out of range" in got[1].reason, got[1].reason
    assert "field 'experts'" in got[2].reason, got[2].reason
    assert_still_serves(run, o)
    assert log_events(run, "ramtier", "expert_request_refused")
