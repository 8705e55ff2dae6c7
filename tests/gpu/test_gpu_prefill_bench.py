"""`coli bench stream --prefill` on the CUDA backend, end to end on a tiny 2-layer slice (seconds, before the GLM-5
slice's minutes): the cold-ram and budget engines time each prompt length, cold-ram copies exactly the union of the
prompt's experts (each once: retention off), nothing falls back to the CPU, and the TTFT figures are there with the
warm engine's compute beside them."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu


def test_gpu_bench_stream_prefill_rows(tmp_path):
    from coli.bench.slice import SliceOptions, make_slice
    from coli.bench.stream import run_scenarios
    from coli.bench.trace_router import TRACE_NAME
    from coli.container.reader import ContainerReader
    from coli.trace import read_trace
    d = tmp_path / "s2"
    make_slice(d, SliceOptions(preset="tiny", layers=2, trace="uniform", tokens=64, seed=5))
    res = run_scenarios(d, ["warm", "cold-ram", "budget"], tokens=2, peer=False, report=lambda s: None,
                        prefill=[16, 100])
    rows = res["prefill"]["rows"]
    assert [(r["scenario"], r.get("tokens"), r.get("run", True)) for r in rows] == [
        ("cold-ram", 16, True), ("cold-ram", 100, True), ("budget-nospec", 16, True), ("budget-nospec", 100, True)
    ], [r.get("reason") for r in rows]
    idx = read_trace(d / TRACE_NAME).idx                                       # [T, L, K]
    rec = ContainerReader(d).record_layout.nbytes
    for r in rows:
        assert r["ttft_s_glm5"] > 0 and r["cpu_fallbacks"] == 0, r
        assert r["moe_compute_ms_per_layer"] is not None, r
        # copy-all needs the run's H2D peak: on this tiny slice (records of a few KB) the probe may give none, and
        # then the row says so (None) instead of a made-up ceiling
        peak = (res.get("h2d_peak") or {}).get("whole_GBps")
        assert (r["copy_all_s_glm5"] > 0) if peak else (r["copy_all_s_glm5"] is None), (r, res.get("notes"))
        if r["scenario"] == "cold-ram":
            tok = np.arange(r["tokens"]) % idx.shape[0]
            union = sum(len({int(e) for e in idx[tok, layer].ravel() if e >= 0}) for layer in range(idx.shape[1]))
            assert r["copies"] == union and r["copied_bytes_slice"] == union * rec, r


def test_gpu_bench_stream_prefill_ahead_rows(tmp_path):
    """--prefill-ahead: the layer-ahead engines run, the 2E one copies experts ahead on the speculative lane (the first
    MoE layer's from the step's start too), every expert of the prompt's union still arrives (demand or ahead) and
    nothing falls back to the CPU."""
    from coli.bench.slice import SliceOptions, make_slice
    from coli.bench.stream import run_scenarios
    from coli.bench.trace_router import TRACE_NAME
    from coli.trace import read_trace
    d = tmp_path / "s2"
    make_slice(d, SliceOptions(preset="tiny", layers=2, trace="uniform", tokens=64, seed=5))
    res = run_scenarios(d, ["cold-ram"], tokens=2, peer=False, report=lambda s: None, prefill=[100],
                        prefill_ahead=True)
    rows = {r["scenario"]: r for r in res["prefill"]["rows"]}
    assert sorted(rows) == ["cold-ram", "cold-ram+ahead", "cold-ram-2E", "cold-ram-2E+ahead"], [
        r.get("reason") for r in rows.values()]
    idx = read_trace(d / TRACE_NAME).idx
    tok = np.arange(100) % idx.shape[0]
    union = sum(len({int(e) for e in idx[tok, layer].ravel() if e >= 0}) for layer in range(idx.shape[1]))
    for name, r in rows.items():
        assert r.get("run", True) and r["cpu_fallbacks"] == 0 and r["copies"] >= union, (name, r)
    assert rows["cold-ram-2E+ahead"]["ahead_bytes_slice"] > 0, rows["cold-ram-2E+ahead"]
    assert rows["cold-ram-2E+ahead"]["ahead"]["base"] == "cold-ram-2E"
    # the product's path: the timed forward copied its first MoE layer from the step's start (100 rows of top-4 of
    # 16), so every MoE layer is credited, the slice's 2 and GLM-5's 75
    assert rows["cold-ram-2E+ahead"]["ahead_first"] == 1 and rows["cold-ram-2E"]["ahead_first"] == 0
    assert rows["cold-ram-2E+ahead"]["ahead"]["layers_ahead_glm5"] == 75
