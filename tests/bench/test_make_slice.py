"""make-slice: the slice is an ordinary container (reader, verify, shapes of the preset, records that decode to
weights of std ~0.02), written atomically, deterministic; the GLM-5 plan has the real sizes."""

from __future__ import annotations

import json

import numpy as np
import pytest

from coli.bench.slice import UNFINISHED, SliceOptions, make_slice, plan_slice, random_rows
from coli.bench.trace_router import TRACE_NAME
from coli.config import PRESETS, load_config
from coli.container.check import verify_container
from coli.container.format import MANIFEST_NAME, MatrixLayout, parse_manifest
from coli.container.quant import dequantize
from coli.container.reader import ContainerReader
from coli.model.tensors import dense_shapes, expert_shapes
from coli.trace import read_trace
from coli.traces_synth import generate
from slice_helpers import write_tiny
from tolerances import U16, assert_within

_SAME = [f for f in PRESETS["glm5"].__dataclass_fields__
         if f not in ("num_hidden_layers", "mlp_layer_types", "indexer_types")]


def test_tiny_slice_opens_verifies_and_has_the_preset_shapes(tiny_slice):
    r = ContainerReader(tiny_slice)
    try:
        c, t = r.config, PRESETS["tiny"]
        assert c.num_hidden_layers == 1 and c.moe_layers == [0] and c.dense_layers == []
        for f in _SAME:
            assert getattr(c, f) == getattr(t, f), f
        raw = json.loads((tiny_slice / "config.json").read_text())
        assert raw["first_k_dense_replace"] == 0
        assert raw["coli_bench_slice"]["generator"] == "coli bench make-slice"
        assert {n: e.shape for n, e in r.manifest.dense.items()} == dense_shapes(c)
        for e in (0, 7, c.n_routed_experts - 1):
            w = r.expert(0, e)                                        # reads and checks the record's xxh64
            for part, shape in expert_shapes(c).items():
                m = getattr(w, part.split("_")[0])
                assert m.shape == shape and np.isfinite(m).all()
                assert 0.015 < float(m.std()) < 0.025 and abs(float(m.mean())) < 2e-3
        for name in r.dense_names():
            x = r.dense(name)
            assert np.isfinite(x).all()
            if name.endswith("norm.weight"):
                assert (x == 1).all()
            elif x.ndim == 1:
                assert (x == 0).all()                                 # k_norm bias, correction bias
            else:
                assert 0.015 < float(x.std()) < 0.025, name
    finally:
        r.close()
    rep = verify_container(tiny_slice)
    assert rep.ok and rep.checked == 2 + len(dense_shapes(c)) + c.n_routed_experts   # copied files, tensors, records
    names = {f.name for f in parse_manifest(tiny_slice / MANIFEST_NAME).copied}
    assert names == {"config.json", TRACE_NAME}                      # coli verify checks the trace too
    assert not (tiny_slice / UNFINISHED).exists() and not tiny_slice.with_name("s1.tmp").exists()


def test_glm5_plan_has_the_real_dimensions_and_sizes():
    sp = plan_slice(SliceOptions(layers=2, tokens=8))                # plans, writes nothing
    c, g = sp.config, PRESETS["glm5"]
    for f in _SAME:
        assert getattr(c, f) == getattr(g, f), f
    assert (c.hidden_size, c.moe_intermediate_size, c.n_routed_experts, c.num_experts_per_tok) == (6144, 2048, 256, 8)
    assert c.mlp_layer_types == ("sparse", "sparse") and c.indexer_types == ("full", "full")
    assert sp.plan.record.nbytes == 20_054_016                       # docs/format.md, int4 g64
    assert sp.expert_bytes == 4096 + 2 * 256 * 20_054_016            # one expert file: header + records
    assert abs(sp.expert_bytes / 2 - 5.13e9) < 0.01e9
    assert "5.13 GB per layer" in sp.describe()
    shrunk = plan_slice(SliceOptions(layers=1, tokens=8, vocab=1000))
    assert shrunk.config.vocab_size == 1000 and shrunk.source()["vocab_shrunk"]
    assert shrunk.config.eos_token_ids == ()                          # the real eos ids are beyond 1000
    assert sp.dense_bytes - shrunk.dense_bytes > 2 * (154880 - 1000) * 6144 * 2 // 2   # embed + lm_head shrank


@pytest.mark.parametrize("fmt", ["int4", "int8", "int2", "bf16", "f32"])
def test_random_rows_are_valid_stored_rows_of_std_002(fmt):
    lay = MatrixLayout.make(256, 512, fmt, 64, 512)
    data, meta = random_rows(np.random.default_rng(0), lay, lay.rows)
    assert data.shape == (256, lay.row_data_bytes) and meta.shape == (256, lay.row_meta_bytes)
    w = dequantize(data, meta, fmt, lay.group, lay.cols)
    assert np.isfinite(w).all() and 0.017 < float(w.std()) < 0.023 and abs(float(w.mean())) < 1e-3
    if fmt == "int4":
        nib = np.concatenate([data & 15, data >> 4])
        assert ((nib % 2) == 1).all()                                 # q = nibble - 8 in +-1..+-7: never -8
    if fmt == "int8":
        assert data.view(np.int8).min() >= -127


def test_other_formats_make_valid_containers(tmp_path):
    d = write_tiny(tmp_path / "s", fmt="int8", dense_fmt="int4", group=32, experts=20, trace="uniform", tokens=5)
    r = ContainerReader(d)
    try:
        assert r.config.n_routed_experts == 20 and r.record_layout.gate.fmt == "int8"
        assert r.manifest.dense["model.layers.0.self_attn.o_proj.weight"].layout.fmt == "int4"
        assert r.manifest.dense["model.layers.0.mlp.gate.weight"].layout.fmt == "f32"     # routers stay f32
        assert 0.015 < float(r.expert(0, 19).down.std()) < 0.025
    finally:
        r.close()
    assert verify_container(d).ok


def test_same_options_same_bytes_other_seed_other_bytes(tmp_path, tiny_slice):
    again = write_tiny(tmp_path / "again", dense_fmt="bf16")          # the tiny_slice fixture's options
    a, b = (parse_manifest(p / MANIFEST_NAME) for p in (tiny_slice, again))
    assert a.to_json() == b.to_json()
    assert (tiny_slice / "dense.coli").read_bytes() == (again / "dense.coli").read_bytes()
    other = parse_manifest(write_tiny(tmp_path / "other", seed=1, dense_fmt="bf16") / MANIFEST_NAME)
    assert other.dense["lm_head.weight"].xxh64 != a.dense["lm_head.weight"].xxh64


def test_trace_is_stored_and_described(tiny_slice):
    tr = read_trace(tiny_slice / TRACE_NAME)
    c = load_config(tiny_slice)
    idx, w = generate("glm52", 256, 1, c.n_routed_experts, c.num_experts_per_tok, 0)
    assert tr.header.moe_layers == [0] and tr.header.top_k == c.num_experts_per_tok
    np.testing.assert_array_equal(tr.idx, idx)
    assert_within(tr.weights, w, U16 * np.abs(w) + 2.0 ** -25, "slice trace weights")   # stored as float16
    m = parse_manifest(tiny_slice / MANIFEST_NAME).source
    assert m["trace"]["stored_as"] == TRACE_NAME and m["trace"]["trace"] == "glm52" and m["trace"]["tokens"] == 256
    assert tr.header.meta["trace"] == "glm52"


def test_write_is_atomic_and_an_interrupted_run_leaves_nothing(tmp_path):
    d = tmp_path / "s"

    def boom(done, total):
        if done > total // 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        make_slice(d, SliceOptions(preset="tiny", layers=2), progress=boom)
    assert list(tmp_path.iterdir()) == []                            # never a half container, no DIR.tmp left
    (tmp_path / "s.tmp").mkdir()                                      # what a SIGKILLed run leaves
    (tmp_path / "s.tmp" / UNFINISHED).write_bytes(b"")
    (tmp_path / "s.tmp" / "dense.coli").write_bytes(b"partial")
    notes = []
    make_slice(d, SliceOptions(preset="tiny", layers=2), report=notes.append)
    assert any("interrupted" in n for n in notes) and not (tmp_path / "s.tmp").exists()
    assert verify_container(d).ok
