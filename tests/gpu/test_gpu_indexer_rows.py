"""The prefill indexer scores (cuda/indexer.cu indexer_scores_rows, COLI_INDEXER_KERNELS=auto|rows) against the
first kernel (indexer_scores, "v1") bit for bit -- which makes the top-k, hence the tokens, identical -- and against
NumpyBackend.indexer_scores in float64 within a bound derived from the magnitudes; the whole indexer_select mask
equal under both settings. Score buffers are poisoned first: the entries a kernel must leave alone (rows with
n_vis <= topk, keys past a row's n_vis) keep the poison."""

from __future__ import annotations

import numpy as np
import pytest

from coli.model.numpy_backend import NumpyBackend
from gpu_helpers import F32, rand, report

pytestmark = pytest.mark.gpu
NP = NumpyBackend()
POISON = np.uint32(0x7FC0DEAD)      # a NaN with a payload no kernel writes
U = 2.0 ** -24                      # fp32 unit roundoff

CASES = [  # ih, ihd, S, T, topk, k_idx_offset (floats: 1 = a view 4 bytes past a 16-byte boundary)
    (32, 128, 300, 2500, 2048, 0),       # GLM-5's heads, start 2200: every row selects
    (32, 128, 300, 2500, 2300, 0),       # rows on both sides of topk (the first 99 keep all their keys)
    (32, 128, 300, 2500, 2300, 1),       # k_idx not 16-byte aligned: the 4-byte copies
    (8, 32, 301, 451, 300, 0),           # a small odd shape: 8 of 32 lanes busy, 301 rows (4 does not divide)
    (8, 32, 301, 451, 300, 3),
    (32, 128, 7, 3000, 2048, 0),         # a few rows against a long cache: the keys split over blocks
]


def _with(gb, version, fn):
    saved = gb.indexer_kernels
    gb.indexer_kernels = version
    try:
        return fn()
    finally:
        gb.indexer_kernels = saved


def _inputs(gb, rng, ih, ihd, S, T, off):
    from coli.gpu.cuda_runtime import DeviceArray
    iq, kidx, hw = rand(rng, S, ih, ihd), rand(rng, T, ihd), rand(rng, S, ih)
    dk = gb.upload(np.concatenate([np.zeros(off, F32), kidx.ravel()]))
    dev = (gb.upload(iq).reshape(S, ih, ihd), DeviceArray(dk.ptr + 4 * off, (T, ihd), owner=dk), gb.upload(hw))
    return (iq, kidx, hw), dev


def _scores(gb, version, dev, S, T, topk):
    """(scores [S, T] as uint32 bits, poison where unwritten; the kernel that ran) of one launch under `version`."""
    iq, kidx, hw = dev
    _, ih, ihd = iq.shape
    out = gb.upload(np.full((S, T), POISON, np.uint32).view(F32))
    name = _with(gb, version, lambda: gb._indexer_scores(iq.ptr, kidx.ptr, hw.ptr, S, ih, ihd, T - S, T, topk,
                                                         out.ptr))
    return gb.to_host(out).view(np.uint32), name


def _needed(S, T, topk):
    """[S, T] bool: the entries the kernels write (rows with more than topk visible keys, their visible keys)."""
    n_vis = np.minimum(T - S + np.arange(S) + 1, T)
    return (np.arange(T)[None, :] < n_vis[:, None]) & (n_vis > topk)[:, None]


@pytest.mark.parametrize("ih,ihd,S,T,topk,off", CASES)
def test_rows_kernel_gives_indexer_scores_bits(gb, rng, ih, ihd, S, T, topk, off):
    _, dev = _inputs(gb, rng, ih, ihd, S, T, off)
    rows, rname = _scores(gb, "rows", dev, S, T, topk)
    v1, vname = _scores(gb, "v1", dev, S, T, topk)
    assert (rname, vname) == ("indexer_scores_rows", "indexer_scores")
    need = _needed(S, T, topk)
    assert (v1[~need] == POISON).all() and (v1[need] != POISON).all()      # what v1 writes: the needed entries
    same = rows == v1
    report("indexer_scores_rows_bits", shape=[ih, ihd, S, T, topk], k_off=off, differing=int((~same).sum()),
           written=int(need.sum()))
    assert same.all(), f"{int((~same).sum())} of {same.size} entries differ (first at {np.argwhere(~same)[0]})"


@pytest.mark.parametrize("version", ["rows", "v1"])
@pytest.mark.parametrize("ih,ihd,S,T,topk,off", [CASES[1], CASES[3]])
def test_scores_within_the_fp32_bound_of_float64(gb, rng, ih, ihd, S, T, topk, off, version):
    """Each written score within the bound of an fp32 evaluation of NumpyBackend.indexer_scores done in float64: the
    dot's ihd fmaf roundings (+ the q scale) over sum_k |q k| per head, relu's 1-Lipschitz, the head weight's two
    roundings, the head sum's 5 butterfly levels over sum_h |w relu|, and the reference's own rounding to fp32."""
    (iq, kidx, hw), dev = _inputs(gb, rng, ih, ihd, S, T, off)
    got, _ = _scores(gb, version, dev, S, T, topk)
    got = got.view(F32).astype(np.float64)
    q64, k64, w64 = iq.astype(np.float64), kidx.astype(np.float64), hw.astype(np.float64)
    want = NP.indexer_scores(q64, k64, w64).astype(np.float64)                   # [S, T]
    qs, ws = ihd ** -0.5, ih ** -0.5
    mag = (np.abs(q64).reshape(S * ih, ihd) @ np.abs(k64).T).reshape(S, ih, T) * qs   # [S, ih, T] sum_k |q k| qscale
    relu = np.maximum((q64.reshape(S * ih, ihd) @ k64.T).reshape(S, ih, T) * qs, 0)    # [S, ih, T]
    aw = np.abs(w64)[:, :, None] * ws
    bound = U * ((ihd + 2) * (aw * mag).sum(1) + 8 * (aw * relu).sum(1) + np.abs(want))
    need = _needed(S, T, topk)
    over = np.abs(got - want)[need] / bound[need]
    report("indexer_scores_f64_bound", version=version, shape=[ih, ihd, S, T, topk], worst_of_bound=float(over.max()))
    assert np.isfinite(got[need]).all() and over.max() <= 1, over.max()


@pytest.mark.parametrize("ih,ihd,S,T,topk", [(32, 128, 300, 2500, 2048), (32, 128, 2100, 2100, 2048),
                                             (8, 32, 301, 451, 300), (32, 32, 40, 40, 8)])
def test_indexer_select_masks_equal_under_both_settings(gb, rng, ih, ihd, S, T, topk):
    """The whole indexer_select (scores, then topk_select): the same index lists and counts under auto and v1, on a
    prefill crossing index_topk (S = T = 2,100) and the tiny oracle's indexer shape among others."""
    from test_gpu_prefill import _kernels_run
    _, (iq, kidx, hw) = _inputs(gb, rng, ih, ihd, S, T, 0)
    pos = np.arange(T - S, T)

    def select(version):
        m, names = _kernels_run(gb, lambda: _with(gb, version, lambda: gb.indexer_select(iq, kidx, hw, pos, topk)))
        return (gb.rt.to_host(m.idx), gb.rt.to_host(m.cnt), m.to_host(gb.rt)), names

    (ia, ca, ma), na = select("auto")
    (iv, cv, mv), nv = select("v1")
    assert "indexer_scores_rows" in na and "indexer_scores" in nv and "indexer_scores_rows" not in nv
    assert (ca == cv).all() and (ma == mv).all()
    for s in range(S):
        assert (ia[s, :ca[s]] == iv[s, :cv[s]]).all(), f"row {s}"
    report("indexer_select_rows_vs_v1", shape=[ih, ihd, S, T, topk], selecting_rows=int((ca == topk).sum()))


def test_the_benchmark_rows_time_both_kernels_and_compare_their_bits(gb):
    """scripts/bench_kernels.py's indexer rows (--indexer-only, --prefill-only) at a small prompt: both kernels ran,
    under their names, and their scores agree bit for bit."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    import bench_kernels
    res, rows = {}, []
    bench_kernels.indexer_bench(gb, bench_kernels.Timer(gb.rt, spin=True), np.random.default_rng(0), res,
                                lambda name, us, nbytes=None, note="": rows.append(name) or {"kernel": name, "us": us},
                                sizes=(2100,))
    out = res["indexer"]
    assert out["scores_S2100_v1_kernel"] == "indexer_scores" and out["scores_S2100_rows_kernel"] == "indexer_scores_rows"
    assert out["scores_S2100_rows_equal_v1_bits"] is True
    assert out["scores_S2100_rows_TFLOPs"] > 0 and len(rows) == 4
