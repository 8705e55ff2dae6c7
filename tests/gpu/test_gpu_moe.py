"""Router (sigmoid + bias + group-limited top-k), the fused MoE decode (one launch for all experts' gate/up, one
for down), the grouped MoE prefill and the dense SwiGLU, against numpy; GLM-5's expert shape at int4 included."""

from __future__ import annotations

import numpy as np
import pytest

from coli.model.numpy_backend import NumpyBackend, expert_ffn
from coli.weights import ExpertWeights
from gpu_helpers import F32, TOL, qweight, rand, random_record, rel_err, report, stored_matrix

pytestmark = pytest.mark.gpu
NP = NumpyBackend()


@pytest.mark.parametrize("E,K,H,S,ng,tg", [(256, 8, 6144, 1, 1, 1), (256, 8, 6144, 3, 8, 4), (16, 4, 128, 5, 1, 1),
                                          (16, 4, 128, 2, 4, 2)])
def test_route(gb, rng, E, K, H, S, ng, tg):
    x, gw, bias = rand(rng, S, H), rand(rng, E, H, scale=0.02), rand(rng, E, scale=0.05)
    idx, w = gb.route(gb.upload(x), gb.matrix(gw), gb.upload(bias), ng, tg, K, True, 2.5)
    ridx, rw = NP.route(x, gw, bias, ng, tg, K, True, 2.5)
    for s in range(S):
        assert sorted(idx[s].tolist()) == sorted(ridx[s].tolist())
        a = dict(zip(idx[s].tolist(), w[s].tolist()))
        b = dict(zip(ridx[s].tolist(), rw[s].tolist()))
        for e in a:
            assert abs(a[e] - b[e]) <= 1e-6 * abs(b[e])


# ---- MoE: fused decode (one token) and grouped prefill --------------------------------------------------------
def moe_reference(x, idx, w, mats):
    out = np.zeros_like(x)
    for s in range(x.shape[0]):
        for k in range(idx.shape[1]):
            g, u, d = mats[int(idx[s, k])]
            out[s] += w[s, k] * expert_ffn(x[s:s + 1], g, u, d)[0]
    return out


def _experts(gb, H, Im, fmt, group, n, rng):
    from coli.gpu.cuda_weights import DeviceRecord
    recs, mats = {}, {}
    for e in range(n):
        buf, lay, m = random_record(H, Im, fmt, rng, group=group)
        d = gb.rt.alloc(lay.nbytes)
        gb.rt.upload_bytes(buf, int(d))
        recs[e] = DeviceRecord(int(d), lay, owner=d)
        mats[e] = m
    return recs, mats


MOE_CASES = [  # H, Im, fmt, group, E, K, S
    (6144, 2048, "int4", 64, 8, 8, 1),       # GLM-5 experts, one token
    (6144, 2048, "int4", 64, 12, 8, 3),      # GLM-5 experts, a short prefill
    (128, 64, "int4", 32, 16, 4, 1), (128, 64, "int4", 128, 16, 4, 1),
    (128, 64, "int8", 0, 16, 4, 1), (128, 64, "bf16", 0, 16, 4, 1), (128, 64, "f32", 0, 16, 4, 1),
    (128, 64, "int4", 64, 16, 4, 37), (128, 64, "int8", 0, 16, 4, 37), (128, 64, "bf16", 0, 16, 4, 9),
    (128, 64, "f32", 0, 16, 4, 21),
    (100, 40, "bf16", 0, 6, 3, 1),           # rows not 16-byte multiples: the grouped GEMM path at S = 1
]


@pytest.mark.parametrize("H,Im,fmt,group,E,K,S", MOE_CASES)
def test_moe(gb, rng, H, Im, fmt, group, E, K, S):
    recs, mats = _experts(gb, H, Im, fmt, group or 64, E, rng)
    x = rand(rng, S, H)
    idx = np.stack([rng.choice(E, K, replace=False) for _ in range(S)]).astype(np.int64)
    w = rng.uniform(0.1, 1.0, (S, K)).astype(F32)
    wanted = sorted(set(idx.ravel().tolist()))
    got = gb.to_host(gb.moe(gb.upload(x), idx, w, ((e, recs[e]) for e in wanted)))
    err = rel_err(got, moe_reference(x, idx, w, mats))
    report("moe", shape=[H, Im], fmt=fmt, group=group, K=K, S=S, rel_err=err)
    assert err < TOL


def test_moe_mixed_device_and_host_experts(gb, rng):
    """Experts that arrive as host float32 matrices (the RAM-tier path) join the device records' launch."""
    H, Im, E, K = 128, 64, 8, 4
    recs, mats = _experts(gb, H, Im, "int4", 64, E, rng)
    for S in (1, 6):
        x = rand(rng, S, H)
        idx = np.stack([rng.choice(E, K, replace=False) for _ in range(S)]).astype(np.int64)
        w = rng.uniform(0.1, 1.0, (S, K)).astype(F32)
        wanted = sorted(set(idx.ravel().tolist()))
        src = [(e, recs[e] if e % 2 else ExpertWeights(*mats[e])) for e in wanted]
        got = gb.to_host(gb.moe(gb.upload(x), idx, w, iter(src)))
        assert rel_err(got, moe_reference(x, idx, w, mats)) < TOL


@pytest.mark.parametrize("H,I,fmt,S", [(6144, 2048, "int4", 1), (6144, 2048, "int8", 1), (128, 256, "f32", 1),
                                       (128, 256, "bf16", 4), (6144, 2048, "int4", 3)])
def test_swiglu_dense_and_shared_expert(gb, rng, H, I, fmt, S):
    g, lg, G = stored_matrix(I, H, fmt, rng)
    u, lu, U = stored_matrix(I, H, fmt, rng)
    d, ld, D = stored_matrix(H, I, fmt, rng)
    x = rand(rng, S, H)
    got = gb.to_host(gb.swiglu(gb.upload(x), qweight(gb, g, lg), qweight(gb, u, lu), qweight(gb, d, ld)))
    assert rel_err(got, expert_ffn(x, G, U, D)) < TOL


@pytest.mark.parametrize("S", [1, 5])
def test_moe_with_pruned_slots(gb, rng, S):
    """Expert top-p marks dropped slots with id -1 and weight 0: they add nothing."""
    H, Im, E, K = 128, 64, 12, 4
    recs, mats = _experts(gb, H, Im, "int4", 64, E, rng)
    x = rand(rng, S, H)
    idx = np.stack([rng.choice(E, K, replace=False) for _ in range(S)]).astype(np.int64)
    w = rng.uniform(0.1, 1.0, (S, K)).astype(F32)
    idx[:, -1] = -1
    w[:, -1] = 0
    wanted = sorted(e for e in set(idx.ravel().tolist()) if e >= 0)
    got = gb.to_host(gb.moe(gb.upload(x), idx, w, ((e, recs[e]) for e in wanted)))
    keep = idx[:, :-1]
    assert rel_err(got, moe_reference(x, keep, w[:, :-1], mats)) < TOL


@pytest.mark.parametrize("K,S_experts", [(8, 8), (3, 5)])
def test_moe_decode_kernel_versions_match_numpy(gb, rng, K, S_experts):
    """Every version of the fused decode at GLM-5's expert shape against numpy: the tensor-core kernels (mma,
    the default for int4 g64), v2 and the first (*_int4_v1, kept for the benchmark); and an odd K (v2's expert
    pairs with one expert; mma's down kernel with idle warps)."""
    H, Im = 6144, 2048
    recs, mats = _experts(gb, H, Im, "int4", 64, S_experts, rng)
    x = rand(rng, 1, H)
    idx = rng.choice(S_experts, K, replace=False)[None].astype(np.int64)
    w = rng.uniform(0.1, 1.0, (1, K)).astype(F32)
    want = moe_reference(x, idx, w, mats)
    saved = gb.moe_kernels
    try:
        for ver in ("v1", "v2", "mma"):
            gb.moe_kernels = ver
            got = gb.to_host(gb.moe(gb.upload(x), idx, w, ((int(e), recs[int(e)]) for e in idx[0])))
            err = rel_err(got, want)
            report("moe_version", version=ver, K=K, rel_err=err)
            assert err < TOL, ver
    finally:
        gb.moe_kernels = saved


def _moe_float64(x, idx, w, mats):
    """The MoE output in float64 (what both kernel families approximate)."""
    out = np.zeros(x.shape, np.float64)
    for k in range(idx.shape[1]):
        G, U, D = (m.astype(np.float64) for m in mats[int(idx[0, k])])
        g, u = G @ x[0].astype(np.float64), U @ x[0].astype(np.float64)
        hk = (g / (1 + np.exp(-g)) * u).astype(F32).astype(np.float64)
        out[0] += w[0, k] * (D @ hk)
    return out


@pytest.mark.parametrize("H,Im,group,K,xkind", [
    (256, 128, 64, 8, "normal"), (256, 128, 128, 8, "normal"), (256, 128, 64, 1, "normal"),
    (256, 128, 64, 3, "normal"), (384, 256, 64, 5, "wide"), (256, 128, 128, 4, "zero-blocks"),
    (6144, 2048, 64, 8, "wide"),
])
def test_moe_tensor_core_kernels_as_exact_as_fp32(gb, rng, H, Im, group, K, xkind):
    """The tensor-core decode (x and h cut into four int8 parts per 64-column block, integer MMA, exact integer
    sums) against float64, next to the scalar fp32 kernels (v2) on the same inputs: its error must be of the
    same order as fp32's own -- including x with a wide dynamic range inside a block (elements 2^-20 of the
    block's largest) and all-zero blocks."""
    recs, mats = _experts(gb, H, Im, "int4", group, 8, rng)
    x = rand(rng, 1, H)
    if xkind == "wide":
        x *= np.exp2(rng.integers(-20, 8, (1, H))).astype(F32)
    elif xkind == "zero-blocks":
        x[0, 64:192] = 0
    idx = rng.choice(8, K, replace=False)[None].astype(np.int64)
    w = rng.uniform(0.1, 1.0, (1, K)).astype(F32)
    want = _moe_float64(x, idx, w, mats)
    assert gb._moe_version(recs[0].layout, K, "mma") == "mma"
    errs = {}
    saved = gb.moe_kernels
    try:
        for ver in ("v2", "mma"):
            gb.moe_kernels = ver
            got = gb.to_host(gb.moe(gb.upload(x), idx, w, ((int(e), recs[int(e)]) for e in idx[0])))
            errs[ver] = rel_err(got, want)
    finally:
        gb.moe_kernels = saved
    report("moe_mma_vs_fp32", shape=[H, Im], group=group, K=K, x=xkind, **{f"rel_err_{k}": v for k, v in errs.items()})
    assert errs["mma"] <= 4 * errs["v2"] + 1e-7, errs


def test_moe_tensor_core_kernels_propagate_nan(gb, rng):
    """A NaN in x makes the output NaN, as in numpy (the int8 split must not turn it into a finite number)."""
    H, Im, K = 256, 128, 4
    recs, mats = _experts(gb, H, Im, "int4", 64, K, rng)
    x = rand(rng, 1, H)
    x[0, 70] = np.nan
    idx = np.arange(K)[None].astype(np.int64)
    w = np.full((1, K), 0.25, F32)
    saved = gb.moe_kernels
    try:
        gb.moe_kernels = "mma"
        got = gb.to_host(gb.moe(gb.upload(x), idx, w, ((int(e), recs[int(e)]) for e in idx[0])))
    finally:
        gb.moe_kernels = saved
    assert np.isnan(got).all()


def test_moe_kernel_choice(gb, rng):
    """auto: the tensor-core kernels for GLM-5's int4 g64 experts from MMA_MIN_K experts per launch (faster than
    v2 from K = 2 on the H200: scripts/bench_kernels.py's per-K table), the scalar v2 otherwise (one expert, other
    formats, groups the MMA split does not take); v1 for odd groups. (The same rules without a GPU:
    tests/test_kernel_formulas.py.)"""
    from coli.container.format import RecordLayout
    from coli.gpu.cuda_backend import MMA_MIN_K
    glm = RecordLayout.make(6144, 2048, "int4", 64, 512)
    assert gb._moe_version(glm, 8, "auto") == "mma"
    assert gb._moe_version(glm, MMA_MIN_K, "auto") == "mma"
    assert gb._moe_version(glm, MMA_MIN_K - 1, "auto") == "v2"
    assert gb._moe_version(glm, 1, "mma") == "mma"
    assert gb._moe_version(RecordLayout.make(6144, 2048, "int4", 32, 512), 8, "auto") == "v2"
    assert gb._moe_version(RecordLayout.make(6144, 2048, "int8", 0, 512), 8, "mma") == "v2"
    assert gb._moe_version(RecordLayout.make(6144, 2048, "int4", 256, 512), 8, "auto") == "v1"
    assert gb._moe_version(RecordLayout.make(6144, 2048, "int4", 64, 512), 8, "v1") == "v1"


@pytest.mark.parametrize("S,K,H,accumulate", [(300, 8, 6144, 0), (37, 4, 128, 1)])
def test_the_masked_slot_sum_gives_the_zeroed_sums_bits(gb, rng, S, K, H, accumulate):
    """moe_reduce with a mask (a batch of a prefill's experts sums the (token, slot) rows it wrote) against it without
    one over the same Y with every other row zeroed (what the batch did before): the same bits, whatever the
    unwritten rows hold (here NaN)."""
    Y = rand(rng, S, K, H)
    mask = rng.random((S, K)) < 0.3
    mask[0] = False                                  # a token none of whose slots is in the batch
    garbage = Y.copy()
    garbage[~mask] = np.nan
    zeroed = Y.copy()
    zeroed[~mask] = 0.0
    base = rand(rng, S, H)
    f_red = gb._fn("gemm", "moe_reduce")
    mask_d = gb.rt.to_device_async(mask.astype(np.uint8))
    outs = []
    for y, m in ((zeroed, 0), (garbage, mask_d.ptr)):
        dy, out = gb.upload(y), gb.upload(base)
        gb.rt.launch(f_red, (gb._grid1d(S * H),), 256, dy.ptr, m, S, K, H, out.ptr, accumulate)
        outs.append(gb.to_host(out))
    assert np.isfinite(outs[1]).all() and np.array_equal(outs[0], outs[1])
