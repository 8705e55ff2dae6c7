"""Routing trace format: round trip through the recorder, appending, reading while it grows, torn
records, refusals, and `coli run --record-routing` on an oracle model."""

from __future__ import annotations

import json

import numpy as np
import pytest

from coli.trace import (MAGIC, RoutingRecorder, TraceFormatError, TraceHeader, TraceReader, read_trace,
                        write_trace)
from tolerances import U16, assert_within

LAYERS = [1, 2, 4]


def _routing(rng, S, E=256, K=8):
    idx = np.stack([rng.choice(E, K, replace=False) for _ in range(S)]).astype(np.int64)
    w = rng.random((S, K)).astype(np.float32) * 2.5
    return idx, w


def _forward(rec, rng, S, E=256, K=8):
    """What GlmMoeDsaModel does: the hook once per MoE layer with S rows."""
    calls = []
    for layer in LAYERS:
        idx, w = _routing(rng, S, E, K)
        rec(layer, idx, w)
        calls.append((idx, w))
    return calls


def test_round_trip_prefill_and_decode(tmp_path):
    rng = np.random.default_rng(0)
    p = tmp_path / "a.trace"
    rec = RoutingRecorder(p, LAYERS, 256, 8, meta={"model": "x"})
    rec.new_sequence()
    calls = [_forward(rec, rng, 5)] + [_forward(rec, rng, 1) for _ in range(3)]
    rec.close()
    tr = read_trace(p)
    assert tr.header.moe_layers == LAYERS and tr.header.n_experts == 256 and tr.header.top_k == 8
    assert tr.header.meta == {"model": "x"}
    assert tr.n_tokens == 8 and tr.idx.shape == (8, 3, 8) and tr.idx.dtype == np.int32
    want_idx = np.concatenate([np.stack([c[l][0] for l in range(3)], axis=1) for c in calls])
    want_w = np.concatenate([np.stack([c[l][1] for l in range(3)], axis=1) for c in calls])
    np.testing.assert_array_equal(tr.idx, want_idx)
    # stored as float16: one rounding (relative U16, or half the 2**-24 subnormal spacing near 0)
    assert_within(tr.weights, want_w, U16 * np.abs(want_w) + 2.0 ** -25, "trace weights")
    assert tr.prefill.tolist() == [True] * 5 + [False] * 3
    assert tr.seq.tolist() == [0] * 8
    # compact: 8-byte record head + K uint16 ids + K float16 weights
    assert tr.header.dtype.itemsize == 8 + 8 * 2 + 8 * 2
    assert p.stat().st_size == len(tr.header.encode()) + 8 * 3 * 40


def test_small_models_use_uint8_ids_and_dropped_slots_read_back_as_minus_one(tmp_path):
    p = tmp_path / "b.trace"
    rec = RoutingRecorder(p, [1], 16, 4)
    rec(1, np.array([[3, 7, -1, -1]]), np.array([[1.5, 1.0, 0.0, 0.0]], np.float32))
    rec.close()
    tr = read_trace(p)
    assert tr.header.id_dtype == np.uint8 and tr.header.dtype.itemsize == 8 + 4 + 8
    assert tr.idx[0, 0].tolist() == [3, 7, -1, -1]
    assert tr.weights[0, 0].tolist() == [1.5, 1.0, 0.0, 0.0]


def test_append_continues_tokens_and_sequences_and_refuses_other_shapes(tmp_path):
    rng = np.random.default_rng(1)
    p = tmp_path / "c.trace"
    with RoutingRecorder(p, LAYERS, 256, 8) as rec:
        rec.new_sequence()
        _forward(rec, rng, 3)
        rec.new_sequence()
        _forward(rec, rng, 2)
    with RoutingRecorder(p, LAYERS, 256, 8) as rec:
        rec.new_sequence()
        _forward(rec, rng, 4)
    tr = read_trace(p)
    assert tr.n_tokens == 9
    assert tr.seq.tolist() == [0, 0, 0, 1, 1, 2, 2, 2, 2]
    with pytest.raises(TraceFormatError, match="cannot append"):
        RoutingRecorder(p, LAYERS, 128, 8)
    with RoutingRecorder(p, LAYERS, 128, 8, append=False) as rec:  # replace instead
        _forward(rec, rng, 1, E=128)
    assert read_trace(p).n_tokens == 1


def test_torn_last_record_is_ignored_by_readers_and_dropped_by_the_next_writer(tmp_path):
    rng = np.random.default_rng(2)
    p = tmp_path / "d.trace"
    with RoutingRecorder(p, LAYERS, 256, 8) as rec:
        _forward(rec, rng, 2)
    with open(p, "ab") as f:
        f.write(b"\x01" * 13)  # a writer killed mid-record
    assert read_trace(p).n_tokens == 2
    with RoutingRecorder(p, LAYERS, 256, 8) as rec:
        _forward(rec, rng, 1)
    tr = read_trace(p)
    assert tr.n_tokens == 3 and (p.stat().st_size - len(tr.header.encode())) % tr.header.dtype.itemsize == 0


def test_reader_follows_a_growing_trace_token_by_token(tmp_path):
    rng = np.random.default_rng(3)
    p = tmp_path / "e.trace"
    rec = RoutingRecorder(p, LAYERS, 256, 8)
    reader = TraceReader(p)
    assert reader.poll().n_tokens == 0
    idx, w = _routing(rng, 4)
    rec(1, idx, w)
    rec(2, idx, w)
    rec.flush()
    assert reader.poll().n_tokens == 0          # layers 1 and 2 of the prefill only: not complete
    rec(4, idx, w)
    got = reader.poll()
    assert got.n_tokens == 4 and got.idx[:, 2].tolist() == idx.tolist()
    _forward(rec, rng, 1)
    got = reader.poll()
    assert got.n_tokens == 1 and not got.prefill[0]
    rec.close()
    assert reader.poll().n_tokens == 0


def test_recorder_rejects_inconsistent_calls(tmp_path):
    rec = RoutingRecorder(tmp_path / "f.trace", LAYERS, 256, 8)
    idx, w = _routing(np.random.default_rng(4), 3)
    with pytest.raises(ValueError, match="not a MoE layer"):
        rec(3, idx, w)
    rec(1, idx, w)
    with pytest.raises(ValueError, match="routed 1 tokens"):
        rec(2, idx[:1], w[:1])
    rec.close()


@pytest.mark.parametrize("mutate, field", [
    (lambda b: b"NOTATRAC" + b[8:], "magic"),
    (lambda b: b.replace(b'"version": 1', b'"version": 9'), "version"),
    (lambda b: b.replace(b'"format": "coli-routing-trace"', b'"format": "coli-routing-xxxxx"'), "format"),
    (lambda b: b[:20], "truncated"),
])
def test_reader_refuses_what_it_does_not_understand(tmp_path, mutate, field):
    p = tmp_path / "g.trace"
    write_trace(p, np.zeros((2, 1, 2), np.int32) + np.array([0, 1]), n_experts=4)
    p.write_bytes(mutate(p.read_bytes()))
    with pytest.raises(TraceFormatError, match=field) as e:
        read_trace(p)
    assert str(p) in str(e.value)


def test_header_is_json_after_the_magic(tmp_path):
    p = tmp_path / "h.trace"
    write_trace(p, np.arange(6, dtype=np.int32).reshape(1, 3, 2), n_experts=8, moe_layers=[3, 4, 5],
                meta={"generator": "test"})
    raw = p.read_bytes()
    assert raw[:8] == MAGIC
    n = int.from_bytes(raw[8:12], "little")
    h = json.loads(raw[12:12 + n])
    assert h["moe_layers"] == [3, 4, 5] and h["n_layers"] == 3 and h["id_dtype"] == "uint8"
    assert h["record_bytes"] == TraceHeader([3, 4, 5], 8, 2).dtype.itemsize
    assert read_trace(p).idx.tolist() == [[[0, 1], [2, 3], [4, 5]]]


def test_coli_run_records_what_the_router_chose(tmp_path, tmp_path_factory):
    from typer.testing import CliRunner

    from coli.cli.main import app
    from coli.generate import Generation
    from coli.loader import load_model
    from oracles import oracle_dir

    d = oracle_dir(tmp_path_factory.mktemp("oracles"), "default")
    p = tmp_path / "run.trace"
    r = CliRunner().invoke(app, ["run", "-m", str(d), "--prompt-ids", "1,2,3,4,5", "-n", "6", "--ignore-eos",
                                 "--record-routing", str(p), "--json"])
    assert r.exit_code == 0, r.output
    tr = read_trace(p)
    model, cfg = load_model(d)
    assert tr.header.moe_layers == cfg.moe_layers and tr.header.top_k == cfg.num_experts_per_tok
    # the model forwards the prompt and every generated token but the last
    assert tr.n_tokens == 5 + 6 - 1 and tr.prefill.tolist() == [True] * 5 + [False] * 5
    seen = {}
    model.routing_hook = lambda layer, idx, w: seen.setdefault(layer, []).append(idx.copy())
    list(Generation(model, [1, 2, 3, 4, 5], 6, ignore_eos=True))
    for j, layer in enumerate(cfg.moe_layers):
        want = np.concatenate(seen[layer])
        assert np.sort(tr.idx[:, j], axis=-1).tolist() == np.sort(want, axis=-1).tolist()
