"""The consumer-budget rows' pure parts (coli/bench/budget.py): the --vram-gb list, the sim prediction for the tokens
a decode replays, and coli plan's bound for the same machine figures (the real simulator and planner)."""

from __future__ import annotations

import numpy as np
import pytest

from coli.bench.budget import budget_name, parse_budgets, plan_bound, predict_hits, replayed_tokens
from coli.errors import ColiError


def test_budgets_parse_one_or_a_list():
    assert parse_budgets("16") == [16.0]
    assert parse_budgets(24) == [24.0]
    assert parse_budgets("16, 24,32,24") == [16.0, 24.0, 32.0]


@pytest.mark.parametrize("bad,msg", [("16,x", "'x' is not a number"), ("0", "must be > 0"), ("-4", "must be > 0"),
                                     ("nan", "must be > 0"), ("", "is not a number")])
def test_bad_budgets_name_the_option_and_the_culprit(bad, msg):
    with pytest.raises(ColiError, match="--vram-gb") as e:
        parse_budgets(bad)
    assert msg in str(e.value) and "\n" not in str(e.value)


def test_row_names_carry_the_budget_only_when_there_are_several():
    assert budget_name("budget", 16.0, False) == "budget"
    assert budget_name("budget-nospec", 24.0, True) == "budget-nospec-24gb"


def test_replay_wraps_around_a_short_trace():
    idx = np.arange(3 * 2 * 2).reshape(3, 2, 2)
    np.testing.assert_array_equal(replayed_tokens(idx, 5)[3:], idx[:2])


def _trace(rng, T, L, E, K):
    return np.stack([np.stack([rng.choice(E, K, replace=False) for _ in range(L)]) for _ in range(T)])


def test_prediction_counts_after_warmup_and_feeds_the_ram_tier_the_misses():
    rng = np.random.default_rng(0)
    idx = _trace(rng, 40, 3, 16, 4)                       # 3 layers x 16 experts, top-4
    p = predict_hits(idx, tokens=18, warmup=2, vram_slots=12, ram_slots=48)
    assert p["vram_requests"] == 16 * 3 * 4               # the 16 timed tokens only
    assert 0 < p["vram"] < 1
    assert p["ram"] == 1.0 or p["ram_requests"] < p["vram_requests"]
    # every expert of every layer fits in RAM (48 = 3 x 16): after warm-up a VRAM miss can miss RAM only the first
    # time that expert is ever asked for
    full = predict_hits(idx, tokens=18, warmup=2, vram_slots=0, ram_slots=48)
    assert full["vram"] == 0.0 and full["ram_requests"] == 16 * 3 * 4
    seen = {(l, int(e)) for t in range(18) for l in range(3) for e in idx[t, l]}
    first_after_warmup = seen - {(l, int(e)) for t in range(2) for l in range(3) for e in idx[t, l]}
    assert full["ram"] == pytest.approx(1 - len(first_after_warmup) / (16 * 3 * 4))
    # all VRAM: every timed request hits once warm, nothing reaches RAM
    allv = predict_hits(idx, tokens=18, warmup=2, vram_slots=48, ram_slots=48)
    assert allv["ram_requests"] == 16 * 3 * 4 - round(allv["vram"] * 16 * 3 * 4)
    # more slots never predict fewer VRAM hits under the default policy on this trace
    rates = [predict_hits(idx, tokens=18, warmup=2, vram_slots=s, ram_slots=8)["vram"] for s in (4, 12, 24, 48)]
    assert rates == sorted(rates)


def test_plan_bound_grows_with_the_budget_and_the_smaller_dense_core():
    b16 = plan_bound(16, 64, dense="int8", group=64, pcie_gbps=55.0, disk_gbps=1.9)
    b32 = plan_bound(32, 64, dense="int8", group=64, pcie_gbps=55.0, disk_gbps=1.9)
    i4 = plan_bound(16, 64, dense="int4", group=64, pcie_gbps=55.0, disk_gbps=1.9)
    assert b16["tokens_per_s"] is not None and b16["tokens_per_s"] > 0
    assert b32["vram_slots"] > b16["vram_slots"] and b32["tokens_per_s"] >= b16["tokens_per_s"]
    assert i4["dense_bytes"] < b16["dense_bytes"] and i4["vram_slots"] > b16["vram_slots"]
    assert plan_bound(16, 64, dense="int8", group=64, pcie_gbps=None, disk_gbps=1.9)["tokens_per_s"] is None


def test_budget_rows_keep_their_place_and_show_the_predictions():
    from coli.bench import stream as st
    names = ["warm", "budget-16gb", "budget-nospec-16gb", "budget-24gb", "budget-nospec-24gb", "cold-ram", "sync",
             "budget-note"]
    assert st.row_order(names) == ["warm", "cold-ram", "budget-16gb", "budget-24gb", "budget-nospec-16gb",
                                   "budget-nospec-24gb", "sync"]
    assert st.row_order(["budget", "budget-nospec", "warm"]) == ["warm", "budget", "budget-nospec"]
    raw = {"scenario": "budget-16gb", "token_s": [0.01, 0.01], "vram_gb": 16.0,
           "counters": {"copy_bytes": 1, "demand_copy_s": 0.001, "hits": 3, "misses": 1},
           "host": {"hits": 1, "misses": 1},
           "predicted": {"sim": {"vram": 0.5, "ram": 0.25}, "plan": {"tokens_per_s": 1.234}}}
    row = st._row_figures(raw, L=2, N=2, nomoe_s=0.004, head_slice=0.0005, head_full=0.002, dense_layer_s=0.00175,
                          warm_moe_layer_s=0.001, ceil=None, tile_kb=1024, nvme_peak=None)
    assert row["vram_gb"] == 16.0 and row["predicted"]["plan"]["tokens_per_s"] == 1.234
    cells = st.table_rows({"rows": [row]})[0]
    assert cells[0] == "budget-16gb" and cells[1].endswith("(plan 1.23)")
    assert cells[7] == "75% (sim 50%)" and cells[8] == "50% (sim 25%)"
    assert len(cells) == len(st.HEADERS)


def test_stream_cli_refuses_a_bad_budget_list_before_the_gpu(tmp_path):
    from typer.testing import CliRunner

    from coli.cli.main import app
    r = CliRunner().invoke(app, ["bench", "stream", str(tmp_path), "--vram-gb", "16,lots"])
    assert r.exit_code == 2, r.output
    assert "--vram-gb '16,lots': 'lots' is not a number" in r.output and "Traceback" not in r.output


def test_dense_format_is_read_from_the_slice(tiny_slice):
    from coli.bench.stream import _slice_dense_format
    from coli.bench.trace_router import TraceRouting
    assert _slice_dense_format(tiny_slice) == ("bf16", 64)
    p = predict_hits(TraceRouting(tiny_slice).idx, tokens=18, warmup=2, vram_slots=8, ram_slots=16)
    assert p["vram_requests"] == 16 * 1 * 4 and 0 <= p["vram"] <= 1
