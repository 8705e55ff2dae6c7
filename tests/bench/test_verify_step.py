"""`coli bench stream --verify`: the option's parsing and refusals (one line naming the value, before any GPU), the
MTP arithmetic (tokens per round, speed-up, break-even, auto's choice: pure functions against hand-computed
values), and the verify rows' core (coli.bench.verify_step) run for real on a tiny slice on the numpy path: the
verify step's S greedy tokens are those of the S positions run one at a time, the cache is back at its length, and
the experts a step asks for are the union of S consecutive trace tokens."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
from typer.testing import CliRunner

from coli.bench import verify_step as vs
from coli.bench.trace_router import TRACE_NAME, TraceRouting
from coli.cli.main import app
from coli.container.reader import ContainerReader
from coli.errors import ColiError
from coli.model.forward import GlmMoeDsaModel
from coli.model.numpy_backend import NumpyBackend
from coli.trace import read_trace
from slice_helpers import AskedExperts, write_tiny


# ---- options -------------------------------------------------------------------------------------------------
def test_parse_verify():
    assert vs.parse_verify("1") == [1]
    assert vs.parse_verify("4, 2,3,2") == [1, 2, 3, 4]             # 1, the plain step, always in
    for bad, culprit in (("", "name at least one"), (" , ", "name at least one"), ("2,x", "'x'"),
                         ("2.5", "'2.5'"), ("0", "--verify 0: a verify step is 1..4"),
                         ("5", "--verify 5: a verify step is 1..4 positions"), ("-1", "--verify -1")):
        with pytest.raises(ColiError, match=culprit) as e:
            vs.parse_verify(bad)
        assert "\n" not in str(e.value)


def test_parse_acceptance():
    assert vs.parse_acceptance("0.8") == 0.8 and vs.parse_acceptance(0) == 0.0 and vs.parse_acceptance("1") == 1.0
    for bad, culprit in (("1.5", "--mtp-acceptance 1.5: an acceptance is a probability in 0..1"),
                         ("-0.1", "--mtp-acceptance -0.1"), ("nan", "--mtp-acceptance nan"),
                         ("most", "--mtp-acceptance 'most': not a number")):
        with pytest.raises(ColiError, match=culprit):
            vs.parse_acceptance(bad)


def test_check_verify():
    vs.check_verify([1], ["disk"], 1)                        # the default: nothing to check
    vs.check_verify([1, 2, 3, 4], ["cold-ram"], 4)
    with pytest.raises(ColiError, match="verify steps run in the warm and cold-ram scenarios"):
        vs.check_verify([1, 2], ["disk", "budget"], 256)
    with pytest.raises(ColiError, match="--verify 4: the slice's routing trace has 3 tokens.*--tokens 4"):
        vs.check_verify([1, 4], ["warm"], 3)


@pytest.mark.parametrize("args, culprit", [
    (["--verify", "2,three"], "--verify 'three': not a whole number"),
    (["--verify", "5"], "--verify 5: a verify step is 1..4 positions"),
    (["--verify", "2", "--scenario", "disk"], "--verify 1,2: verify steps run in the warm and cold-ram"),
    (["--verify", "2", "--mtp-acceptance", "80"], "--mtp-acceptance 80: an acceptance is a probability in 0..1"),
])
def test_cli_refuses_a_bad_verify_before_the_gpu(tiny_slice3, nogpu, args, culprit):
    res = CliRunner().invoke(app, ["bench", "stream", str(tiny_slice3), *args])
    assert res.exit_code == 2, res.output
    assert culprit in res.output and "CUDA" not in res.output


def test_cli_refuses_a_verify_longer_than_the_trace(tmp_path, nogpu):
    d = write_tiny(tmp_path / "t3", trace="uniform", tokens=3)
    res = CliRunner().invoke(app, ["bench", "stream", str(d), "--scenario", "warm", "--verify", "2,4"])
    assert res.exit_code == 2 and "--verify 4: the slice's routing trace has 3 tokens" in res.output, res.output
    assert "CUDA" not in res.output


def test_cli_good_verify_reaches_the_gpu_check(tiny_slice3, nogpu):
    res = CliRunner().invoke(app, ["bench", "stream", str(tiny_slice3), "--scenario", "warm", "--verify", "2,3,4",
                                   "--mtp-acceptance", "0.6"])
    assert res.exit_code == 2 and "needs a CUDA GPU" in res.output


# ---- the arithmetic ------------------------------------------------------------------------------------------
def test_tokens_per_round():
    assert vs.tokens_per_round(0.8, 1) == pytest.approx(1.8)
    assert vs.tokens_per_round(0.5, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert vs.tokens_per_round(0.0, 3) == 1.0 and vs.tokens_per_round(1.0, 3) == 4.0


def test_speedup_and_break_even():
    # plain step 1, verify step of 2 positions 1.1, MTP step 0.1: a round of 1.2 yields 1.8 tokens at a = 0.8
    assert vs.speedup(0.8, 1, 1.0, 1.1, 0.1) == pytest.approx(1.8 / 1.2)
    assert vs.break_even(1, 1.0, 1.1, 0.1) == pytest.approx(0.2, abs=1e-12)      # 1 + a = 1.2
    be = vs.break_even(3, 1.0, 2.4, 0.2)                                          # 1 + a + a^2 + a^3 = 3
    assert 0 < be < 1 and vs.speedup(be, 3, 1.0, 2.4, 0.2) == pytest.approx(1.0, abs=1e-12)
    assert vs.break_even(2, 1.0, 0.9, 0.05) == 0.0            # a round cheaper than a plain step: pays at any a
    assert vs.break_even(1, 1.0, 1.9, 0.1) is None             # a round of 2 plain steps: pays at none
    assert vs.break_even(1, 1.0, 2.5, 0.1) is None


def test_auto_chooses_on_exactly_where_one_draft_pays():
    for t1, tr, a in [(1.0, 1.2, 0.8), (1.0, 1.8, 0.8), (1.0, 1.81, 0.8), (1.0, 1.5, 0.6), (1.0, 1.59, 0.6),
                      (2.0, 3.9, 0.9), (1.0, 0.9, 0.0)]:
        pays = vs.tokens_per_round(a, 1) * t1 / tr > 1.0
        assert vs.auto_choice(t1, tr, a) == ("on" if pays else "off"), (t1, tr, a)
    assert vs.auto_choice(1.0, 1.8, 0.8) == "off"               # a tie: no gain, AutoChoice keeps plain steps


def test_mtp_step_estimate_and_rows_from_known_step_times():
    # S = 1: 10 ms on the slice, MoE 1 ms / dense 1.5 ms per layer, lm_head 0.5 ms over the slice's 4096 rows of
    # H = 6144; GLM-5 step 200 ms. S = 2: 210 ms GLM-5, 12 ms slice.
    steps = [{"scenario": "warm", "positions": 1, "step_s_slice": 0.010, "step_s_glm5": 0.200, "moe_layer_ms": 1.0,
              "dense_layer_ms": 1.5, "head_ms": 0.5},
             {"scenario": "warm", "positions": 2, "step_s_slice": 0.012, "step_s_glm5": 0.210, "moe_layer_ms": 1.8,
              "dense_layer_ms": 1.5, "head_ms": 0.6},
             {"scenario": "cold-ram", "positions": 2, "run": False, "reason": "broke"}]
    rows = vs.mtp_rows(steps, hidden=6144, vocab=4096, auto_acceptance=0.8)
    assert [(r["scenario"], r["drafts"]) for r in rows] == [("warm", 1)]     # cold-ram has no S = 1: no MTP row
    r = rows[0]
    eh = 0.5e-3 * 2 * 6144 / 4096
    t_mtp_glm5 = 1e-3 + 1.5e-3 + 0.5e-3 * 154880 / 4096 + eh
    t_mtp_slice = 1e-3 + 1.5e-3 + 0.5e-3 + eh
    assert r["mtp_step_ms_glm5"] == pytest.approx(t_mtp_glm5 * 1e3)
    assert r["mtp_step_ms_slice"] == pytest.approx(t_mtp_slice * 1e3)
    assert r["verify_over_plain_glm5"] == pytest.approx(1.05) and r["verify_over_plain_slice"] == pytest.approx(1.2)
    round_glm5 = 0.210 + t_mtp_glm5
    assert r["round_ms_glm5"] == pytest.approx(round_glm5 * 1e3)
    for a in (0.6, 0.8, 0.9):
        assert r["tokens_per_s_glm5"][str(a)] == pytest.approx((1 + a) / round_glm5)
        assert r["speedup_glm5"][str(a)] == pytest.approx((1 + a) * 0.200 / round_glm5)
        assert r["speedup_slice"][str(a)] == pytest.approx((1 + a) * 0.010 / (0.012 + t_mtp_slice))
    assert r["break_even_acceptance_glm5"] == pytest.approx(round_glm5 / 0.200 - 1, abs=1e-12)
    assert r["auto"] == {"acceptance": 0.8, "choice": "on", "speedup_k1_glm5": pytest.approx(1.8 * 0.2 / round_glm5),
                         "mtp_would_lose": False}
    vs.add_decode_ratios(rows, [{"scenario": "warm", "tokens_per_s_glm5": 10.0}], 0.8)
    assert r["x_decode_row_glm5"]["x"] == pytest.approx(1.8 / round_glm5 / 10.0)
    a = vs.acceptance(rows)
    assert 1.8 * 0.2 / round_glm5 >= 1.5                       # 1.55: the target is met
    assert a["warm"]["best_drafts"] == 1 and a["warm"]["target"] == 1.5 and a["warm"]["met"] is True
    assert a["cold-ram"] == {"acceptance": 0.8, "best_drafts": None, "speedup_glm5": None, "target": None,
                             "met": None, "auto": None}
    # the same costs at a streaming verify step (2.2 x the plain step): k = 1 loses, auto says off
    slow = [dict(steps[0]), {**steps[1], "step_s_glm5": 0.440}]
    lose = vs.mtp_rows(slow, hidden=6144, vocab=4096)[0]
    assert lose["auto"]["choice"] == "off" and lose["auto"]["mtp_would_lose"] is True
    assert lose["break_even_acceptance_glm5"] is None
    assert vs.acceptance([lose])["warm"]["met"] is False


def test_verify_figures_from_known_times():
    # 2 MoE layers, S = 3: step 9 ms (median), without routed experts 5 ms, lm_head over 3 rows 1 ms
    raw = {"scenario": "cold-ram", "positions": 3, "context": 10, "step_s": [0.008, 0.009, 0.050],
           "distinct": [[20, 22], [24, 18], [21, 21]], "counters": {"copy_bytes": 126 * 1000, "copies": 126,
                                                                     "cpu_fallbacks": 0},
           "vram_slots": 16, "verify_tokens": [4, 5, 6], "one_by_one": [4, 5, 6], "cache_restored": True}
    f = vs.verify_figures(raw, L=2, nomoe_step_s=0.005, head_s=0.001, vocab=154880, record_bytes=1000)
    assert f["step_s_slice"] == pytest.approx(0.009)             # the median: one slow step does not move it
    assert f["moe_layer_ms"] == pytest.approx(2.0) and f["dense_layer_ms"] == pytest.approx(2.0)
    assert f["step_s_glm5"] == pytest.approx(75 * 0.002 + 78 * 0.002 + 0.001)
    assert f["distinct_experts_per_layer_step"]["mean"] == pytest.approx(21.0)
    assert f["union_bytes_per_step"] == pytest.approx(21.0 * 2 * 1000)
    assert f["glm5_union_bytes_per_step"] == pytest.approx(21.0 * 75 * 1000)
    assert f["copied_bytes_per_step"] == pytest.approx(126 * 1000 / 3) and f["union_copied_once"] is True
    assert f["verify_equals_one_by_one"] is True and f["cache_restored"] is True and f["drafts"] == 2
    assert vs.verify_figures({**raw, "verify_tokens": [4, 5, 7]}, L=2, nomoe_step_s=None, head_s=0.0, vocab=1,
                             record_bytes=0)["verify_equals_one_by_one"] is False
    assert vs.verify_figures({**raw, "counters": {"copies": 125}}, L=2, nomoe_step_s=None, head_s=0.0, vocab=1,
                             record_bytes=0)["union_copied_once"] is False


# ---- on the numpy path, for real -----------------------------------------------------------------------------
@pytest.fixture()
def sliced(tiny_slice3):
    r = ContainerReader(tiny_slice3)
    src = AskedExperts(r)
    model = GlmMoeDsaModel(r.config, r, NumpyBackend(), experts=src)
    yield model, TraceRouting(tiny_slice3), src, read_trace(tiny_slice3 / TRACE_NAME).idx, r.record_layout.nbytes
    r.close()


N, WARM = 3, 2


@pytest.mark.parametrize("S", [2, 4])
def test_a_verify_step_gives_the_one_by_one_tokens_and_restores_the_cache(sliced, S):
    """Independently of the bench's own check: S positions in one verify step against the same S positions decoded
    one at a time with model.forward (the ordinary decode path), each position routing the same trace token."""
    model, routing, src, idx, _ = sliced
    route = vs.WindowRoutes(routing)
    model.route_override = route
    cache, first = vs.VerifyBench(model, routing, N, WARM).fill(route)
    C, start = cache.length, 11
    assert C == WARM + N // 2
    alone, tok = [], first
    for j in range(S):                                      # the reference: one position per forward()
        route.at(start + j)
        tok = int(np.argmax(model.forward([tok], cache)[-1]))
        alone.append(tok)
    cache.truncate(C)
    src.asked.clear()
    route.at(start)
    got = vs.verify_step(model, cache, [first] + alone[:-1])
    assert got.tolist() == alone and cache.length == C
    T = routing.n_tokens
    rows = [(start + j) % T for j in range(S)]
    assert [ids for _, ids in src.asked] == [sorted(set(idx[rows, layer].ravel().tolist()) - {-1})
                                             for layer in range(len(model.config.moe_layers))]
    assert len(src.asked[0][1]) > model.config.num_experts_per_tok   # the positions really add experts
    model.route_override = None


def test_rows_for_every_step_size_with_figures(sliced):
    model, routing, src, idx, nbytes = sliced
    vb = vs.VerifyBench(model, routing, N, WARM)
    rows = vb.rows("warm", [2, 3, 4], record_bytes=nbytes)    # S = 1 is added: the reference
    assert [r["positions"] for r in rows] == [1, 2, 3, 4]
    L, C, T = len(model.config.moe_layers), vb.context, routing.n_tokens
    for r in rows:
        S = r["positions"]
        assert r["scenario"] == "warm" and r["tokens"] == N and r["context"] == C
        assert r["verify_equals_one_by_one"] is True and r["cache_restored"] is True
        # the timed steps' unions: step j of S routes trace tokens C + j*S .. (after WARM untimed steps)
        want = [[len(set(idx[[(C + j * S + i) % T for i in range(S)], layer].ravel().tolist()) - {-1})
                 for layer in range(L)] for j in range(WARM, WARM + N)]
        assert r["distinct_experts_per_layer_step"]["mean"] == pytest.approx(np.mean(want))
        assert r["union_bytes_per_step"] == pytest.approx(np.mean(want) * L * nbytes)
        assert r["x_s1_slice"] == pytest.approx(r["step_s_slice"] / rows[0]["step_s_slice"])
        assert r["moe_layer_ms"] is not None and r["step_s_glm5"] > 0
        assert "copied_bytes_per_step" not in r                   # no streaming engine: no copy counters
    assert rows[0]["x_s1_glm5"] == pytest.approx(1.0)
    mtp = vs.mtp_rows(rows, model.config.hidden_size, model.config.vocab_size)
    assert [m["drafts"] for m in mtp] == [1, 2, 3] and "auto" in mtp[0] and "auto" not in mtp[1]
    cells = vs.verify_table_rows(rows, mtp)
    assert [c[1] for c in cells] == ["1", "2", "3", "4"] and all(len(c) == len(vs.VERIFY_HEADERS) for c in cells)
    assert [c[8] for c in cells] == ["yes"] * 4


def test_engine_counters_cover_the_timed_steps_only(sliced):
    """The snapshot window: a counter of the expert ids the engine was asked for, taken around the timed steps,
    gives exactly the union of those steps (not the fill, the one-by-one check, the warm-up nor the no-expert
    steps)."""
    model, routing, src, _, _ = sliced

    def snapshot():
        asked = sum(len(ids) for _, ids in src.asked)
        return {"copy_bytes": asked * 1000, "copies": asked, "vram_slots": 7}
    raws = vs.VerifyBench(model, routing, N, WARM).run("cold-ram", [3], snapshot=snapshot)
    assert [r["positions"] for r in raws] == [1, 3]
    for raw in raws:
        assert raw["counters"]["copies"] == sum(map(sum, raw["distinct"])) and raw["vram_slots"] == 7
        f = vs.verify_figures(raw, L=len(model.config.moe_layers), nomoe_step_s=None, head_s=0.0,
                              vocab=model.config.vocab_size, record_bytes=1000)
        assert f["union_copied_once"] is True
        assert f["copied_bytes_per_step"] == pytest.approx(f["union_bytes_per_step"])


class _NeverReplays:
    """A backend's verify graphs on an engine that streams its experts: every step runs eagerly (greedy -> None)."""

    def __init__(self):
        self.replays, self.last_reason = 0, None

    def greedy(self, cache, ids):
        self.last_reason = "experts stream (a streaming engine)"
        return None


def test_with_replays_asked_the_counters_still_cover_the_timed_steps_only(sliced, monkeypatch):
    """COLI_VERIFY_GRAPHS=1 on an engine that cannot replay (cold-ram): the rows check their tokens with one more,
    untimed step -- outside the counters' window (review: it was counted, and the union looked copied twice); the
    row says none of its timed steps was replayed, and why."""
    model, routing, src, _, _ = sliced
    monkeypatch.setattr(type(model.backend), "verify_graphs", lambda self, m, force=False: _NeverReplays(),
                        raising=False)

    def snapshot():
        asked = sum(len(ids) for _, ids in src.asked)
        return {"copy_bytes": asked * 1000, "copies": asked, "vram_slots": 7}
    vb = vs.VerifyBench(model, routing, N, WARM, replay=True)
    assert isinstance(vb.graphs, _NeverReplays)
    for raw in vb.run("cold-ram", [3], snapshot=snapshot):
        assert raw["counters"]["copies"] == sum(map(sum, raw["distinct"]))
        assert raw["replays"] == 0 and "stream" in raw["eager_reason"]
        assert raw["replayed_tokens"] == raw["one_by_one"]
        f = vs.verify_figures(raw, L=len(model.config.moe_layers), nomoe_step_s=None, head_s=0.0,
                              vocab=model.config.vocab_size, record_bytes=1000)
        assert f["union_copied_once"] is True and f["replayed_equals_one_by_one"] is True
    assert sorted(vb._nomoe) == [(1, "cold-ram"), (3, "cold-ram")], "the no-expert steps measured per scenario"


def test_a_failing_step_size_costs_its_row_only(sliced):
    """S = 2's engine fails (its first snapshot, the third: S = 1 took two); S = 1 and 4 still give their rows, on
    a context that is still the context (S = 4's tokens equal its one-by-one run, its cache restored)."""
    model, routing, _, _, nbytes = sliced
    calls = []

    def snapshot():
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("out of memory (S = 2)")
        return {"copy_bytes": 0, "copies": 0}
    rows = vs.VerifyBench(model, routing, N, WARM).rows("cold-ram", [2, 4], snapshot=snapshot, record_bytes=nbytes)
    assert [(r["positions"], r.get("run", True)) for r in rows] == [(1, True), (2, False), (4, True)]
    assert "out of memory (S = 2)" in rows[1]["reason"]
    assert rows[2]["verify_equals_one_by_one"] is True and rows[2]["cache_restored"] is True
    assert rows[2]["x_s1_slice"] is not None
    assert [m["drafts"] for m in vs.mtp_rows(rows, model.config.hidden_size, model.config.vocab_size)] == [3]


def test_the_scenarios_verify_rows_land_in_the_result_and_a_failure_costs_only_them(sliced, capsys):
    """coli.bench.stream's hook (run inside warm and cold-ram with their engine installed), over the real model,
    routing and record layout the GPU runner holds: --verify 1 adds nothing; otherwise every S's row, the MTP rows
    and the acceptance (finish_verify), JSON-serialisable, printed; an engine that fails gives not-run rows."""
    from coli.bench import stream as st
    model, routing, _, _, nbytes = sliced
    rt = SimpleNamespace(synchronize=lambda: None)          # the numpy path has nothing to wait for
    runner = SimpleNamespace(model=model, routing=routing, b=SimpleNamespace(rt=rt),
                             layout=SimpleNamespace(nbytes=nbytes), report=lambda s: None)
    res: dict = {"tokens": N, "rows": [{"scenario": "warm", "tokens_per_s_glm5": 1.0}]}
    assert st._verified(runner, res, [1], N)("warm", None) is None and "verify" not in res
    hook = st._verified(runner, res, [1, 2], N)
    hook("warm", None)

    def broken():
        raise RuntimeError("the engine broke")
    hook("cold-ram", broken)
    steps = res["verify"]["steps"]
    assert [(r["scenario"], r.get("positions"), r.get("run", True)) for r in steps] == [
        ("warm", 1, True), ("warm", 2, True), ("cold-ram", 1, False), ("cold-ram", 2, False)]
    assert "RuntimeError: the engine broke" in steps[2]["reason"]
    st.finish_verify(res, model.config.hidden_size, model.config.vocab_size, 0.9)
    v = res["verify"]
    assert v["auto_acceptance"] == 0.9 and [m["drafts"] for m in v["mtp"]] == [1]
    assert v["mtp"][0]["auto"]["acceptance"] == 0.9 and v["mtp"][0]["x_decode_row_glm5"]["x"] is not None
    assert v["acceptance"]["warm"]["best_drafts"] == 1 and v["acceptance"]["cold-ram"]["speedup_glm5"] is None
    assert any("context" in n for n in v["notes"])
    json.dumps(res, default=st._json_default)
    said = []
    vs.print_verify_table(res, said.append)
    out = capsys.readouterr().out
    assert "MTP verify step" in out
    assert [c[2].startswith("not run") for c in vs.verify_table_rows(v["steps"], v["mtp"])] == [False] * 2 + [True] * 2
    assert said[0].startswith("* verify rows") and any("--mtp auto at acceptance 0.9" in s for s in said)
