"""A saved session file that is damaged or hand-edited (tokens "7", a __metadata__ that is a list, one
flipped KV byte) is refused for that request with a bad_request naming the file and what is wrong; it used
to take the executor down (HTTP 503 stage_dead) or, for the flipped byte, be served as a cache of zeros."""

import json

import pytest

from coli.serve.client import Client, RequestError
from oracles import load_oracle
from session_files import edit_header, flip_data_byte, session_file


def _meta(**changes):
    def change(h):
        h["__metadata__"] = {**h["__metadata__"], **changes}
        return h
    return change


def _meta_as_list(h):
    h["__metadata__"] = sorted(h["__metadata__"].items())
    return h


DAMAGE = {  # session -> (edit of its file, what the refusal says)
    "dmg-tokens": (lambda p: edit_header(p, _meta(tokens="7")), "header field tokens must be a list of token ids"),
    "dmg-meta": (lambda p: edit_header(p, _meta_as_list), "__metadata__ must be a map of strings, got list"),
    "dmg-kv": (lambda p: flip_data_byte(p, "1.lat"), "checksum mismatch"),
}


@pytest.mark.timeout(300)
def test_damaged_session_files_are_refused_by_name_and_the_run_keeps_serving(default_oracle, start_run):
    o = load_oracle(default_oracle)
    p1 = o["prompt_ids"]
    run = start_run(default_oracle)
    with Client(run.name, base=str(run.run_base)) as c:
        for name in DAMAGE:
            c.generate(p1, 8, greedy=True, ignore_eos=True, session=name, new_session=True)
    files = {name: session_file(run, name) for name in DAMAGE}     # saved after the turn, not at shutdown
    run.stop()
    for name, (damage, _) in DAMAGE.items():
        damage(files[name])

    again = start_run(default_oracle)
    executor = again.stage_pids["executor"]
    with Client(again.name, base=str(again.run_base)) as c:
        for name, (_, msg) in DAMAGE.items():
            with pytest.raises(RequestError, match=msg) as e:
                c.generate(p1 + [5], 8, greedy=True, ignore_eos=True, session=name)
            assert e.value.code == "bad_request" and str(files[name]) in str(e.value)
        assert c.generate(p1, 32, greedy=True, ignore_eos=True).tokens == o["greedy_tokens"]
    st = json.loads(again.coli("status", "--name", again.name, "--json").stdout)
    assert st["stages"]["executor"]["pid"] == executor and st["stages"]["executor"]["state"] == "ready"
