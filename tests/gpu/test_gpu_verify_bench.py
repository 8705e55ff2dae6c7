"""`coli bench stream --verify` on the CUDA backend, end to end on a tiny 2-layer slice (seconds, before the GLM-5
slice's minutes): on the warm and cold-ram engines every verify step's greedy tokens are those of its positions run
one at a time, the cache is back at its length after each step, cold-ram copies each expert of a step's union once
and nothing falls back to the CPU; the MTP rows, the acceptance and auto's choice are there."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu


def test_gpu_bench_stream_verify_rows(tmp_path, monkeypatch):
    """COLI_VERIFY_GRAPHS=0: the eager verify steps, the reference the replayed ones are held to."""
    monkeypatch.setenv("COLI_VERIFY_GRAPHS", "0")
    from coli.bench.slice import SliceOptions, make_slice
    from coli.bench.stream import run_scenarios
    d = tmp_path / "s2"
    make_slice(d, SliceOptions(preset="tiny", layers=2, trace="uniform", tokens=64, seed=5))
    res = run_scenarios(d, ["warm", "cold-ram"], tokens=4, peer=False, report=lambda s: None, verify=[1, 2, 4])
    steps = res["verify"]["steps"]
    assert [(r["scenario"], r.get("positions"), r.get("run", True)) for r in steps] == [
        (s, S, True) for s in ("warm", "cold-ram") for S in (1, 2, 4)], [r.get("reason") for r in steps]
    for r in steps:
        assert r["verify_equals_one_by_one"] is True and r["cache_restored"] is True, r
        assert r["step_s_glm5"] > 0 and r["distinct_experts_per_layer_step"]["mean"] > 0
    for r in steps[3:]:
        assert r["union_copied_once"] is True and r["cpu_fallbacks"] == 0, r
    assert [(m["scenario"], m["drafts"]) for m in res["verify"]["mtp"]] == [
        ("warm", 1), ("warm", 3), ("cold-ram", 1), ("cold-ram", 3)]
    for a in res["verify"]["acceptance"].values():
        assert a["speedup_glm5"] > 0 and a["auto"]["choice"] in ("on", "off")
        assert (a["auto"]["choice"] == "off") == a["auto"]["mtp_would_lose"]


def test_gpu_bench_stream_verify_rows_replayed_from_graphs(tmp_path, monkeypatch):
    """COLI_VERIFY_GRAPHS=1: the warm engine's timed verify steps are replayed (coli/gpu/verify_graphs.py), with the
    tokens of the positions one at a time; cold-ram's stream their experts, so they run eagerly and say why."""
    from coli.bench.slice import SliceOptions, make_slice
    from coli.bench.stream import run_scenarios
    monkeypatch.setenv("COLI_VERIFY_GRAPHS", "1")
    d = tmp_path / "s2"
    make_slice(d, SliceOptions(preset="tiny", layers=2, trace="uniform", tokens=64, seed=6))
    res = run_scenarios(d, ["warm", "cold-ram"], tokens=4, peer=False, report=lambda s: None, verify=[1, 2, 4])
    assert res["verify"]["replay"] is True
    for r in res["verify"]["steps"]:
        assert r["verify_equals_one_by_one"] is True and r["replayed_equals_one_by_one"] is True, r
        assert r["cache_restored"] is True
        if r["scenario"] == "warm":
            assert r["replays"] >= 4 and r["eager_reason"] is None, r          # every timed step replayed
        else:
            assert r["replays"] == 0 and "stream" in r["eager_reason"], r
