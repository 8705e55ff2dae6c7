"""`coli bench stream --batch`: the option's parsing and refusals (one line naming the value, before any GPU), and
the batched rows' core (coli.bench.batch_decode) run for real on a tiny slice on the numpy path: every B row
exists, each sequence of a batch gets exactly its tokens alone, and the experts per step counted are the union of
the rows' trace experts -- the ids the engine was asked for, once per MoE layer per step."""

from __future__ import annotations

import numpy as np
import pytest
from typer.testing import CliRunner

from coli.bench import batch_decode as bd
from coli.bench.trace_router import TRACE_NAME, TraceRouting
from coli.cli.main import app
from coli.container.reader import ContainerReader
from coli.errors import ColiError
from coli.model.forward import GlmMoeDsaModel
from coli.model.numpy_backend import NumpyBackend
from coli.trace import read_trace
from slice_helpers import AskedExperts


def test_parse_batches():
    assert bd.parse_batches("1") == [1]
    assert bd.parse_batches("16, 4,1,8,4") == [1, 4, 8, 16]
    for bad, culprit in (("", "name at least one"), (" , ", "name at least one"), ("4,x", "'x'"),
                         ("2.5", "'2.5'"), ("0", "--batch 0"), ("-3", "--batch -3"), ("999", "--batch 999")):
        with pytest.raises(ColiError, match=culprit) as e:
            bd.parse_batches(bad)
        assert "\n" not in str(e.value)


def test_check_batches():
    bd.check_batches([1], ["disk"], 1)                        # the default: nothing batched, nothing to check
    bd.check_batches([1, 8], ["cold-ram"], 8)
    with pytest.raises(ColiError, match="warm and cold-ram"):
        bd.check_batches([4], ["disk", "budget"], 256)
    with pytest.raises(ColiError, match="--batch 16: .* 8 tokens .*--tokens 16"):
        bd.check_batches([4, 16], ["warm"], 8)


def test_sequence_starts_are_distinct_and_sequence_0_is_the_scenarios():
    assert bd.sequence_starts(1, 256) == [0]
    assert bd.sequence_starts(4, 256) == [0, 64, 128, 192]
    s = bd.sequence_starts(16, 40)
    assert s[0] == 0 and len(set(s)) == 16
    assert bd.first_tokens(3, 100) == [1, 2, 3]


@pytest.mark.parametrize("args, culprit", [
    (["--batch", "4,zero"], "--batch 'zero': not a whole number"),
    (["--batch", "0"], "--batch 0: batch sizes are 1.."),
    (["--batch", "4", "--scenario", "disk"], "--batch 4: batched rows run in the warm and cold-ram"),
    (["--batch", "1,64", "--scenario", "warm"], "--batch 64: the slice's routing trace has 40 tokens"),
])
def test_cli_refuses_a_bad_batch_before_the_gpu(tiny_slice3, nogpu, args, culprit):
    res = CliRunner().invoke(app, ["bench", "stream", str(tiny_slice3), *args])
    assert res.exit_code == 2, res.output
    assert culprit in res.output and "CUDA" not in res.output


def test_cli_default_batch_reaches_the_gpu_check(tiny_slice3, nogpu):
    res = CliRunner().invoke(app, ["bench", "stream", str(tiny_slice3), "--scenario", "disk"])
    assert res.exit_code == 2 and "needs a CUDA GPU" in res.output          # --batch 1: no batch check at all


@pytest.fixture()
def sliced(tiny_slice3):
    r = ContainerReader(tiny_slice3)
    src = AskedExperts(r)
    model = GlmMoeDsaModel(r.config, r, NumpyBackend(), experts=src)
    yield model, TraceRouting(tiny_slice3), src, read_trace(tiny_slice3 / TRACE_NAME).idx
    r.close()


N, WARM = 3, 2


def test_each_sequence_of_a_batch_gets_its_tokens_alone(sliced):
    model, routing, _, _ = sliced
    bench = bd.BatchBench(model, routing, N, WARM)
    raw = bench.run("warm", 4)
    starts, firsts = bd.sequence_starts(4, routing.n_tokens), bd.first_tokens(4, model.config.vocab_size)
    assert raw["starts"] == starts
    for b in range(4):
        alone = bd.decode_batch(model, bd.SequenceRoutes(routing, [starts[b]]), [firsts[b]], N, WARM)
        assert alone["tokens"][0] == raw["tokens"][b]
        assert len(raw["tokens"][b]) == WARM + N
    assert len({tuple(t) for t in raw["tokens"]}) > 1          # the sequences really differ


def test_experts_per_step_are_the_union_and_the_engine_is_asked_it_once_per_layer(sliced):
    model, routing, src, idx = sliced                          # idx [T, L, K] of the stored trace
    B, L, T = 8, len(model.config.moe_layers), routing.n_tokens
    starts = bd.sequence_starts(B, T)
    src.asked.clear()
    raw = bd.BatchBench(model, routing, N, WARM).run("cold-ram", B)
    assert len(src.asked) == (WARM + N) * L                    # one stream() per MoE layer per step
    unions = []
    for t in range(WARM + N):
        rows = [(s + t) % T for s in starts]
        unions.append([sorted(set(idx[rows, layer].ravel().tolist()) - {-1}) for layer in range(L)])
    assert [ids for _, ids in src.asked] == [u for step in unions for u in step]
    assert raw["distinct"] == [[len(u) for u in step] for step in unions[WARM:]]    # the timed steps
    assert max(max(d) for d in raw["distinct"]) > model.config.num_experts_per_tok  # rows really add experts


def test_rows_for_every_batch_with_figures_and_ratios(sliced):
    model, routing, _, _ = sliced
    bench = bd.BatchBench(model, routing, N, WARM)
    rec = ContainerReader(routing.path.parent)
    nbytes = rec.record_layout.nbytes
    rec.close()
    rows = bench.rows("warm", [4, 8], record_bytes=nbytes)    # B=1 is added: the reference
    assert [r["batch"] for r in rows] == [1, 4, 8]
    L = len(model.config.moe_layers)
    for r in rows:
        assert r["scenario"] == "warm" and r["tokens"] == N
        assert r["row0_tokens_equal_b1"] is True               # numpy: sequence 0 is the B=1 sequence exactly
        assert r["agg_tokens_per_s_slice"] == pytest.approx(r["batch"] / (r["step_ms"]["mean"] / 1e3))
        assert r["seq_tokens_per_s_glm5"] == pytest.approx(r["agg_tokens_per_s_glm5"] / r["batch"])
        d = r["distinct_experts_per_layer_step"]["mean"]
        assert r["expert_bytes_per_token"] == pytest.approx(d * L * nbytes / r["batch"])
        assert r["glm5_expert_bytes_per_token"] == pytest.approx(d * 75 * nbytes / r["batch"])
        assert "copied_bytes_per_token" not in r                # no streaming engine: no copy counters
        assert r["graphs"] == {"step_replays": None, "step_eager_reason": None, "batch_replays": None,
                               "batch_eager_reason": None}            # the numpy path replays nothing
    assert rows[0]["x_b1_slice"] == pytest.approx(1.0) and rows[0]["x_b1_glm5"] == pytest.approx(1.0)
    assert rows[2]["x_b1_slice"] == pytest.approx(rows[2]["agg_tokens_per_s_slice"] / rows[0]["agg_tokens_per_s_slice"])
    cells = bd.batch_table_rows(rows)
    assert [c[1] for c in cells] == ["1", "4", "8"] and all(len(c) == len(bd.BATCH_HEADERS) for c in cells)


def test_batch_figures_from_known_times():
    # 2 MoE layers, B = 4: step 10 ms, the same step without routed experts 4 ms, lm_head over 4 rows 0.5 ms
    raw = {"scenario": "cold-ram", "batch": 4, "step_s": [0.010, 0.010], "tokens": [[1, 2]] * 4,
           "distinct": [[20, 24], [22, 26]], "counters": {"copy_bytes": 8 * 92, "copies": 92, "cpu_fallbacks": 0},
           "vram_slots": 16}
    f = bd.batch_figures(raw, L=2, nomoe_step_s=0.004, head_s=0.0005, vocab=154880, record_bytes=1000,
                         ref_tokens=[1, 2])
    assert f["moe_layer_ms"] == pytest.approx(3.0) and f["dense_layer_ms"] == pytest.approx(1.75)
    assert f["agg_tokens_per_s_glm5"] == pytest.approx(4 / (75 * 0.003 + 78 * 0.00175 + 0.0005))
    assert f["agg_tokens_per_s_slice"] == pytest.approx(400.0)
    assert f["distinct_experts_per_layer_step"] == {"mean": 23.0, "max": 26, "per_layer_mean": [21.0, 25.0]}
    assert f["expert_bytes_per_token"] == pytest.approx(23.0 * 2 * 1000 / 4)
    assert f["copied_bytes_per_token"] == pytest.approx(8 * 92 / 8) and f["copies_per_step"] == 46
    assert f["union_copied_once"] is True                       # 92 copies = 20 + 24 + 22 + 26 distinct
    assert bd.batch_figures({**raw, "counters": {"copies": 91}}, L=2, nomoe_step_s=None, head_s=0.0, vocab=1,
                            record_bytes=0)["union_copied_once"] is False
    assert f["row0_tokens_equal_b1"] is True and f["vram_slots"] == 16 and f["cpu_fallbacks"] == 0
    assert bd.batch_figures({**raw, "tokens": [[1, 3]] * 4}, L=2, nomoe_step_s=None, head_s=0.0, vocab=1,
                            record_bytes=0, ref_tokens=[1, 2])["row0_tokens_equal_b1"] is False


def test_acceptance_against_issue_15s_targets():
    rows = [{"scenario": "warm", "batch": 8, "x_b1_glm5": 5.5}, {"scenario": "cold-ram", "batch": 8, "x_b1_glm5": 1.5},
            {"scenario": "cold-ram", "batch": 4, "x_b1_glm5": 3.0}]
    a = bd.acceptance(rows)
    assert a["warm"] == {"batch": 8, "x_b1_glm5": 5.5, "target": 5.0, "met": True}
    assert a["cold-ram"]["met"] is False                        # the B = 8 row counts, not B = 4
    assert bd.acceptance(rows[:1])["cold-ram"] == {"batch": 8, "x_b1_glm5": None, "target": 2.0, "met": None}


def test_a_failing_batch_size_costs_its_row_only(sliced):
    """B = 4's engine fails (its third snapshot: B = 1 took two); B = 1 and 8 still give their rows and ratios."""
    model, routing, _, _ = sliced
    calls = []

    def snapshot():
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("out of memory (B = 4)")
        return {"copy_bytes": 0, "copies": 0}
    rows = bd.BatchBench(model, routing, N, WARM).rows("cold-ram", [4, 8], snapshot=snapshot)
    assert [(r["batch"], r.get("run", True)) for r in rows] == [(1, True), (4, False), (8, True)]
    assert "out of memory (B = 4)" in rows[1]["reason"]
    assert rows[2]["x_b1_slice"] is not None and rows[2]["row0_tokens_equal_b1"] is True


def test_a_batch_step_of_the_wrong_row_count_is_refused(sliced):
    model, routing, _, _ = sliced
    routes = bd.SequenceRoutes(routing, [0, 5])
    with pytest.raises(ColiError, match="routes 3 rows; a batched decode step has one row per sequence \\(2\\)"):
        routes(model.config.moe_layers[0], 3)
    assert np.array_equal(routes(0, 2)[0], routing.idx[[0, 5], 0])


def test_engine_counters_cover_the_timed_steps_only(sliced):
    """The snapshot window: a counter of the expert ids the engine was asked for (what a cache-less engine copies),
    taken around the timed steps, gives exactly the union bytes of those steps -- the warm-up steps are out."""
    model, routing, src, _ = sliced
    nbytes = 1000

    def snapshot():
        asked = sum(len(ids) for _, ids in src.asked)
        return {"copy_bytes": asked * nbytes, "copies": asked, "vram_slots": 7}
    raw = bd.BatchBench(model, routing, N, WARM).run("cold-ram", 4, snapshot=snapshot)
    assert raw["counters"]["copies"] == sum(map(sum, raw["distinct"])) and raw["vram_slots"] == 7
    f = bd.batch_figures(raw, L=len(model.config.moe_layers), nomoe_step_s=None, head_s=0.0,
                         vocab=model.config.vocab_size, record_bytes=nbytes)
    assert f["copied_bytes_per_token"] == pytest.approx(f["expert_bytes_per_token"]) and f["union_copied_once"]


def test_the_scenarios_batched_rows_land_in_the_result_and_a_failure_costs_only_them(sliced):
    """coli.bench.stream's hook (run inside warm and cold-ram with their engine installed), over the real model,
    routing and record layout the GPU runner holds: --batch 1 adds nothing; otherwise every B's row, the notes
    (with the overlap of short trace stretches), JSON-serialisable; an engine that fails gives a not-run row."""
    import json
    from types import SimpleNamespace

    from coli.bench import stream as st
    model, routing, _, _ = sliced
    rec = ContainerReader(routing.path.parent)
    rt = SimpleNamespace(synchronize=lambda: None)          # the numpy path has nothing to wait for
    runner = SimpleNamespace(model=model, routing=routing, b=SimpleNamespace(rt=rt), layout=rec.record_layout,
                             report=lambda s: None)
    res: dict = {}
    assert st._batched(runner, res, [1], N)("warm", None) is None and res == {}
    hook = st._batched(runner, res, [2, 16], N)
    hook("warm", None)

    def broken():
        raise RuntimeError("the engine broke")
    hook("cold-ram", broken)

    def refused():
        raise ColiError("a step the engine refused")
    hook("cold-ram", refused)                                  # a ColiError mid-run costs its rows, not the run
    rec.close()
    rows = res["batch"]["rows"]
    assert [(r["scenario"], r.get("batch")) for r in rows] == [("warm", 1), ("warm", 2), ("warm", 16)] + [
        ("cold-ram", b) for b in (1, 2, 16)] * 2                      # each B of a failing engine: its own row
    assert all(r["run"] is False and "RuntimeError: the engine broke" in r["reason"] for r in rows[3:6])
    assert all(r["run"] is False and "ColiError: a step the engine refused" in r["reason"] for r in rows[6:])
    assert res["batch"]["batches"] == [1, 2, 16]
    assert any("overlap" in n for n in res["batch"]["notes"])           # 40 trace tokens // 16 < 2 + 3 steps
    json.dumps(res, default=st._json_default)
    assert len(bd.batch_table_rows(rows)) == 9
