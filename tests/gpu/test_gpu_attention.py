"""Absorbed MLA attention over the compressed cache and the DSA indexer (scores + top-k) against numpy."""

from __future__ import annotations

import numpy as np
import pytest

from coli.model.numpy_backend import NumpyBackend
from gpu_helpers import F32, qweight, rand, rel_err, report, stored_matrix

pytestmark = pytest.mark.gpu
NP = NumpyBackend()
FORMATS = ("f32", "bf16", "int8", "int4")


MLA_SHAPES = [  # nh, dn, dr, dv, Lkv, T, S
    (64, 192, 64, 256, 512, 3000, 1),
    (64, 192, 64, 256, 512, 600, 4),
    (4, 32, 16, 32, 32, 40, 40),
    (4, 32, 16, 32, 32, 45, 1),
    (8, 48, 32, 40, 96, 70, 3),
]


@pytest.fixture(params=["auto", "tile3", "tile2", "tile1", "split2", "split1", "v1"])
def attn_kernels(request, gb):
    """Every attention version: the split-context decode (default: the tile kernel with two key buffers), the tile
    kernel with one, the previous split kernel, its first version, and the first version (one block per head and
    row)."""
    before = gb.attn_kernels
    gb.attn_kernels = request.param
    yield request.param
    gb.attn_kernels = before


@pytest.mark.parametrize("nh,dn,dr,dv,Lkv,T,S", MLA_SHAPES)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("masking", ["dense", "topk"])
def test_mla_attend(gb, rng, nh, dn, dr, dv, Lkv, T, S, fmt, masking, attn_kernels):
    from coli.gpu.cuda_weights import HeadView
    buf, lay, kv_b = stored_matrix(nh * (dn + dv), Lkv, fmt, rng, group=32)
    w = qweight(gb, buf, lay)
    w_kb, w_vb = HeadView(w, 0, dn + dv, dn, nh), HeadView(w, dn, dn + dv, dv, nh)
    kv = kv_b.reshape(nh, dn + dv, Lkv)
    q, lat, kpe = rand(rng, S, nh, dn + dr), rand(rng, T, Lkv), rand(rng, T, dr)
    start = T - S
    allowed = np.arange(T)[None, :] <= (start + np.arange(S))[:, None]
    if masking == "topk":           # a random subset of each row's visible keys, like the indexer's choice
        keep = rng.random((S, T)) < 0.6
        keep[np.arange(S), start + np.arange(S)] = True
        allowed &= keep
        mask = allowed
    else:
        from coli.gpu.cuda_backend import DeviceMask
        mask = DeviceMask(S, T, start)
    got = gb.to_host(gb.mla_attend(gb.upload(q).reshape(S, nh, dn + dr), gb.upload(lat), gb.upload(kpe),
                                   w_kb, w_vb, mask, (dn + dr) ** -0.5))
    want = NP.mla_attend(q, lat, kpe, np.ascontiguousarray(kv[:, :dn]), np.ascontiguousarray(kv[:, dn:]),
                         allowed, (dn + dr) ** -0.5)
    err = rel_err(got, want)
    report("mla_attend", shape=[nh, dn, dr, dv, Lkv, T, S], fmt=fmt, masking=masking, kernels=attn_kernels,
           rel_err=err)
    assert err < 1e-5


def _attn_inputs(gb, rng, S, nh, Lkv, dr, T):
    qa, q, lat, kpe = rand(rng, S, nh, Lkv), rand(rng, S, nh, 8 + dr), rand(rng, T, Lkv), rand(rng, T, dr)
    return (qa, q, lat, kpe), tuple(gb.upload(a) for a in (qa, q, lat, kpe))


def _ctx64(qa, q, lat, kpe, keys, scale):
    """float64 context of one row over the given keys -> [nh, Lkv]."""
    L, P = lat[keys].astype(np.float64), kpe[keys].astype(np.float64)
    sc = (qa.astype(np.float64) @ L.T + q[:, 8:].astype(np.float64) @ P.T) * scale
    p = np.exp(sc - sc.max(axis=1, keepdims=True))
    return (p / p.sum(axis=1, keepdims=True)) @ L


@pytest.mark.parametrize("split", ["auto", "tile3", "tile2", "tile1", "split2", "split1"])
@pytest.mark.parametrize("chunk", [None, 16, 112, 4096])
def test_attend_core_split_at_glm5_decode_shape(gb, rng, chunk, split):
    """The split kernels at GLM-5's decode shape (64 heads, Lkv 512, rope 64, 3,000 keys) for every chunk size the
    benchmark sweeps, dense and DSA-selected, against float64 (every split kernel)."""
    from coli.gpu.cuda_backend import DeviceMask
    S, nh, Lkv, dr, T = 1, 64, 512, 64, 3000
    (qa, q, lat, kpe), (dqa, dq, dlat, dkpe) = _attn_inputs(gb, rng, S, nh, Lkv, dr, T)
    sel = np.sort(rng.choice(T, 2048, replace=False)).astype(np.int32)
    topk = DeviceMask(S, T, T - S, gb.rt.to_device(np.ascontiguousarray(sel[None])),
                      gb.rt.to_device(np.array([sel.size], np.int32)), sel.size)
    masks = {"dense": (DeviceMask(S, T, T - S), np.arange(T)), "topk": (topk, sel)}
    before = gb.attn_chunk, gb.attn_kernels
    gb.attn_chunk, gb.attn_kernels = chunk, split
    try:
        for name, (mask, keys) in masks.items():
            want = _ctx64(qa[0], q[0], lat, kpe, keys, 0.07)
            got = gb.to_host(gb.attend_core(dqa, dq, 8, dlat, dkpe, mask, 0.07))[0]
            err = rel_err(got, want)
            report("mla_attend_split", masking=name, chunk=chunk, kernels=split, rel_err=err)
            assert err < 1e-5, (name, err)
    finally:
        gb.attn_chunk, gb.attn_kernels = before


@pytest.mark.parametrize("split", ["auto", "tile3", "tile2", "tile1", "split2"])
def test_split_context_within_the_fp32_bound_of_the_float64_attention(gb, rng, split):
    """Every element of the split context at GLM-5's decode shape (dense 2,500 keys; 2,048 of them selected) within
    the bound an fp32 evaluation of it keeps (tests/test_attention_split.py's reference64: derived from the scores'
    magnitudes and the reduction lengths), not only in norm."""
    from test_attention_split import reference64

    from coli.gpu.cuda_backend import DeviceMask
    S, nh, Lkv, dr, T = 1, 64, 512, 64, 2500
    qa = (rng.standard_normal((S, nh, Lkv)) * 0.05).astype(F32)   # scores of a few units, as a trained model's
    qpe, lat, kpe = rand(rng, S, nh, dr), rand(rng, T, Lkv), rand(rng, T, dr)
    sel = np.sort(rng.choice(T, 2048, replace=False)).astype(np.int32)
    d_idx, d_cnt = gb.rt.to_device(np.ascontiguousarray(sel[None])), gb.rt.to_device(np.array([sel.size], np.int32))
    masks = {"dense": (DeviceMask(S, T, T - S), None, None),
             "topk": (DeviceMask(S, T, T - S, d_idx, d_cnt, sel.size), sel[None], np.array([sel.size]))}
    dqa, dqpe, dlat, dkpe = (gb.upload(a) for a in (qa, qpe, lat, kpe))
    before = gb.attn_kernels
    gb.attn_kernels = split
    try:
        for name, (mask, idx, cnt) in masks.items():
            got = gb.to_host(gb.attend_core(dqa, dqpe, 0, dlat, dkpe, mask, 1 / 24))
            want, tol = reference64(qa, qpe, lat, kpe, 1 / 24, S, T - S, idx, cnt)
            assert np.isfinite(got).all()
            worst = float((np.abs(got - want) / tol).max())
            report("mla_attend_split_bound", masking=name, kernels=split, worst_of_bound=worst)
            assert worst <= 1, (name, worst)
    finally:
        gb.attn_kernels = before


@pytest.mark.parametrize("attn_kernels", ["auto", "tile3", "tile2", "tile1", "split2", "split1"], indirect=True)
def test_attend_core_reads_the_cache_length_from_device_memory(gb, rng, attn_kernels):
    """T_dev (CUDA-graph replay): one grid sized for the capacity, the cache length changed in device memory
    between launches; each result equals the attention over the first T keys."""
    from coli.gpu.cuda_backend import DeviceMask
    S, nh, Lkv, dr, cap = 1, 64, 512, 64, 4096
    (qa, q, lat, kpe), (dqa, dq, dlat, dkpe) = _attn_inputs(gb, rng, S, nh, Lkv, dr, cap)
    t_dev = gb.rt.to_device(np.zeros(1, np.int32))
    for T in (1, 33, 2048, 3001, cap):
        gb.rt.upload_bytes(np.array([T], np.int32).view(np.uint8), t_dev.ptr)
        got = gb.to_host(gb.attend_core(dqa, dq, 8, dlat, dkpe, DeviceMask(S, cap, cap - S), 0.07,
                                        T_dev=t_dev.ptr, n_max=cap))[0]
        err = rel_err(got, _ctx64(qa[0], q[0], lat, kpe, np.arange(T), 0.07))
        assert err < 1e-5, (T, err)


@pytest.mark.parametrize("split", ["auto", "tile3", "tile2"])
@pytest.mark.parametrize("pe_off,base_off", [(8, 0), (9, 0), (8, 1)])
def test_tile_kernels_stage_the_queries_at_any_alignment(gb, rng, split, pe_off, base_off):
    """tile3 copies the queries in 16-byte pieces only where q_abs, q's base, its row stride and the rope offset
    allow it, else 4-byte ones: a rope part 9 floats into rows of 73 floats, or q starting 4 bytes past a 16-byte
    boundary, give the same attention as float64."""
    from coli.gpu.cuda_backend import DeviceMask
    from coli.gpu.cuda_runtime import DeviceArray
    S, nh, Lkv, dr, T = 1, 64, 512, 64, 700
    dq = pe_off + dr
    qa, lat, kpe = rand(rng, S, nh, Lkv), rand(rng, T, Lkv), rand(rng, T, dr)
    flat = rand(rng, base_off + S * nh * dq)
    q = flat[base_off:].reshape(S, nh, dq)
    dqa, dflat, dlat, dkpe = (gb.upload(a) for a in (qa, flat, lat, kpe))
    dqv = DeviceArray(dflat.ptr + 4 * base_off, (S, nh, dq), owner=dflat)
    before = gb.attn_kernels
    gb.attn_kernels = split
    try:
        got = gb.to_host(gb.attend_core(dqa, dqv, pe_off, dlat, dkpe, DeviceMask(S, T, T - S), 0.07))[0]
    finally:
        gb.attn_kernels = before
    L, P = lat.astype(np.float64), kpe.astype(np.float64)
    sc = (qa[0].astype(np.float64) @ L.T + q[0, :, pe_off:].astype(np.float64) @ P.T) * 0.07
    p = np.exp(sc - sc.max(axis=1, keepdims=True))
    err = rel_err(got, (p / p.sum(axis=1, keepdims=True)) @ L)
    report("mla_attend_query_alignment", kernels=split, pe_off=pe_off, base_off=base_off, rel_err=err)
    assert err < 1e-5, err


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows,cols,Z", [(192, 512, 64), (40, 96, 3), (7, 32, 2)])
def test_gemv_t_per_head(gb, rng, fmt, rows, cols, Z):
    """gemv_t (q_abs = q_nope @ w_kb per head at decode) against float64: head z's rows z*rows .. of one matrix."""
    buf, lay, W = stored_matrix(Z * rows + 5, cols, fmt, rng, group=32)
    w = qweight(gb, buf, lay)
    x = rand(rng, Z, rows + 3)                   # x_z > rows: the kernel must read only the first `rows`
    y = gb.empty((Z, cols + 1))
    assert gb._gemv_t(w, 5, rows, rows, Z, gb.upload(x).ptr, rows + 3, y.ptr, cols + 1)
    got = gb.to_host(y)[:, :cols]
    want = np.stack([x[z, :rows].astype(np.float64) @ W[5 + z * rows: 5 + (z + 1) * rows].astype(np.float64)
                     for z in range(Z)])
    err = rel_err(got, want)
    report("gemv_t", fmt=fmt, shape=[rows, cols, Z], rel_err=err)
    assert err < 1e-5


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows,cols,Z", [(192, 512, 64), (40, 96, 3), (7, 32, 2), (300, 160, 2)])
def test_mla_projection_kernels_per_head(gb, rng, fmt, rows, cols, Z):
    """mla_qabs (q_abs = q_nope @ w_kb per head) and mla_o (o = ctx @ w_vb.T per head), the default decode's
    projections, against float64: head z's rows z*rows .. of one matrix; x_z and y_z past the used lengths, rows
    and columns not multiples of a block's 32 rows / 128 columns. Outputs poisoned with NaN first."""
    buf, lay, W = stored_matrix(Z * rows + 5, cols, fmt, rng, group=32)
    w = qweight(gb, buf, lay)
    x = rand(rng, Z, rows + 3)                   # x_z > rows: the kernel must read only the first `rows`
    y = gb.upload(np.full((Z, cols + 1), np.nan, F32))
    assert gb._mla_qabs(w, 5, rows, rows, Z, gb.upload(x).ptr, rows + 3, y.ptr, cols + 1)
    got = gb.to_host(y)
    want = np.stack([x[z, :rows].astype(np.float64) @ W[5 + z * rows: 5 + (z + 1) * rows].astype(np.float64)
                     for z in range(Z)])
    assert np.isnan(got[:, cols]).all()          # nothing written past the columns
    err = rel_err(got[:, :cols], want)
    report("mla_qabs", fmt=fmt, shape=[rows, cols, Z], rel_err=err)
    assert err < 1e-5
    c = rand(rng, Z, cols + 2)
    o = gb.upload(np.full((Z, rows + 1), np.nan, F32))
    assert gb._mla_o(w, 5, rows, rows, Z, gb.upload(c).ptr, cols + 2, o.ptr, rows + 1)
    got = gb.to_host(o)
    want = np.stack([W[5 + z * rows: 5 + (z + 1) * rows].astype(np.float64) @ c[z, :cols].astype(np.float64)
                     for z in range(Z)])
    assert np.isnan(got[:, rows]).all()
    err = rel_err(got[:, :rows], want)
    report("mla_o", fmt=fmt, shape=[rows, cols, Z], rel_err=err)
    assert err < 1e-5


# ---- indexer: scores + top-k ----------------------------------------------------------------------------------
INDEXER_SHAPES = [  # ih, ihd, T, S, topk
    (32, 128, 5000, 1, 2048),
    (32, 128, 3000, 6, 2048),
    (32, 128, 2100, 2100, 2048),     # a prefill crossing index_topk: early rows keep all, later rows select
    (32, 32, 40, 40, 8),             # the tiny oracle's indexer
    (32, 32, 45, 1, 8),
    (16, 64, 300, 5, 100),
]


@pytest.mark.parametrize("ih,ihd,T,S,topk", INDEXER_SHAPES)
def test_indexer_select(gb, rng, ih, ihd, T, S, topk):
    iq, kidx, hw = rand(rng, S, ih, ihd), rand(rng, T, ihd), rand(rng, S, ih)
    pos = np.arange(T - S, T)
    mask = gb.indexer_select(gb.upload(iq).reshape(S, ih, ihd), gb.upload(kidx), gb.upload(hw), pos, topk)
    got = mask.to_host(gb.rt)
    want = NP.indexer_select(iq, kidx, hw, pos, topk)
    assert (got.sum(1) == want.sum(1)).all()
    diff = got != want
    if diff.any():     # only keys at the selection boundary may differ (scores equal to rounding)
        scores = NP.indexer_scores(iq, kidx, hw)
        for s in np.nonzero(diff.any(1))[0]:
            n_vis = int(pos[s]) + 1
            kth = np.sort(scores[s, :n_vis])[::-1][topk - 1]
            gap = np.abs(scores[s, diff[s]] - kth).max()
            assert gap <= 1e-5 * np.abs(scores[s, :n_vis]).max(), f"row {s}: a key far from the boundary differs"
    report("indexer_select", shape=[ih, ihd, T, S, topk], boundary_differences=int(diff.sum()))


def test_topk_select_ties_take_the_lowest_keys(gb, rng):
    T, topk = 3000, 2048
    scores = np.round(rng.standard_normal((2, T)), 1).astype(F32)          # many exact ties
    sd = gb.upload(scores)
    kmax = topk
    idx = gb.rt.empty((2, kmax), np.int32)
    cnt = gb.rt.empty((2,), np.int32)
    fn = gb._fn("indexer", "topk_select")
    gb.rt.launch(fn, (2,), 1024, sd.ptr, T, T - 2, topk, kmax, idx.ptr, cnt.ptr)
    got_idx, got_cnt = gb.rt.to_host(idx), gb.rt.to_host(cnt)
    for s in range(2):
        n = T - 2 + s + 1
        row = scores[s, :n]
        order = np.lexsort((np.arange(n), -row))[:topk]      # by score desc, then index asc
        assert got_cnt[s] == topk
        assert got_idx[s].tolist() == sorted(order.tolist())


@pytest.mark.parametrize("nh,dn,dr,dv,Lkv,T,S", [(64, 192, 64, 256, 512, 700, 300), (4, 32, 16, 32, 32, 350, 300)])
@pytest.mark.parametrize("masking", ["dense", "topk"])
@pytest.mark.parametrize("kernels", ["auto", "v1"])
def test_a_long_prefill_attends_in_row_blocks_with_the_bits_of_one_pass(gb, rng, monkeypatch, nh, dn, dr, dv, Lkv,
                                                                        T, S, masking, kernels):
    """_mla_attend_blocks (S > ATTN_PREFILL_ROWS: queries and contexts a block of rows at a time, so a prefill's
    buffers stop growing with the chunk) gives exactly the one-pass call's output, blocks of 128 + 128 + 44 rows."""
    from coli.gpu import cuda_backend
    from coli.gpu.cuda_weights import HeadView
    buf, lay, _ = stored_matrix(nh * (dn + dv), Lkv, "int8", rng, group=32)
    w = qweight(gb, buf, lay)
    w_kb, w_vb = HeadView(w, 0, dn + dv, dn, nh), HeadView(w, dn, dn + dv, dv, nh)
    q, lat, kpe = rand(rng, S, nh, dn + dr), rand(rng, T, Lkv), rand(rng, T, dr)
    start = T - S
    if masking == "topk":
        allowed = np.arange(T)[None, :] <= (start + np.arange(S))[:, None]
        keep = rng.random((S, T)) < 0.6
        keep[np.arange(S), start + np.arange(S)] = True
        mask = gb.device_mask(allowed & keep, S, T)
    else:
        mask = cuda_backend.DeviceMask(S, T, start)
    monkeypatch.setattr(gb, "attn_kernels", kernels)
    dq, dlat, dkpe = gb.upload(q).reshape(S, nh, dn + dr), gb.upload(lat), gb.upload(kpe)
    outs = []
    for rows in (10**9, 128):
        monkeypatch.setattr(cuda_backend, "ATTN_PREFILL_ROWS", rows)
        outs.append(gb.to_host(gb.mla_attend(dq, dlat, dkpe, w_kb, w_vb, mask, (dn + dr) ** -0.5)))
    assert np.isfinite(outs[0]).all() and np.array_equal(outs[0], outs[1])
