"""`coli bench stream --prefill`: the option's parsing and refusals (one line naming the value, before any GPU), the
TTFT arithmetic (split, GLM-5 extrapolation, copy-all time, ratio, copied bytes, compute reference: pure functions
against hand-computed values), and the prefill core (coli.bench.prefill.PrefillBench) run for real on a tiny slice on
the numpy path: one prefill asks each MoE layer once for the union of S consecutive trace tokens' experts."""

from __future__ import annotations

import numpy as np
import pytest
from typer.testing import CliRunner

from coli.bench import prefill as pf
from coli.bench.trace_router import TRACE_NAME, TraceRouting
from coli.cli.main import app
from coli.container.reader import ContainerReader
from coli.errors import ColiError
from coli.model.forward import GlmMoeDsaModel
from coli.model.numpy_backend import NumpyBackend
from coli.trace import read_trace
from slice_helpers import AskedExperts

MB = 20_054_016          # a GLM-5 int4 g64 expert record, bytes (about 20.05 MB)


# ---- options -------------------------------------------------------------------------------------------------
def test_parse_prefill():
    assert pf.parse_prefill("8192, 512,2048,512") == [512, 2048, 8192]
    assert pf.parse_prefill("") == [] and pf.parse_prefill("0") == []
    for bad, culprit in (("2k", "--prefill '2k': not a whole number"), ("8193", "--prefill 8193: a prompt is 1..8192"),
                         ("512,-4", "--prefill -4")):
        with pytest.raises(ColiError, match=culprit):
            pf.parse_prefill(bad)


def test_check_prefill():
    pf.check_prefill([512], ["warm", "cold-ram"])
    pf.check_prefill([], ["warm"])
    with pytest.raises(ColiError, match="--prefill 512,2048: the TTFT rows run in the cold-ram and budget"):
        pf.check_prefill([512, 2048], ["warm", "sync"])


@pytest.mark.parametrize("args, culprit", [
    (["--prefill", "512,big"], "--prefill 'big': not a whole number"),
    (["--prefill", "9000"], "--prefill 9000: a prompt is 1..8192 tokens"),
    (["--prefill", "512", "--scenario", "warm"], "--prefill 512: the TTFT rows run in the cold-ram and budget"),
    (["--prefill-ahead", "--scenario", "cold-ram"], "--prefill-ahead: its rows are cold-ram prefills: give --prefill"),
    (["--prefill", "512", "--prefill-ahead", "--scenario", "budget"], "--prefill-ahead: its rows are cold-ram"),
])
def test_cli_refuses_a_bad_prefill_before_the_gpu(tiny_slice3, nogpu, args, culprit):
    res = CliRunner().invoke(app, ["bench", "stream", str(tiny_slice3), *args])
    assert res.exit_code == 2, res.output
    assert culprit in res.output and "CUDA" not in res.output


# ---- the arithmetic ------------------------------------------------------------------------------------------
def test_copy_all_is_every_glm5_expert_once_at_the_peak():
    assert pf.copy_all_s(MB, 51.0) == pytest.approx(75 * 256 * MB / 51e9)     # ~7.55 s
    assert pf.copy_all_s(MB, None) is None and pf.copy_all_s(0, 51.0) is None


def test_the_ttft_split_charges_the_fixed_time_and_the_head_once():
    moe, dense = pf.ttft_split(0.520, 0.120, 2, head_s=0.002, fixed_s=0.0003)
    assert moe == pytest.approx(0.200) and dense == pytest.approx((0.120 - 0.0023) / 2)
    t = pf.ttft_glm5(moe, dense, head_s_full=0.07, fixed_s=0.0003)
    assert t == pytest.approx(0.0003 + 75 * 0.200 + 78 * dense + 0.07)
    assert pf.ttft_split(0.1, 0.2, 2, 0.5) == (0.0, 0.0)                     # noise clamps to 0
    with pytest.raises(ValueError):
        pf.ttft_split(1, 1, 0, 0)


def _raw(scenario="cold-ram", S=2048, t=0.520, nomoe=0.120, copied=2 * 256 * MB, copy_s=0.2):
    return {"scenario": scenario, "tokens": S, "prefill_s": t, "nomoe_s": nomoe,
            "counters": None if scenario == "warm" else {"copy_bytes": copied, "copies": 512, "demand_copy_s": copy_s,
                                                         "cpu_fallbacks": 0}}


KW = dict(L=2, head_s=0.002, head_s_full=0.07, fixed_s=0.0, peak_GBps=51.0, record_bytes=MB, hidden=6144,
          moe_inter=2048, top_k=8)


def test_a_ttft_row_sets_the_prompt_beside_copying_every_expert_once():
    warm = _raw("warm", t=0.150, nomoe=0.120)
    row = pf.prefill_figures(_raw(), warm=warm, **KW)
    copy_all = 75 * 256 * MB / 51e9
    ttft = 75 * 0.200 + 78 * (0.118 / 2) + 0.07
    assert row["ttft_s_glm5"] == pytest.approx(ttft) and row["copy_all_s_glm5"] == pytest.approx(copy_all)
    assert row["ttft_over_copy_all"] == pytest.approx(ttft / copy_all)
    assert row["copied_bytes_glm5"] == pytest.approx(75 * 256 * MB) and row["copied_over_all_experts"] == 1.0
    assert row["copy_busy_GBps"] == pytest.approx(2 * 256 * MB / 0.2 / 1e9)
    # the warm engine's MoE is compute alone: 15 ms a slice layer, 2 x 3 x H x Im x S x K flops in it
    assert row["moe_compute_ms_per_layer"] == pytest.approx(15.0) and row["moe_compute_s_glm5"] == pytest.approx(1.125)
    assert row["moe_tflops"] == pytest.approx(6 * 6144 * 2048 * 2048 * 8 / 0.015 / 1e12)
    # the layer's 200 ms over max(its copies at the peak, its compute)
    assert row["overlap"] == pytest.approx(0.200 / (copy_all / 75))
    assert row["target"] == {"ttft_over_copy_all_max": 1.3, "met": ttft / copy_all <= 1.3}
    assert "target" not in pf.prefill_figures(_raw(S=512), **KW)           # issue 15's bound is at 2,048 tokens


def test_prefill_rows_use_the_warm_row_of_the_same_length_and_keep_failures():
    raws = [_raw("warm", S=512, t=0.05, nomoe=0.04), _raw("cold-ram", S=512), _raw("cold-ram", S=2048),
            {"scenario": "budget-nospec", "tokens": 8192, "run": False, "reason": "out of memory"}]
    rows = pf.prefill_rows(raws, **KW)
    assert [r["scenario"] for r in rows] == ["cold-ram", "cold-ram", "budget-nospec"]
    assert rows[0]["moe_compute_ms_per_layer"] == pytest.approx(5.0) and rows[1]["moe_compute_ms_per_layer"] is None
    cells = pf.prefill_table_rows(rows)
    assert cells[2][2] == "not run: out of memory" and len(cells[0]) == len(pf.PREFILL_HEADERS)
    assert "(<= 1.3: " in cells[1][5]


def test_a_layer_ahead_row_is_set_against_its_plain_engine_per_layer_that_has_one_before_it():
    plain = pf.prefill_figures(_raw("cold-ram-2E", t=0.520), **KW)
    ahead = pf.prefill_figures(_raw("cold-ram-2E+ahead", t=0.460, copied=2 * 256 * MB), **KW)
    rows = pf.prefill_rows([_raw("cold-ram-2E", t=0.520), _raw("cold-ram-2E+ahead", t=0.460)], **KW)
    a = rows[1]["ahead"]
    # 60 ms saved in the slice's one layer with a layer before it; GLM-5 has 74 such
    assert a["base"] == "cold-ram-2E" and a["saved_ms_per_layer"] == pytest.approx(60.0)
    assert a["ttft_s_glm5"] == pytest.approx(plain["ttft_s_glm5"] - 74 * 0.060)
    assert a["ttft_over_copy_all"] == pytest.approx(a["ttft_s_glm5"] / plain["copy_all_s_glm5"])
    assert "ahead" not in rows[0] and ahead["ttft_s_glm5"] > a["ttft_s_glm5"]     # the plain split would credit 2
    assert pf.ahead_figures(ahead, plain, L=1)["ttft_s_glm5"] is None
    cells = pf.prefill_table_rows(rows)
    assert cells[0][-1] == "-" and cells[1][-1] == f"{a['ttft_s_glm5']:.2f} (60.0)"


def test_a_row_whose_forwards_copied_their_first_layer_ahead_credits_every_moe_layer():
    # the engine copied each forward's first MoE layer from the step's start (VramExperts.begin_step): both slice
    # layers had a window, and so do all 75 of GLM-5 -- the same as the row's own split
    raw = _raw("cold-ram-2E+ahead", t=0.460)
    raw["counters"]["ahead_first"] = 1
    rows = pf.prefill_rows([_raw("cold-ram-2E", t=0.520), raw], **KW)
    plain, row = rows
    a = row["ahead"]
    assert row["ahead_first"] == 1 and a["layers_ahead_glm5"] == 75
    assert a["saved_ms_per_layer"] == pytest.approx(30.0)                       # 60 ms over the slice's 2 layers
    assert a["ttft_s_glm5"] == pytest.approx(plain["ttft_s_glm5"] - 75 * 0.030)
    assert a["ttft_s_glm5"] == pytest.approx(row["ttft_s_glm5"])                # the row's own split agrees now
    one = pf.ahead_figures(dict(row), plain, L=1)                              # a 1-layer slice has a window too
    assert one["saved_ms_per_layer"] == pytest.approx(60.0)


def test_copied_bytes_count_the_layer_ahead_copies_too():
    raw = _raw("cold-ram+ahead", copied=300 * MB)
    raw["counters"].update(spec_bytes=212 * MB, spec_copies=212, copies=300)
    row = pf.prefill_figures(raw, **KW)
    assert row["copied_bytes_slice"] == 512 * MB and row["copies"] == 512 and row["ahead_bytes_slice"] == 212 * MB


# ---- on the numpy path, for real -----------------------------------------------------------------------------
def test_a_prefill_asks_each_layer_once_for_the_union_of_consecutive_trace_tokens(tiny_slice3):
    r = ContainerReader(tiny_slice3)
    try:
        src = AskedExperts(r)
        model = GlmMoeDsaModel(r.config, r, NumpyBackend(), experts=src)
        routing = TraceRouting(tiny_slice3)
        routing.install(model)
        idx = read_trace(tiny_slice3 / TRACE_NAME).idx                       # [T, L, K]
        pb = pf.PrefillBench(model, routing, [5, 50])                       # 50 > the trace's 40 tokens: wraps
        pb.run("cold-ram", snapshot=lambda: {"copy_bytes": len(src.asked)})
        assert [x["tokens"] for x in pb.raws] == [5, 50] and all(x.get("run") is not False for x in pb.raws)
        # per prefill: one stream() per MoE layer (the counters' stand-in counts them); the no-expert one asks none
        assert [x["counters"]["copy_bytes"] for x in pb.raws] == [3, 3]
        src.asked.clear()
        pb.prefill_s(50)
        rows = (np.arange(50) % idx.shape[0])
        want = [sorted({int(e) for e in idx[rows, layer].ravel() if e >= 0}) for layer in range(3)]
        assert [sorted(ids) for _, ids in src.asked] == want
        assert all(x["prefill_s"] > 0 and x["nomoe_s"] > 0 for x in pb.raws)
    finally:
        r.close()


def test_the_demand_lanes_rate_counts_its_own_bytes_not_the_ahead_copies():
    """copy_busy_GBps: the demand lane's bytes over its busy time; layer-ahead copies ran on the speculative lane and
    count in copied_bytes (every expert still crossed once) but not in that rate."""
    raw = _raw(copied=256 * MB, copy_s=0.1)
    raw["counters"].update(spec_bytes=256 * MB, spec_copies=256)
    row = pf.prefill_figures(raw, **KW)
    assert row["copied_bytes_slice"] == 512 * MB and row["ahead_bytes_slice"] == 256 * MB
    assert row["copy_busy_GBps"] == pytest.approx(256 * MB / 0.1 / 1e9)
