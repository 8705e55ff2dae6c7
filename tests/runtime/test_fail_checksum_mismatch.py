"""A flipped byte in an expert record: the reader's checksum catches it when the record is loaded,
the request fails naming the file and offset, and the run keeps serving requests that avoid it."""

import json
import shutil

import numpy as np
import pytest

from coli.container.reader import ContainerReader
from coli.container.writer import ConvertOptions, convert
from oracles import load_oracle


@pytest.mark.timeout(240)
def test_corrupt_record_is_caught_on_load(default_oracle, start_run, tmp_path):
    o = load_oracle(default_oracle)
    dst = tmp_path / "container"
    convert(default_oracle, dst, ConvertOptions(experts="f32", dense="f32"))
    # corrupt every record of layer 1 (the first MoE layer): any generation must touch one of them
    r = ContainerReader(dst)
    hit = []
    for e in range(r.config.n_routed_experts):
        loc = r.record_location(1, e)
        with open(loc.path, "r+b") as f:
            f.seek(loc.offset + 100)
            b = f.read(1)
            f.seek(loc.offset + 100)
            f.write(bytes([b[0] ^ 0x40]))
        hit.append(loc)
    r.close()
    run = start_run(dst, ram_gb=0.01)
    ids = ",".join(map(str, o["prompt_ids"]))
    res = run.coli("chat", "--name", run.name, "--prompt-ids", ids, "--max-tokens", "4", "--greedy", "--json")
    assert res.returncode != 0
    assert "checksum mismatch" in res.stderr and "experts-00000.coli @ " in res.stderr, res.stderr
    st = json.loads(run.coli("status", "--name", run.name, "--json").stdout)
    assert all(s["state"] == "ready" for s in st["stages"].values())
    v = run.coli("verify", str(dst))
    assert v.returncode != 0 and "experts-00000.coli" in (v.stdout + v.stderr)
