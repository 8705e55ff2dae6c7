"""Any exception inside one request (injected after its first token: COLI_INJECT=request_error) becomes a
typed Error for that request naming the cause; the same executor serves the next request, and a session the
failed turn was using comes back as of its last finished turn, not half-written."""

import json

import pytest

from coli.serve.client import Client, RequestError
from failures import inject_seed_for
from oracles import load_oracle


@pytest.mark.timeout(240)
def test_a_failing_request_fails_alone_and_its_session_keeps_the_last_good_turn(default_oracle, start_run):
    o = load_oracle(default_oracle)
    p1, extra = o["prompt_ids"], o["continuation"]["extra_ids"]
    # hits: turn 1 ok, turn 2 fails, plain request ok, turn 2 again ok
    seed = inject_seed_for([False, True, False, False])
    run = start_run(default_oracle, extra_env={"COLI_INJECT": "request_error:0.5", "COLI_INJECT_SEED": str(seed)})
    executor = run.stage_pids["executor"]
    with Client(run.name, base=str(run.run_base)) as c:
        t1 = c.generate(p1, 32, greedy=True, ignore_eos=True, session="raises-a", new_session=True)
        assert t1.tokens == o["greedy_tokens"]
        p2 = p1 + t1.tokens + extra
        with pytest.raises(RequestError, match=r"internal: the executor failed on this request: RuntimeError: "
                                               r"injected request failure") as e:
            c.generate(p2, 32, greedy=True, ignore_eos=True, session="raises-a")
        assert e.value.code == "internal"
        assert c.generate(p1, 32, greedy=True, ignore_eos=True).tokens == o["greedy_tokens"]
        t2 = c.generate(p2, 32, greedy=True, ignore_eos=True, session="raises-a")
    assert t2.tokens == o["continuation"]["greedy_tokens"]
    assert t2.timing["reused_tokens"] == len(p1) + 31           # turn 1 as committed, nothing of the failed one
    st = json.loads(run.coli("status", "--name", run.name, "--json").stdout)
    assert st["stages"]["executor"]["pid"] == executor and st["stages"]["executor"]["state"] == "ready"
