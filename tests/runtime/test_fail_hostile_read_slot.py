"""20 well-formed ReadRequests naming slot 10**9, sent to the reader by another process of the same user:
each is refused at once with a ReadDone naming the field (they used to raise inside the read pool, never
answer, and fill the pool's 16 places: the reader wedged silently and every later miss hung), and the
run keeps serving the exact tokens through a RAM tier that must read from disk all the time."""

import pytest

from hostile import Intruder, assert_still_serves, container_of, log_events, read_request
from oracles import load_oracle
from coli.protocol.messages import ReadDone


@pytest.mark.timeout(240)
def test_reader_refuses_slot_out_of_range_and_keeps_reading(default_oracle, start_run):
    o = load_oracle(default_oracle)
    run = start_run(default_oracle, ram_gb=0.0004)  # fewer slots than one layer's experts: constant reads
    c = container_of(run)
    layer = c.config.moe_layers[0]
    c.close()
    spy = Intruder(run, "reader")
    try:
        for i in range(20):
            spy.send(read_request(c, layer, i % c.config.n_routed_experts, 10**9))
        got = spy.replies(20)
    finally:
        spy.close()
    assert len(got) == 20 and all(isinstance(m, ReadDone) and not m.ok for m in got), got
    assert "field 'slot': slot 1000000000 is out of range" in got[0].error, got[0].error
    assert_still_serves(run, o)
    assert log_events(run, "reader", "read_request_refused")
