"""A sessions directory that cannot be written: every new session is refused up front with a bad_request
naming the directory and the setting, and the run goes on serving; it used to keep 16 sessions in memory and
die on the 17th (the spill to disk), taking the 16 with it."""

import json

import pytest

from coli.serve.client import Client, RequestError
from oracles import load_oracle


@pytest.mark.timeout(300)
def test_new_sessions_are_refused_when_the_directory_is_unwritable(default_oracle, start_run, rt_root):
    import tempfile
    from pathlib import Path
    o = load_oracle(default_oracle)
    cache = Path(tempfile.mkdtemp(prefix="unwritable-", dir=rt_root))
    (cache / "sessions").write_text("a file where the sessions directory should be")   # refuses even root
    run = start_run(default_oracle, extra_env={"COLI_CACHE": str(cache)})
    executor = run.stage_pids["executor"]
    with Client(run.name, base=str(run.run_base)) as c:
        for i in range(17):
            with pytest.raises(RequestError, match=r"sessions directory .* is not writable .*\$COLI_CACHE") as e:
                c.generate(o["prompt_ids"], 4, greedy=True, session=f"unw-{i}", new_session=True)
            assert e.value.code == "bad_request"
        assert c.generate(o["prompt_ids"], 32, greedy=True, ignore_eos=True).tokens == o["greedy_tokens"]
    st = json.loads(run.coli("status", "--name", run.name, "--json").stdout)
    assert st["stages"]["executor"]["pid"] == executor and st["stages"]["executor"]["state"] == "ready"
