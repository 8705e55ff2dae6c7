"""Control messages from another process of the same user on the stages' own sockets: a Shutdown to
each stage (it used to stop that stage, and with it the run), a Hello claiming to be the supervisor,
and the same from a peer that takes the supervisor's old fixed identity b"supervisor". The stages take
control only from the supervisor's per-run secret identity (handed over at spawn): all are refused and
logged, and the run keeps serving. (`coli down` stays what stops a run: it talks to the supervisor.)"""

import time

import pytest

from coli.protocol.handshake import make_hello
from coli.protocol.messages import GenerateRequest, Shutdown
from hostile import Intruder, assert_still_serves, log_events
from oracles import load_oracle

STAGES = ("reader", "ramtier", "executor")


@pytest.mark.timeout(240)
def test_stages_take_control_only_from_their_supervisor(default_oracle, start_run):
    o = load_oracle(default_oracle)
    run = start_run(default_oracle, ram_gb=0.0004)
    spies = [Intruder(run, stage, identity) for stage in STAGES for identity in (b"intruder", b"supervisor")]
    try:
        for spy in spies:
            spy.send(make_hello("supervisor"))
            spy.send(Shutdown("hostile"))
        greeted = [m for spy in spies for m in spy.replies(1, timeout=0.5)]
        time.sleep(1.0)
    finally:
        for spy in spies:
            spy.close()
    assert greeted == [], greeted  # no stage answered a fake supervisor's Hello
    assert_still_serves(run, o)
    for stage in STAGES:
        errs = " ".join(r.get("error", "") for r in log_events(run, stage, "protocol_error"))
        assert "Shutdown refused" in errs, f"{stage}: {errs}"
        assert "Hello as the supervisor refused" in errs, f"{stage}: {errs}"


@pytest.mark.timeout(240)
def test_executor_takes_requests_only_through_the_supervisor(default_oracle, start_run):
    o = load_oracle(default_oracle)
    run = start_run(default_oracle, ram_gb=0.0004)
    spy = Intruder(run, "executor")
    try:
        spy.send(GenerateRequest("direct-1", list(o["prompt_ids"]), 4, 0.0, 1.0, 0, None, True, True))
        got = spy.replies(1, timeout=3.0)
    finally:
        spy.close()
    assert got == [], got  # served only what came through the supervisor's checks and queue
    assert_still_serves(run, o)
    errs = " ".join(r.get("error", "") for r in log_events(run, "executor", "protocol_error"))
    assert "GenerateRequest refused" in errs, errs
