"""`coli plan --gpus` (issue 18): the per-GPU placement, slot pools, hand-offs and the cold-token ceiling with one
link per GPU, as text and as JSON, balanced from a recorded routing trace, and bad input refused in one line naming
the option (or the GPU). Real CLI processes; no GPU is needed (budgets and links given, or `nvidia-smi` absent)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from coli.trace import write_trace
from coli.traces_synth import glm52

GB = 1e9


def coli(*args, timeout=60):
    # PATH without nvidia-smi: detection finds no GPU on any machine, so the tests do not depend on the host
    env = dict(os.environ, PATH="/nonexistent", COLUMNS="200", NO_COLOR="1")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return subprocess.run([sys.executable, "-m", "coli.cli.main", "plan", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def one_error(r) -> str:
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in r.stderr, r.stderr
    return lines[0]


@pytest.mark.timeout(60)
def test_glm5_on_two_gpus_prints_each_gpus_share_and_the_ceiling():
    r = coli("--preset", "glm5", "--dense", "int4", "--gpus", "0,1", "--vram-gb", "16,24", "--pcie-gbps", "55")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "GPU 0 16 GB (given), link 55.00 GB/s (given); GPU 1 24 GB (given)" in out
    assert "routed experts by expert id (cold ceiling of one sequence 1.58x one GPU's against 1.00x)" in out
    assert "dense core whole on GPU 1" in out                      # the larger budget holds it
    assert "one GPU (GPU 0's link alone): 4.57 tok/s" in out       # 55 GB/s / (600 x 20.05 MB)
    assert "one sequence:                  7.20 tok/s  (1.58x one GPU)" in out
    assert "2+ sequences in flight:        9.14 tok/s  (2.00x one GPU" in out
    assert "compared: by layer: 1.00x one sequence, 1.97x pipelined" in out
    assert "747 slots" in out and "571 slots" in out


@pytest.mark.timeout(60)
def test_json_plan_adds_up_and_keeps_the_gpu_order():
    r = coli("--preset", "glm5", "--dense", "int4", "--gpus", "1,0", "--vram-gb", "24,16", "--pcie-gbps", "55,25",
             "--partition", "layer", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    p = d["plan"]
    assert p["partition"] == "layer" and p["dense"] == "split" and d["chosen_because"] == "--partition layer"
    assert [g["index"] for g in p["gpus"]] == [1, 0] and [g["vram_budget"] for g in p["gpus"]] == [24 * GB, 16 * GB]
    assert [g["link_gbps"] for g in p["gpus"]] == [55.0, 25.0] and d["sources"]["0"]["vram"] == "given"
    owner = np.asarray(p["owner"])
    assert owner.shape == (75, 256) and (owner == owner[:, :1]).all()
    for g in p["gpus"]:
        assert g["reserve"] + g["dense_core"] + g["kv_cache"] + g["expert_slot_bytes"] + g["free"] == g["vram_budget"]
        assert g["experts_owned"] == int((owner == g["index"]).sum())
    assert sum(g["dense_core"] for g in p["gpus"]) == p["model"]["dense_bytes"]
    # the 55 GB/s GPU takes about 55/80 of the layers
    assert abs(p["gpus"][0]["experts_owned"] / 256 - 75 * 55 / 80) <= 1
    assert p["handoffs"]["crossings"] == 1


@pytest.mark.timeout(60)
def test_a_recorded_trace_balances_the_experts(tmp_path):
    idx, w = glm52(120, 3, n_experts=16, top_k=4, seed=2)
    path = tmp_path / "tiny.trace"
    write_trace(path, idx, w, n_experts=16, moe_layers=[1, 2, 3])
    r = coli("--preset", "tiny", "--gpus", "0,1", "--vram-gb", "2", "--pcie-gbps", "25", "--trace", str(path),
             "--partition", "expert", "--json")
    assert r.returncode == 0, r.stderr
    p = json.loads(r.stdout)["plan"]
    assert p["routing"] == "trace (120 tokens)"
    owner = np.asarray(p["owner"])
    want = [(owner[np.arange(3)[None, :, None], idx] == g).sum() / 120 for g in (0, 1)]
    assert [g["copies_per_token"] for g in p["gpus"]] == pytest.approx(want, rel=1e-12)
    other = tmp_path / "other.trace"
    write_trace(other, np.zeros((4, 3, 4), np.int32), n_experts=32, moe_layers=[1, 2, 3])
    line = one_error(coli("--preset", "tiny", "--gpus", "0,1", "--vram-gb", "2", "--pcie-gbps", "25", "--trace",
                          str(other)))
    assert f"--trace {other}: recorded for 3 MoE layers x 32 experts, top-4; this model has 3 x 16, top-4" in line
    line = one_error(coli("--preset", "tiny", "--gpus", "0,1", "--vram-gb", "2", "--pcie-gbps", "25", "--trace",
                          str(tmp_path / "missing.trace")))
    assert "missing.trace: no such file" in line


@pytest.mark.parametrize("args,needle", [
    (["--gpus", "0,0", "--vram-gb", "16"], "error: --gpus '0,0': GPU 0 is listed twice"),
    (["--gpus", "x"], "error: --gpus 'x': 'x' is not a GPU index (give indices like 0,1 or auto)"),
    (["--gpus", "0,1", "--vram-gb", "16,24,32", "--pcie-gbps", "55"],
     "error: --vram-gb '16,24,32' gives 3 values for 2 GPUs"),
    (["--gpus", "0,1", "--vram-gb", "16", "--pcie-gbps", "55,25,25"], "error: --pcie-gbps '55,25,25' gives 3 values"),
    (["--vram-gb", "16,24"], "error: --vram-gb '16,24' gives 2 values: one value per GPU needs --gpus"),
    (["--gpus", "0,1", "--vram-gb", "0", "--pcie-gbps", "55"], "error: --vram-gb '0': each value must be > 0"),
    (["--gpus", "auto", "--vram-gb", "16"], "error: --gpus auto: no GPU is visible (nvidia-smi not found"),
    (["--gpus", "0,1", "--pcie-gbps", "55"], "error: --gpus: GPU 0 is not visible (visible GPUs: none"),
    (["--gpus", "0,1", "--vram-gb", "16,3", "--pcie-gbps", "55", "--partition", "layer"],
     "error: GPU 1: its share needs"),
    (["--gpus", "0,1", "--vram-gb", "2", "--pcie-gbps", "55"], "error: by layer: GPU 0: its share needs"),
    (["--gpus", "0,1", "--vram-gb", "16", "--pcie-gbps", "55", "--partition", "diagonal"],
     "error: --partition must be layer, expert or auto, got 'diagonal'"),
    (["--gpus", "0,1", "--vram-gb", "16", "--pcie-gbps", "55", "--ram-gb", "64"],
     "error: --ram-gb is not used with --gpus (the RAM tier and disk are shared by the GPUs)"),
    (["--gpus", "0,1", "--vram-gb", "16,24", "--pcie-gbps", "55", "--dense-placement", "half"],
     "--dense-placement must be one of auto, whole, split, got 'half'"),
])
@pytest.mark.timeout(60)
def test_bad_input_is_one_line_naming_the_culprit(args, needle):
    line = one_error(coli("--preset", "glm5", "--dense", "int4", *args))
    assert needle in line, line


@pytest.mark.timeout(180)
def test_a_container_is_placed_from_its_manifest_sizes(tmp_path):
    from coli.config import load_config
    from coli.container.format import MANIFEST_NAME, parse_manifest
    from coli.container.writer import ConvertOptions, convert
    from coli.model_store import DEMO_DIR
    from coli.plan import dense_core_parts

    if not (DEMO_DIR / "config.json").is_file():
        pytest.skip("demo model not built")
    dst = tmp_path / "demo-int8"
    convert(DEMO_DIR, dst, ConvertOptions(experts="int4", dense="int8", group=64), report=lambda m: None)
    m = parse_manifest(dst / MANIFEST_NAME)
    r = coli("--model", str(dst), "--gpus", "0,1", "--vram-gb", "2", "--pcie-gbps", "25", "--partition", "layer",
             "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    p = d["plan"]
    assert d["model_source"].startswith("container") and p["model"]["record_bytes"] == m.record.nbytes
    # dense.coli also holds the demo's MTP layer (after the main tensors), which is not placed
    mtp = sum(e.length for n, e in m.dense.items() if n.startswith("model.layers.4."))
    assert mtp > 0 and sum(g["dense_core"] for g in p["gpus"]) == m.dense_file.size - mtp
    embed, layers, head = dense_core_parts(load_config(DEMO_DIR), "int8", 64)
    for g in p["gpus"]:     # the container's dense file is what its layout code predicts, layer by layer
        mine = [i for i, h in enumerate(p["home"]) if h == g["index"]]
        assert g["dense_core"] == sum(layers[i] for i in mine) + embed * g["embedding"] + head * g["lm_head"]
