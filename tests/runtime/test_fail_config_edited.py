"""A same-size edit of a container's config.json (one byte: the model now has other norms, other
routing, ...) used to be served silently: only the file's size was compared with the manifest. Now
opening the container checks every copied file's xxh64 from the manifest: `coli run` and `coli up`
refuse, naming the file and "rerun `coli convert`", and `coli verify` lists it."""

import subprocess

import pytest

from coli.container.writer import ConvertOptions, convert
from oracles import load_oracle


def edit_one_byte(path):
    raw = bytearray(path.read_bytes())
    i = raw.index(b'"rms_norm_eps"') + len('"rms_norm_eps": ')
    while not chr(raw[i]).isdigit():
        i += 1
    raw[i] = ord("7") if raw[i] != ord("7") else ord("3")   # 1e-06 -> 7e-06: same size, another model
    path.write_bytes(bytes(raw))


@pytest.mark.timeout(240)
def test_edited_config_is_refused_by_run_up_and_verify(default_oracle, start_run, tmp_path):
    o = load_oracle(default_oracle)
    dst = tmp_path / "container"
    convert(default_oracle, dst, ConvertOptions(experts="f32", dense="f32"))
    size = (dst / "config.json").stat().st_size
    edit_one_byte(dst / "config.json")
    assert (dst / "config.json").stat().st_size == size

    run = start_run(dst, wait=False)
    try:
        code = run.proc.wait(60)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"coli up served the edited container:\n{run.output()}") from None
    out = run.output()
    assert code != 0, out
    assert f"{dst / 'config.json'}: contents differ from the manifest" in out and "rerun `coli convert`" in out, out

    ids = ",".join(map(str, o["prompt_ids"]))
    r = run.coli("run", "--model", str(dst), "--prompt-ids", ids, "--max-tokens", "4", "--greedy")
    assert r.returncode != 0
    assert "config.json: contents differ from the manifest" in r.stderr and "rerun `coli convert`" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr

    v = run.coli("verify", str(dst))
    assert v.returncode != 0 and "config.json" in (v.stdout + v.stderr), v.stdout + v.stderr
