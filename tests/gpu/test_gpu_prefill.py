"""The int4 prefill (S > 1) on the tensor cores (cuda/prefill_mma.cu): the dense linear (int4 and int8 weights) and
the grouped MoE against numpy and float64, next to the fp32 tiled GEMMs (gemm.cu, "v1") on the same inputs; NaN
confined to its token; deterministic results; partial tiles, pruned slots and mixed record layouts."""

from __future__ import annotations

import numpy as np
import pytest

from gpu_helpers import F32, TOL, qweight, rand, rel_err, report, stored_matrix
from test_gpu_moe import _experts, moe_reference

pytestmark = pytest.mark.gpu


def _with(gb, version, fn, int8: bool = True):
    """fn() with prefill_kernels = version and pf_linear_int8 taken (COLI_PREFILL_INT8=1: these tests are its check)."""
    saved = gb.prefill_kernels, gb.prefill_int8
    gb.prefill_kernels, gb.prefill_int8 = version, int8
    try:
        return fn()
    finally:
        gb.prefill_kernels, gb.prefill_int8 = saved


def activations(rng, S: int, cols: int, kind: str) -> np.ndarray:
    """x [S, cols] for the linear tests: "normal"; "wide" (elements 2^-20 .. 2^7 of the others: a block's small values
    meet the split's 2^-27 cut); "zero-blocks" (the first 64 columns zero: one whole split block of zeros)."""
    x = rand(rng, S, cols)
    if kind == "wide":
        x *= np.exp2(rng.integers(-20, 8, x.shape)).astype(F32)
    elif kind == "zero-blocks":
        x[:, :64] = 0
    return x


@pytest.mark.parametrize("rows,cols,group,S,xkind", [
    (2048, 6144, 64, 70, "normal"),      # q_a_proj, a partial token tile
    (6144, 16384, 128, 5, "normal"),     # o_proj
    (2048, 6144, 64, 130, "wide"),       # elements 2^-20 of their block's largest
    (256, 128, 64, 3, "zero-blocks"),
])
def test_linear_tensor_cores_as_exact_as_fp32(gb, rng, rows, cols, group, S, xkind):
    from coli.gpu.cuda_backend import pf_layout_ok
    buf, lay, ref = stored_matrix(rows, cols, "int4", rng, group=group)
    assert pf_layout_ok(lay)
    w = qweight(gb, buf, lay)
    x = activations(rng, S, cols, xkind)
    want = x.astype(np.float64) @ ref.T.astype(np.float64)
    errs = {v: rel_err(_with(gb, v, lambda: gb.to_host(gb.linear(gb.upload(x), w))), want) for v in ("v1", "mma")}
    report("prefill_linear", shape=[rows, cols], group=group, S=S, x=xkind,
           **{f"rel_err_{k}": e for k, e in errs.items()})
    assert errs["mma"] < TOL
    assert errs["mma"] <= 4 * errs["v1"] + 1e-7, errs


@pytest.mark.parametrize("rows,fmt,S", [(256, "int4", 9), (300, "int8", 40)])
def test_linear_nan_stays_in_its_token(gb, rng, rows, fmt, S):
    """A NaN in one token's activations reaches that token's outputs and no other's (int4: pf_linear_int4; int8:
    pf_linear_int8, whose 300 rows leave its last row block partial)."""
    buf, lay, ref = stored_matrix(rows, 256, fmt, rng)
    w = qweight(gb, buf, lay)
    x = rand(rng, S, 256)
    x[4, 100] = np.nan
    got = _with(gb, "mma", lambda: gb.to_host(gb.linear(gb.upload(x), w)))
    assert np.isnan(got[4]).all()
    assert np.isfinite(np.delete(got, 4, axis=0)).all()


def _sweep():
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    import pf_kernel_sweep
    return pf_kernel_sweep


def _kernels_run(gb, fn):
    """fn() and the names of the kernels it launched (the real launches, recorded on their way)."""
    names, launch = [], gb.rt.launch

    def recording(f, *a, **kw):
        names.append(getattr(f, "coli_name", "?"))
        return launch(f, *a, **kw)
    gb.rt.launch = recording
    try:
        return fn(), names
    finally:
        del gb.rt.launch


@pytest.mark.parametrize("rows,cols,S,xkind", [
    (2048, 6144, 70, "normal"),          # q_a_proj, a partial token tile
    (576, 6144, 130, "wide"),            # kv_a_proj: a partial row block; elements 2^-20 of their block's largest
    (16384, 2048, 300, "normal"),        # q_b_proj
    (6144, 16384, 33, "normal"),         # o_proj: 256 blocks of 64 columns
    (128, 6144, 17, "zero-blocks"),      # the indexer's wk: half a row block; the smallest S the GEMM takes
])
def test_linear_int8_tensor_cores_within_the_float64_bound(gb, rng, rows, cols, S, xkind):
    """pf_linear_int8 at GLM-5's int8 dense-core shapes against float64, each output within linear_f64_bound (the
    split's 2^-27 per block, the per-block and accumulation roundings: derived from the magnitudes), beside the
    fp32 tiles (v1) on the same inputs. Its bits are not the tiles' (another summation order): float64 decides."""
    from coli.gpu.cuda_backend import pf_int8_layout_ok
    buf, lay, ref = stored_matrix(rows, cols, "int8", rng)
    assert pf_int8_layout_ok(lay)
    w = qweight(gb, buf, lay)
    x = activations(rng, S, cols, xkind)
    want, bound = _sweep().linear_f64_bound(x, ref)
    xd = gb.upload(x)
    got, names = _with(gb, "mma", lambda: _kernels_run(gb, lambda: gb.to_host(gb.linear(xd, w))))
    assert names == ["pf_split_rows", "pf_linear_int8"], names
    v1 = _with(gb, "v1", lambda: gb.to_host(gb.linear(xd, w)))
    over = np.abs(got.astype(np.float64) - want) / bound
    errs = {"mma": rel_err(got, want), "v1": rel_err(v1, want)}
    report("prefill_linear_int8", shape=[rows, cols], S=S, x=xkind, err_over_bound=float(over.max()),
           **{f"rel_err_{k}": e for k, e in errs.items()})
    assert over.max() <= 1.0, (over.max(), np.unravel_index(over.argmax(), over.shape))
    assert errs["mma"] < TOL
    assert errs["mma"] <= 4 * errs["v1"] + 1e-7, errs




PREFILL_MOE = [  # H, Im, group, E, K, S
    (6144, 2048, 64, 12, 8, 70),      # GLM-5 experts
    (256, 128, 64, 16, 4, 100),
    (256, 128, 128, 6, 3, 41),
    (256, 128, 64, 3, 2, 130),        # ~87 pairs per expert: several tiles each, the last one partial
]


@pytest.mark.parametrize("H,Im,group,E,K,S", PREFILL_MOE)
def test_moe_prefill_tensor_cores(gb, rng, H, Im, group, E, K, S):
    from coli.gpu.cuda_backend import pf_moe_layout_ok
    recs, mats = _experts(gb, H, Im, "int4", group, E, rng)
    assert pf_moe_layout_ok(recs[0].layout) and gb._pf_ok(1)      # the tensor-core path, not a fallback
    x = rand(rng, S, H)
    idx = np.stack([rng.choice(E, K, replace=False) for _ in range(S)]).astype(np.int64)
    w = rng.uniform(0.1, 1.0, (S, K)).astype(F32)
    wanted = sorted(set(idx.ravel().tolist()))

    def run(version):
        return _with(gb, version, lambda: gb.to_host(gb.moe(gb.upload(x), idx, w, ((e, recs[e]) for e in wanted))))
    got = run("mma")
    err = rel_err(got, moe_reference(x, idx, w, mats))
    report("prefill_moe", shape=[H, Im], group=group, E=E, K=K, S=S, rel_err=err,
           rel_err_v1=rel_err(run("v1"), moe_reference(x, idx, w, mats)))
    assert err < TOL
    np.testing.assert_array_equal(run("mma"), got)          # fixed summation order: the same bits every run


def test_moe_prefill_mixed_layouts_and_pruned_slots(gb, rng):
    """Int4 records (tensor cores) and host experts uploaded as f32 records (fp32 GEMMs) in one prefill, with
    pruned slots (id -1, weight 0): each path adds its own experts' rows, nothing twice."""
    from coli.weights import ExpertWeights
    H, Im, E, K, S = 256, 128, 8, 4, 23
    recs, mats = _experts(gb, H, Im, "int4", 64, E, rng)
    x = rand(rng, S, H)
    idx = np.stack([rng.choice(E, K, replace=False) for _ in range(S)]).astype(np.int64)
    w = rng.uniform(0.1, 1.0, (S, K)).astype(F32)
    idx[::3, -1] = -1
    w[::3, -1] = 0
    wanted = sorted(e for e in set(idx.ravel().tolist()) if e >= 0)
    src = [(e, recs[e] if e % 2 else ExpertWeights(*mats[e])) for e in wanted]
    got = _with(gb, "mma", lambda: gb.to_host(gb.moe(gb.upload(x), idx, w, iter(src))))
    keep = np.where(idx < 0, 0, idx)
    assert rel_err(got, moe_reference(x, keep, np.where(idx < 0, 0, w), mats)) < TOL


def test_moe_prefill_nan_stays_in_its_token(gb, rng):
    H, Im, E, K, S = 256, 128, 6, 2, 12
    recs, mats = _experts(gb, H, Im, "int4", 64, E, rng)
    x = rand(rng, S, H)
    x[7, 3] = np.nan
    idx = np.stack([rng.choice(E, K, replace=False) for _ in range(S)]).astype(np.int64)
    w = rng.uniform(0.1, 1.0, (S, K)).astype(F32)
    got = _with(gb, "mma", lambda: gb.to_host(gb.moe(gb.upload(x), idx, w, ((e, recs[e]) for e in range(E)))))
    assert np.isnan(got[7]).all()
    assert np.isfinite(np.delete(got, 7, axis=0)).all()


def test_moe_prefill_in_chunks(gb, rng, monkeypatch):
    """A prompt longer than one chunk of buffers (PREFILL_CHUNK_BYTES) goes through in chunks, each with its own
    split x, pair tiles and slot sum written at its rows -- the same result as numpy."""
    import coli.gpu.cuda_backend as cb
    H, Im, E, K, S = 256, 128, 6, 3, 70
    recs, mats = _experts(gb, H, Im, "int4", 64, E, rng)
    x = rand(rng, S, H)
    idx = np.stack([rng.choice(E, K, replace=False) for _ in range(S)]).astype(np.int64)
    w = rng.uniform(0.1, 1.0, (S, K)).astype(F32)
    per_token = K * H * 4 + K * Im * 9 // 2 + H * 9 // 2
    monkeypatch.setattr(cb, "PREFILL_CHUNK_BYTES", 17 * per_token)        # chunks of ~17 tokens: 5 of them
    got = _with(gb, "mma", lambda: gb.to_host(gb.moe(gb.upload(x), idx, w, ((e, recs[e]) for e in range(E)))))
    assert rel_err(got, moe_reference(x, idx, w, mats)) < TOL


# variants of prefill_mma.cu (scripts/pf_kernel_sweep.py): each flush, the skip, the hoisted copies, the 4- and
# 16-warp blocks; each computes every output's integer sums and fp32 flush in the default's order, so each must
# give the default's bits (partial tiles and a partial token tile included)
PF_VARIANTS = ["epi1", "epi2-skip", "epi2-skip-hoist", "epi2-skip-128x32-minb3", "epi2-256x64-minb1", "epi1-skip2",
               "skip2-hoist2", "epi1-skip-hoist2"]


@pytest.mark.parametrize("name", PF_VARIANTS)
def test_prefill_variants_give_the_default_bits(gb, rng, name, monkeypatch):
    import shutil
    import sys
    from pathlib import Path
    import coli.gpu.cuda_backend as cb
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    import pf_kernel_sweep as sweep
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    if not Path(nvcc).is_file() and shutil.which(nvcc) is None:
        pytest.skip("nvcc not found: the variants are built from source")
    defs = sweep.VARIANTS[name]
    cubin, _ = sweep.compile_variant(nvcc, f"{gb.rt.cc[0]}{gb.rt.cc[1]}", defs)
    cases = [(6144, 2048, 64, 12, 8, 70), (256, 128, 64, 3, 2, 130), (256, 128, 128, 6, 3, 41)]
    inputs = []
    for H, Im, group, E, K, S in cases:
        recs, _ = _experts(gb, H, Im, "int4", group, E, rng)
        x = rand(rng, S, H)
        x[1] *= np.float32(2.0 ** -30)                      # a token far below the others: its own exponents
        idx = np.stack([rng.choice(E, K, replace=False) for _ in range(S)]).astype(np.int64)
        w = rng.uniform(0.1, 1.0, (S, K)).astype(F32)
        inputs.append((gb.upload(x), idx, w, recs))
    buf, lay, _ = stored_matrix(2048, 6144, "int4", rng, group=64)
    wq, xd = qweight(gb, buf, lay), gb.upload(rand(rng, 70, 6144))
    buf8, lay8, _ = stored_matrix(576, 6144, "int8", rng)                 # int8: kv_a, a partial row block
    wq8 = qweight(gb, buf8, lay8)

    def outputs():
        return ([_with(gb, "mma", lambda: gb.to_host(gb.moe(x, idx, w, ((e, recs[e]) for e in sorted(recs)))))
                 for x, idx, w, recs in inputs] + [_with(gb, "mma", lambda: gb.to_host(gb.linear(xd, wq))),
                                                   _with(gb, "mma", lambda: gb.to_host(gb.linear(xd, wq8)))])
    want = outputs()
    try:
        gb.rt.use_module("prefill_mma", gb.rt.drv.module_from_buffer(cubin))
        for k in ("PF_ROWS", "PF_TOKS", "PF_STAGES"):
            monkeypatch.setattr(cb, k, defs[k])
        got = outputs()
    finally:
        gb.rt.use_module("prefill_mma", None)
    monkeypatch.undo()
    for i, (g_, w_) in enumerate(zip(got, want)):
        np.testing.assert_array_equal(g_, w_, err_msg=f"{name}, case {i}")
    np.testing.assert_array_equal(outputs()[0], want[0])     # the shipped module again afterwards
