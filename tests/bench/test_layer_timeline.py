"""The per-layer split of a streaming MoE layer's device timeline (coli/bench/layer_timeline.py)."""

import pytest

from coli.bench.layer_timeline import layer_phases, summarise_phases


def span(lane, t0, t1, label=""):
    return {"lane": lane, "t0_us": t0, "t1_us": t1, "label": label}


def two_layers():
    # layer A: router lands at 300, copies 340-440, 441-541 (1 us gap), kernels done 560
    # layer B: dense 560-800, router lands at 800, copies 900-1000, 1010-1110 (10 us gap), kernels done 1130;
    # then the head ("end") and a speculative copy that must not count as a demand copy
    return [span("compute", 50, 300, "route"), span("demand", 340, 440), span("demand", 441, 541),
            span("compute", 500, 560, "moe_end"), span("compute", 560, 800, "route"),
            span("speculative", 820, 880), span("demand", 1010, 1110), span("demand", 900, 1000),
            span("compute", 1080, 1130, "moe_end"), span("compute", 1130, 1200, "end")]


def test_each_phase_of_each_layer():
    a, b = layer_phases(two_layers())
    assert a == {"route_to_copy_us": 40, "gaps_us": 1, "copy_us": 200, "tail_us": 19, "dense_us": 250,
                 "copies": 2, "overhead_us": 60}
    assert b == {"route_to_copy_us": 100, "gaps_us": 10, "copy_us": 200, "tail_us": 20, "dense_us": 240,
                 "copies": 2, "overhead_us": 130}


def test_summary_over_layers_and_the_lane_busy_fraction():
    s = summarise_phases(two_layers())
    assert s["layers"] == 2
    assert s["route_to_copy_us"] == {"mean": 70, "p50": 70}
    assert s["overhead_over_copy"] == pytest.approx(95 / 200)
    assert s["demand_busy_of_wall"] == pytest.approx(400 / 1150)
    assert s["token_gap_us"] is None                    # one token: no next one to wait for


def test_the_host_gap_between_tokens():
    ev = two_layers()
    nxt = [dict(e, t0_us=e["t0_us"] + 1300, t1_us=e["t1_us"] + 1300) for e in ev]   # the next token, 150 us later
    s = summarise_phases(ev + nxt)
    assert s["layers"] == 4 and s["token_gap_us"] == {"mean": 150, "p50": 150}


def test_a_layer_without_copies_is_skipped_and_no_timeline_gives_no_figures():
    ev = [span("compute", 0, 100, "route"), span("compute", 100, 150, "moe_end"), span("compute", 150, 400, "route"),
          span("demand", 420, 520), span("compute", 500, 530, "moe_end")]
    (only,) = layer_phases(ev)
    assert only["route_to_copy_us"] == 20 and only["tail_us"] == 10 and only["dense_us"] == 250
    assert summarise_phases([]) == {"layers": 0, "token_gap_us": None, **{
        k: None for k in ("route_to_copy_us", "gaps_us", "copy_us", "tail_us", "overhead_us", "dense_us")}}
