"""`coli plan`: GLM-5 sizes from the converter's own layout code, placements whose parts add up to each tier,
per-token expert counts and bytes that add up, tokens/s bounds that follow from them, refusals that say what
to change (and which dense format fits), CPU-path compute counted from a measured rate, and container sizes read
from a real manifest (equal to what the plan predicts before converting)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from coli.config import preset
from coli.plan import (DEFAULT_DENSE, GB, Hardware, PlanOptions, dense_core_bytes, make_plan, sizes_from_config,
                       sizes_from_container)

XB = 20_054_016  # one GLM-5 expert at int4 g64 (reference glm5.md §7)


def coli(*args, env=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "coli.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.fixture(scope="module")
def glm5():
    return sizes_from_config(preset("glm5"), "preset glm5", dense="int4")


def test_glm5_sizes_match_the_reference(glm5):
    assert glm5.expert_bytes == XB
    assert glm5.moe_layers == 75 and glm5.experts_per_layer == 256 and glm5.experts_per_token == 8
    assert glm5.routed_bytes == 75 * 256 * XB and round(glm5.routed_bytes / GB, 2) == 385.04
    assert round(glm5.dense_bytes_all_quantized / GB, 2) == 10.17  # every dense weight at int4 g64
    # as converted: routers, norms and indexer heads stay f32 (the router alone is 75 x 256 x 6144 x 4 B)
    assert 10.17 * GB < glm5.dense_bytes < 10.17 * GB + 75 * 256 * 6144 * 4 + 0.01 * GB
    assert glm5.kv_values_per_token == 54_912 and glm5.max_context == 202_752


def check_sums(p: dict) -> None:
    """Every identity the plan must satisfy."""
    for tier in ("vram", "ram"):
        t = p[tier]
        assert t["reserve"] + t["dense_core"] + t["kv_cache"] + t["expert_slots"] + t["free"] == t["total"], tier
        assert min(t.values()) >= 0, tier
    s, xb = p["slots"], p["model"]["expert_bytes"]
    assert p["vram"]["expert_slots"] == s["vram"] * xb and p["ram"]["expert_slots"] == s["ram"] * xb
    assert s["ram_pinned"] + s["ram_lru"] == s["ram"]
    if p["ok"]:
        assert p["vram"]["free"] < xb or s["vram"] == s["experts_total"]  # slots fill what is left
        assert p["ram"]["free"] < xb or s["ram"] == s["experts_total"]
    L = p["model"]["moe_layers"]
    assert math.isclose(s["vram_per_layer"] * L, s["vram"]) and math.isclose(s["ram_per_layer"] * L, s["ram"])
    pt = p["per_token"]
    X = p["model"]["experts_per_token"] * L
    assert pt["routed_experts"] == X
    assert math.isclose(pt["vram_hits"] + pt["ram_hits"] + pt["disk_reads"], X)
    assert math.isclose(pt["routed_bytes"], X * xb)
    assert math.isclose(pt["bytes_from_disk"], pt["disk_reads"] * xb)
    hw, tps = p["hardware"], p["tokens_per_s"]
    assert math.isclose(tps["all_cold_disk"], hw["disk_gbps"] * GB / (X * xb))
    assert math.isclose(pt["disk_s"], pt["bytes_from_disk"] / (hw["disk_gbps"] * GB))
    if p["device"] == "gpu":
        assert math.isclose(pt["bytes_over_pcie"], (pt["ram_hits"] + pt["disk_reads"]) * xb)
        assert math.isclose(tps["all_cold_pcie"], hw["pcie_gbps"] * GB / (X * xb))
        assert math.isclose(pt["pcie_s"], pt["bytes_over_pcie"] / (hw["pcie_gbps"] * GB))
    else:
        assert pt["bytes_over_pcie"] == 0 and tps["all_cold_pcie"] is None
    if tps["expected"] is not None:
        assert math.isclose(tps["expected"], 1 / max(pt["disk_s"], pt["pcie_s"], pt["compute_s"]))
        compute_bound = tps["cpu_compute"] if tps["cpu_compute"] is not None else math.inf
        assert tps["expected"] >= min(tps["all_cold_disk"], compute_bound) * (1 - 1e-12)
        assert tps["expected"] <= compute_bound * (1 + 1e-12)
    if p["device"] == "gpu":
        assert pt["compute_s"] == 0 and tps["cpu_compute"] is None
    kv = p["kv"]
    assert kv["bytes"] == kv["bytes_per_token"] * kv["context"]
    assert kv["bytes_per_token"] == kv["values_per_token"] * {"bf16": 2, "fp32": 4}[kv["dtype"]]
    if p["device"] == "gpu" and p["ok"]:
        assert p["vram"]["kv_cache"] == kv["bytes"]


def test_glm5_16gb_vram_64gb_ram_numbers_add_up(glm5):
    p = make_plan(glm5, Hardware(vram_gb=16, ram_gb=64, disk_gbps=6.0, pcie_gbps=25.0)).to_dict()
    assert p["ok"] and p["device"] == "gpu" and not p["problems"]
    check_sums(p)
    assert p["vram"]["dense_core"] == glm5.dense_bytes and p["vram"]["total"] == 16 * GB
    assert p["kv"]["bytes"] == 54_912 * 2 * 8192
    assert p["slots"]["vram"] == (16 * GB - 1 * GB - glm5.dense_bytes - 54_912 * 2 * 8192) // XB
    assert p["slots"]["ram"] == (64 * GB - 4 * GB) // XB
    # uniform routing: 600 experts per token, VRAM holds ~2.3 of 256 per layer, RAM ~39.9
    pt = p["per_token"]
    assert math.isclose(pt["hit_rate_vram"], p["slots"]["vram"] / 75 / 256)
    assert math.isclose(pt["hit_rate_ram_or_vram"], p["slots"]["ram"] / 75 / 256)
    assert round(p["tokens_per_s"]["all_cold_disk"], 3) == round(6e9 / (600 * XB), 3) == 0.499
    assert p["tokens_per_s"]["expected_bound_by"] == "disk"


@pytest.mark.timeout(60)
def test_cli_prints_the_glm5_placement_and_its_json_adds_up():
    r = coli("plan", "--preset", "glm5", "--vram-gb", "16", "--ram-gb", "64", "--dense", "int4")
    assert r.returncode == 0, r.stderr
    out = " ".join(r.stdout.split())
    for text in ("VRAM 16.00 GB", "RAM 64.00 GB", "dense core (resident)", "10.63 GB", "expert slots",
                 "KV cache (8,192 tokens)", "all cold from disk: 0.50 tok/s", "all cold over PCIe: 2.08 tok/s",
                 "expected:", "uniform, independent routing", "10.17 GB if every weight were int4 g64"):
        assert text in out, text
    j = coli("plan", "--preset", "glm5", "--vram-gb", "16", "--ram-gb", "64", "--dense", "int4", "--json")
    p = json.loads(j.stdout)
    check_sums(p)
    assert p["hardware"]["sources"]["vram"] == "given" and p["hardware"]["sources"]["disk"].startswith("assumed")


@pytest.mark.parametrize("args,needle", [
    (("--vram-gb", "8", "--ram-gb", "64", "--dense", "int4"), "Use a GPU with at least 13 GB"),
    (("--vram-gb", "8", "--ram-gb", "64"), "Use a GPU with at least 22 GB"),
    (("--vram-gb", "12", "--ram-gb", "64", "--dense", "int4"), "No dense format fits: even --dense int4 (10.63 GB)"),
    (("--vram-gb", "16", "--ram-gb", "4.1"), "Raise --ram-gb to at least 5"),
    (("--vram-gb", "16", "--ram-gb", "64", "--context", "300000"), "lower --context"),
    (("--vram-gb", "16", "--ram-gb", "64", "--context", "65536", "--kv-dtype", "fp32"), "--kv-dtype bf16"),
    (("--vram-gb", "0", "--ram-gb", "12"), "plan with a GPU"),
])
@pytest.mark.timeout(60)
def test_refuses_plans_that_cannot_run_and_says_what_to_change(args, needle):
    r = coli("plan", "--preset", "glm5", *args, "--disk-gbps", "6", "--pcie-gbps", "25")
    assert r.returncode == 2
    assert needle in " ".join(r.stderr.split()), r.stderr
    j = coli("plan", "--preset", "glm5", *args, "--disk-gbps", "6", "--pcie-gbps", "25", "--json")
    p = json.loads(j.stdout)
    assert not p["ok"] and p["problems"]
    check_sums(p)


def test_cpu_path_keeps_dense_core_and_kv_in_ram(glm5):
    p = make_plan(glm5, Hardware(vram_gb=0, ram_gb=128, disk_gbps=7.0, pcie_gbps=25.0),
                  PlanOptions(context=4096)).to_dict()
    assert p["ok"] and p["device"] == "cpu"
    check_sums(p)
    # the numpy backend dequantises the whole dense core to float32 once, whatever the container's --dense
    assert p["ram"]["dense_core"] == 4 * glm5.dense_params == 4 * 19_135_487_232
    assert p["ram"]["kv_cache"] == 54_912 * 2 * 4096
    assert p["vram"]["total"] == 0 and p["slots"]["vram"] == 0


def test_plan_defaults_to_the_dense_format_convert_writes():
    from coli.container.writer import ConvertOptions

    assert DEFAULT_DENSE == ConvertOptions().dense
    j = coli("plan", "--preset", "glm5", "--vram-gb", "24", "--ram-gb", "64", "--json")
    assert j.returncode == 0, j.stderr
    p = json.loads(j.stdout)
    assert p["model"]["dense_format"] == DEFAULT_DENSE
    assert p["model"]["dense_bytes"] == dense_core_bytes(preset("glm5"), DEFAULT_DENSE)


@pytest.mark.timeout(60)
def test_16gb_with_convert_defaults_refuses_and_names_the_dense_format_that_fits(glm5):
    r = coli("plan", "--preset", "glm5", "--vram-gb", "16", "--ram-gb", "64", "--disk-gbps", "6", "--pcie-gbps", "25")
    assert r.returncode == 2
    err = " ".join(r.stderr.split())
    assert "the dense core (19.55 GB, int8)" in err and "need 21.77 GB" in err, err
    slots = int((16 * GB - 1 * GB - glm5.dense_bytes - 54_912 * 2 * 8192) // XB)
    assert f"The dense core fits at --dense int4 (10.63 GB, leaving {slots:,} expert slots)" in err, err
    assert "coli convert SRC DST --dense int4" in err
    p = json.loads(coli("plan", "--preset", "glm5", "--vram-gb", "16", "--ram-gb", "64", "--disk-gbps", "6",
                        "--pcie-gbps", "25", "--json").stdout)
    assert p["dense_fits"] == {"bf16": None, "int8": None, "int4": slots}
    # the format it names really fits, with exactly those slots
    ok = make_plan(glm5, Hardware(vram_gb=16, ram_gb=64, disk_gbps=6, pcie_gbps=25)).to_dict()
    assert ok["ok"] and ok["slots"]["vram"] == slots


def test_cpu_path_is_bound_by_compute_when_numpy_is_slower_than_the_disk(glm5):
    hw = Hardware(vram_gb=0, ram_gb=128, disk_gbps=6.0, pcie_gbps=25.0, cpu_expert_s=0.2, cpu_gemv_gbps=3.0)
    p = make_plan(glm5, hw, PlanOptions(context=4096)).to_dict()
    check_sums(p)
    pt, tps = p["per_token"], p["tokens_per_s"]
    compute = 600 * 0.2 + 4 * glm5.dense_params_per_token / 3e9     # experts + the float32 dense core, no embedding
    assert glm5.dense_params_per_token == glm5.dense_params - 154_880 * 6144
    assert math.isclose(pt["compute_s"], compute) and math.isclose(tps["cpu_compute"], 1 / compute)
    assert tps["expected_bound_by"] == "compute" and math.isclose(tps["expected"], 1 / compute)
    assert tps["expected"] < tps["all_cold_disk"] / 50    # the transfer-only figure promised ~100x too much
    # a CPU fast enough leaves the disk as the bound
    fast = make_plan(glm5, Hardware(vram_gb=0, ram_gb=128, disk_gbps=6.0, pcie_gbps=25.0, cpu_expert_s=1e-6,
                                    cpu_gemv_gbps=1e6), PlanOptions(context=4096)).to_dict()
    check_sums(fast)
    assert fast["tokens_per_s"]["expected_bound_by"] == "disk"


@pytest.mark.timeout(60)
def test_cli_cpu_plan_measures_the_numpy_expert_rate_here():
    j = coli("plan", "--preset", "tiny", "--vram-gb", "0", "--ram-gb", "8", "--disk-gbps", "6", "--json")
    assert j.returncode == 0, j.stderr
    p = json.loads(j.stdout)
    check_sums(p)
    hw, c = p["hardware"], preset("tiny")
    assert hw["sources"]["cpu"].startswith(f"measured: one {c.moe_intermediate_size} x {c.hidden_size} int4 matrix")
    assert hw["cpu_expert_s"] > 0 and hw["cpu_gemv_gbps"] > 0
    assert p["tokens_per_s"]["cpu_compute"] is not None and p["per_token"]["compute_s"] > 0
    r = coli("plan", "--preset", "tiny", "--vram-gb", "0", "--ram-gb", "8", "--disk-gbps", "6")
    assert "CPU compute:" in r.stdout and "ms per routed expert" in " ".join(r.stdout.split())


def test_everything_cached_means_no_transfers():
    tiny = sizes_from_config(preset("tiny"), "tiny", experts="f32", dense="f32")
    p = make_plan(tiny, Hardware(vram_gb=2, ram_gb=8, disk_gbps=1, pcie_gbps=1), PlanOptions(context=1024)).to_dict()
    check_sums(p)
    assert p["slots"]["vram"] == p["slots"]["experts_total"] and p["tokens_per_s"]["expected"] is None
    assert p["per_token"]["disk_reads"] == 0 and p["warnings"]


@pytest.mark.timeout(180)
def test_container_sizes_come_from_the_manifest_and_match_the_prediction(tmp_path):
    from coli.config import load_config
    from coli.container.writer import ConvertOptions, convert
    from coli.model_store import DEMO_DIR

    if not (DEMO_DIR / "config.json").is_file():
        pytest.skip("demo model not built")
    dst = tmp_path / "demo-int4"
    convert(DEMO_DIR, dst, ConvertOptions(experts="int4", dense="int4", group=64), report=lambda m: None)
    real = sizes_from_container(dst)
    predicted = sizes_from_config(load_config(DEMO_DIR), "demo", "int4", "int4", 64)
    from coli.container.format import MANIFEST_NAME, parse_manifest
    m = parse_manifest(dst / MANIFEST_NAME)
    assert real.expert_bytes == m.record.nbytes == predicted.expert_bytes
    # dense.coli also holds the demo's MTP layer (after the main tensors): the plan's dense core is the rest
    mtp = sum(e.length for n, e in m.dense.items() if n.startswith("model.layers.4."))
    assert mtp > 0 and "MTP layer" in real.source
    assert real.dense_bytes == m.dense_file.size - mtp == predicted.dense_bytes
    r = coli("plan", "--model", str(dst), "--vram-gb", "2", "--ram-gb", "5", "--pcie-gbps", "25", "--json")
    assert r.returncode == 0, r.stderr
    p = json.loads(r.stdout)
    check_sums(p)
    assert p["model"]["source"].startswith("container") and p["hardware"]["sources"]["disk"].startswith("measured")
