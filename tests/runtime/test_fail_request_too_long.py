"""A request the context cannot hold (max_tokens 10**11, a 4,500-token prompt on a 4,096 context) is refused
at the supervisor with one clear bad_request, through `coli chat` as over HTTP; the executor never sizes a
cache from it (it used to allocate 23 TiB and take the run down) and the run goes on serving."""

import json

import pytest

from coli.serve.client import Client, RequestError
from oracles import load_oracle


@pytest.mark.timeout(240)
def test_requests_beyond_the_context_are_refused_and_the_run_keeps_serving(default_oracle, start_run):
    o = load_oracle(default_oracle)
    run = start_run(default_oracle)
    ids = o["prompt_ids"]
    n = len(ids)
    executor = run.stage_pids["executor"]

    r = run.coli("chat", "--name", run.name, "--prompt-ids", ",".join(map(str, ids)), "--max-tokens",
                 "100000000000", "--greedy", "--json", timeout=60)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert f"plus max_tokens (100000000000) is {100000000000 + n} tokens, over the model's context of 4096" in r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1

    long_prompt = ",".join([str(ids[0])] * 4500)
    r = run.coli("chat", "--name", run.name, "--prompt-ids", long_prompt, "--max-tokens", "4", "--greedy", timeout=60)
    assert r.returncode == 2 and "the prompt is 4500 tokens but the model's context is 4096 tokens" in r.stderr, r.stderr

    with Client(run.name, base=str(run.run_base)) as c:
        with pytest.raises(RequestError, match=r"ask for at most 1: --max-tokens") as e:
            c.generate([ids[0]] * 4095, 2)
        assert e.value.code == "bad_request"
        # the run is whole: the same executor serves the oracle's tokens
        assert c.generate(ids, 32, greedy=True, ignore_eos=True).tokens == o["greedy_tokens"]
    st = json.loads(run.coli("status", "--name", run.name, "--json").stdout)
    assert all(s["state"] == "ready" for s in st["stages"].values())
    assert st["stages"]["executor"]["pid"] == executor
