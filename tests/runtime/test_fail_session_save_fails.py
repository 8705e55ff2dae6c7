"""A session save that fails after a turn (here its file's path is taken by a directory, as a full disk or a
hostile user could make it fail): the turn's tokens arrive, then an `internal` error saying the session was
not saved; the session stays in memory with that turn, and the next turn's save succeeds."""

import pytest

from coli.serve.client import Client, RequestError
from oracles import load_oracle
from session_files import session_file


@pytest.mark.timeout(240)
def test_a_failed_save_fails_the_turn_loudly_and_loses_nothing(default_oracle, start_run):
    o = load_oracle(default_oracle)
    p1, extra = o["prompt_ids"], o["continuation"]["extra_ids"]
    run = start_run(default_oracle)
    with Client(run.name, base=str(run.run_base)) as c:
        t1 = c.generate(p1, 32, greedy=True, ignore_eos=True, session="savefail", new_session=True)
        f = session_file(run, "savefail")
        f.unlink()
        f.mkdir()                                  # even root cannot rename the new file over it
        p2 = p1 + t1.tokens + extra
        got, err = [], None
        try:
            for item in c.stream(p2, 8, greedy=True, ignore_eos=True, session="savefail"):
                got.append(item)
        except RequestError as e:
            err = e
        assert err is not None and err.code == "internal"
        assert "the answer was generated but session 'savefail' could not be saved" in str(err)
        assert got == o["continuation"]["greedy_tokens"][:8]
        f.rmdir()
        t3 = c.generate(p2 + got + [extra[0]], 4, greedy=True, ignore_eos=True, session="savefail")
    assert t3.timing["reused_tokens"] == len(p2) + 7         # turn 2 was kept in memory
    assert f.is_file() and not [x for x in f.parent.iterdir() if ".tmp" in x.name]
