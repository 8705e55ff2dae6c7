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


@pytest.mark.parametrize("nh,dn,dr,dv,Lkv,T,S", MLA_SHAPES)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("masking", ["dense", "topk"])
def test_mla_attend(gb, rng, nh, dn, dr, dv, Lkv, T, S, fmt, masking):
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
    report("mla_attend", shape=[nh, dn, dr, dv, Lkv, T, S], fmt=fmt, masking=masking, rel_err=err)
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
