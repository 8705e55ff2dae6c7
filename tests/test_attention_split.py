"""The split-context MLA decode (cuda/attention.cu mla_attend_part_<NJ> + mla_attend_combine), emulated in numpy
with the kernel's exact cutting -- which keys a row has (dense, DSA-selected, or the cache length read from device
memory), chunks of `chunk` keys per block, tiles of TILE_KEYS keys with an online softmax per tile, the partial
(max, sum, context) per chunk and the combine -- and checked against the float64 attention and the numpy backend's
mla_attend, with tolerances derived from the magnitudes and the reduction lengths. Also the host's choice of chunk
(coli/gpu/attention_split.py). The kernels themselves are checked against numpy on a GPU (tests/gpu/)."""

from __future__ import annotations

import re

import numpy as np
import pytest

from coli.gpu import attention_split as AS
from coli.gpu.cuda_runtime import kernels_dir
from coli.model.numpy_backend import NumpyBackend

F32 = np.float32
EPS = float(np.finfo(F32).eps)


def row_keys(s, S, start, idx=None, cnt=None, T_dev=None):
    """attend_keys() and the key list of row s: dense keys 0 .. start+s (start = T_dev - S when given), else the
    indexer's cnt[s] keys idx[s, :cnt[s]]."""
    if idx is not None:
        return [int(t) for t in idx[s, :cnt[s]]]
    st = T_dev - S if T_dev is not None else start
    return list(range(st + s + 1))


def fma32(a, b, c):
    """fmaf in fp32: the product of two fp32 values is exact in float64, so one float64 add and a rounding to fp32
    (the double rounding differs from the device's single one only at exact float64 ties)."""
    return (a.astype(np.float64) * b.astype(np.float64) + c.astype(np.float64)).astype(F32)


def tile_scores(qcat, kcat):
    """mla_attend_tile's raw scores [nh, TK] of query rows qcat [nh, D] against key rows kcat [TK, D] (D = Lkv + dr):
    float4 column f of the D columns goes to slice f % TILE2_SLICES, each slice an fmaf chain over its columns in
    order (x, y, z, w), then the slices' partials summed in slice order."""
    D4 = qcat.shape[1] // 4
    part = np.zeros((AS.TILE2_SLICES, qcat.shape[0], kcat.shape[0]), F32)
    for sl in range(AS.TILE2_SLICES):
        for f in range(sl, D4, AS.TILE2_SLICES):
            for d in range(4 * f, 4 * f + 4):
                part[sl] = fma32(qcat[:, d, None], kcat[None, :, d], part[sl])
    out = np.zeros(part.shape[1:], F32)
    for sl in range(AS.TILE2_SLICES):
        out = (out + part[sl]).astype(F32)
    return out


def half_warp_sum(p):
    """The butterfly sum over a head's 16 keys (__shfl_xor 8, 4, 2, 1): every lane ends with the same value."""
    v = p.astype(F32).copy()
    lanes = np.arange(p.shape[1])
    for o in (8, 4, 2, 1):
        v = (v + v[:, lanes ^ o]).astype(F32)
    return v[:, 0]


def emulate_split(qa, qpe, lat, kpe, scale, chunk, nchunk, S, start, idx=None, cnt=None, T_dev=None, kernel="part"):
    """ctx [S, nh, Lkv] as the part + combine kernels compute it, in fp32. Blocks whose chunk starts at or past the
    row's n return; the combine reads min(nchunk, ceil(n / chunk)) partials; nchunk == 1 normalises in the block.
    kernel="tile": mla_attend_tile's order instead -- the split-K score dot (tile_scores), the tile's sum as a
    half-warp butterfly, the context an fmaf chain over the tile's keys after the rescale. kernel="tile3":
    mla_attend_tile3's -- the same, over tiles of TILE3_KEYS keys, each lane adding its keys st and st + 16 before
    the butterfly."""
    nh, Lkv = qa.shape[1], qa.shape[2]
    scale = F32(scale)
    ctx = np.full((S, nh, Lkv), np.nan, F32)
    for s in range(S):
        keys = row_keys(s, S, start, idx, cnt, T_dev)
        n = len(keys)
        pm = np.full((nh, nchunk), np.nan, F32)
        pl = np.full((nh, nchunk), np.nan, F32)
        pc = np.full((nh, nchunk, Lkv), np.nan, F32)
        for c in range(nchunk):
            lo = c * chunk
            if lo >= n:
                continue                                            # the block returns: its partials stay unset
            hi = min(lo + chunk, n)
            m = np.full(nh, -np.inf, F32)
            l = np.zeros(nh, F32)
            cv = np.zeros((nh, Lkv), F32)
            TK = AS.TILE3_KEYS if kernel == "tile3" else AS.TILE_KEYS
            for t0 in range(lo, hi, TK):
                nt = min(TK, hi - t0)
                tk = [keys[j] for j in range(t0, t0 + nt)]
                lt = np.zeros((TK, Lkv), F32)                       # absent keys are zero rows
                pt = np.zeros((TK, kpe.shape[1]), F32)
                lt[:nt], pt[:nt] = lat[tk], kpe[tk]
                if kernel in ("tile", "tile3"):
                    sc = (tile_scores(np.concatenate([qa[s], qpe[s]], 1), np.concatenate([lt, pt], 1)) * scale)
                else:
                    sc = ((qa[s] @ lt.T + qpe[s] @ pt.T) * scale)
                sc = sc.astype(F32)                                 # [nh, TK]
                sc[:, nt:] = -np.inf
                mn = np.maximum(m, sc.max(axis=1))
                corr = np.exp(m - mn).astype(F32)
                p = np.exp(sc - mn[:, None]).astype(F32)
                if kernel in ("tile", "tile3"):
                    lanes = (p[:, :16] + p[:, 16:]).astype(F32) if kernel == "tile3" else p
                    l = fma32(l, corr, half_warp_sum(lanes))
                    cv = (cv * corr[:, None]).astype(F32)
                    for r in range(TK):
                        cv = fma32(p[:, r, None], lt[None, r], cv)
                else:
                    l = (l * corr + p.sum(axis=1)).astype(F32)
                    cv = (cv * corr[:, None] + p @ lt).astype(F32)
                m = mn
            if nchunk == 1:
                ctx[s] = cv / l[:, None]
            pm[:, c], pl[:, c], pc[:, c] = m, l, cv
        if nchunk == 1:
            continue
        nc = min(nchunk, -(-n // chunk))
        M = pm[:, :nc].max(axis=1)
        wgt = np.exp(pm[:, :nc] - M[:, None]).astype(F32)            # [nh, nc]
        L = (pl[:, :nc] * wgt).sum(axis=1).astype(F32)
        ctx[s] = (np.einsum("hc,hcd->hd", wgt, pc[:, :nc]) / L[:, None]).astype(F32)
    return ctx


def reference64(qa, qpe, lat, kpe, scale, S, start, idx=None, cnt=None, T_dev=None):
    """The float64 attention, and per row the error bound of an fp32 evaluation: score errors of up to
    (Lkv + dr) eps x sum|q k| x scale move each exp by that relative amount (twice: numerator and the sum), and the
    context sums n terms (+ the tile, chunk and combine steps) of p * lat."""
    nh, Lkv = qa.shape[1], qa.shape[2]
    out = np.zeros((S, nh, Lkv))
    tol = np.zeros((S, nh, 1))
    for s in range(S):
        keys = row_keys(s, S, start, idx, cnt, T_dev)
        L, P = lat[keys].astype(np.float64), kpe[keys].astype(np.float64)
        q64, p64 = qa[s].astype(np.float64), qpe[s].astype(np.float64)
        sc = (q64 @ L.T + p64 @ P.T) * scale                        # [nh, n]
        mag = (np.abs(q64) @ np.abs(L).T + np.abs(p64) @ np.abs(P).T) * scale
        p = np.exp(sc - sc.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        out[s] = p @ L
        d_score = (Lkv + P.shape[1] + 2) * EPS * mag.max(axis=1)     # [nh]
        steps = len(keys) + 2 * AS.TILE_KEYS + 8
        tol[s, :, 0] = (4 * d_score + steps * EPS) * np.abs(L).max()
    return out, tol


def _inputs(rng, S, nh, Lkv, dr, T):
    qa = rng.standard_normal((S, nh, Lkv)).astype(F32)
    qpe = rng.standard_normal((S, nh, dr)).astype(F32)
    lat = rng.standard_normal((T, Lkv)).astype(F32)
    kpe = rng.standard_normal((T, dr)).astype(F32)
    return qa, qpe, lat, kpe


CASES = [  # S, nh, Lkv, dr, T, masking
    (1, 64, 64, 16, 300, "dense"),     # more chunks than tiles would need: the chunk is one tile
    (1, 20, 32, 16, 1000, "topk"),     # heads not a multiple of HEADS_PER_BLOCK
    (3, 4, 32, 16, 45, "dense"),       # rows of different lengths: later chunks of early rows are empty
    (2, 8, 96, 32, 70, "topk"),
    (40, 4, 32, 16, 40, "dense"),      # prefill: one chunk, no combine
]


@pytest.mark.parametrize("kernel", ["part", "tile", "tile3"])
@pytest.mark.parametrize("S,nh,Lkv,dr,T,masking", CASES)
def test_split_emulation_matches_the_float64_attention(S, nh, Lkv, dr, T, masking, kernel):
    rng = np.random.default_rng(S * 1000 + T)
    qa, qpe, lat, kpe = _inputs(rng, S, nh, Lkv, dr, T)
    start = T - S
    idx = cnt = None
    n_max = T
    if masking == "topk":
        k = max(3, T // 3)
        idx = np.zeros((S, k), np.int32)
        cnt = np.zeros(S, np.int32)
        for s in range(S):
            vis = start + s + 1
            sel = np.sort(rng.choice(vis, min(k, vis), replace=False))
            idx[s, :sel.size], cnt[s] = sel, sel.size
        n_max = k
    chunk, nchunk = AS.split_chunks(n_max, S, nh, Lkv, sm_count=132)
    scale = (Lkv + dr) ** -0.5
    got = emulate_split(qa, qpe, lat, kpe, scale, chunk, nchunk, S, start, idx, cnt, kernel=kernel)
    want, tol = reference64(qa, qpe, lat, kpe, scale, S, start, idx, cnt)
    assert np.isfinite(got).all()
    assert (np.abs(got - want) <= tol).all(), float((np.abs(got - want) / tol).max())
    if S == 1:
        assert nchunk > 1, "a decode row must be split"


@pytest.mark.parametrize("kernel", ["part", "tile3"])
@pytest.mark.parametrize("chunk", [16, 48, 160])
def test_every_chunk_size_gives_the_same_attention(chunk, kernel):
    """Forcing the chunk (the benchmark's sweep) changes the partials, not the result -- also for tile3, whose
    32-key tiles leave a chunk of 16 or 48 keys with a half-empty last tile."""
    rng = np.random.default_rng(7)
    S, nh, Lkv, dr, T = 1, 16, 64, 16, 500
    qa, qpe, lat, kpe = _inputs(rng, S, nh, Lkv, dr, T)
    ch, nchunk = AS.split_chunks(T, S, nh, Lkv, sm_count=132, chunk=chunk)
    assert ch % AS.TILE_KEYS == 0 and ch >= chunk and nchunk == -(-T // ch)
    got = emulate_split(qa, qpe, lat, kpe, 0.1, ch, nchunk, S, T - S, kernel=kernel)
    want, tol = reference64(qa, qpe, lat, kpe, 0.1, S, T - S)
    assert (np.abs(got - want) <= tol).all()


def test_cache_length_from_device_memory_with_a_grid_for_the_capacity():
    """CUDA-graph replay: the grid is sized for the cache's capacity once; each step's T comes from T_dev. Blocks
    past the row's keys return and the combine reads only the chunks that exist -- the same result as a launch
    sized for T, and no partial of an empty chunk is ever read (they stay NaN in the emulation)."""
    rng = np.random.default_rng(3)
    S, nh, Lkv, dr, cap = 1, 16, 64, 16, 4096
    qa, qpe, lat, kpe = _inputs(rng, S, nh, Lkv, dr, cap)
    chunk, nchunk = AS.split_chunks(cap, S, nh, Lkv, sm_count=132)
    for T, kernel in ((1, "part"), (17, "tile3"), (700, "part"), (700, "tile3"), (cap, "part")):
        got = emulate_split(qa, qpe, lat, kpe, 0.1, chunk, nchunk, S, start=0, T_dev=T, kernel=kernel)
        ch_t, nc_t = AS.split_chunks(T, S, nh, Lkv, sm_count=132)
        sized = emulate_split(qa, qpe, lat, kpe, 0.1, ch_t, nc_t, S, start=T - S)
        want, tol = reference64(qa, qpe, lat, kpe, 0.1, S, T - S)
        assert np.isfinite(got).all()
        assert (np.abs(got - want) <= tol).all() and (np.abs(sized - want) <= tol).all()


def test_split_attention_with_the_projections_matches_the_numpy_backend():
    """The whole decode step (q_abs = q_nope @ w_kb, the split context, o = ctx @ w_vb.T) against
    NumpyBackend.mla_attend, both in fp32: each within its bound of the float64 result."""
    rng = np.random.default_rng(11)
    S, nh, dn, dr, dv, Lkv, T = 1, 16, 32, 16, 24, 64, 400
    q = rng.standard_normal((S, nh, dn + dr)).astype(F32)
    lat, kpe = rng.standard_normal((T, Lkv)).astype(F32), rng.standard_normal((T, dr)).astype(F32)
    w_kb = (rng.standard_normal((nh, dn, Lkv)) * 0.2).astype(F32)
    w_vb = (rng.standard_normal((nh, dv, Lkv)) * 0.2).astype(F32)
    scale = (dn + dr) ** -0.5
    allowed = np.ones((S, T), bool)
    qa = np.einsum("shd,hdl->shl", q[..., :dn], w_kb).astype(F32)
    chunk, nchunk = AS.split_chunks(T, S, nh, Lkv, sm_count=132)
    ctx = emulate_split(qa, q[..., dn:], lat, kpe, scale, chunk, nchunk, S, T - S)
    got = np.einsum("shl,hvl->shv", ctx, w_vb).reshape(S, nh * dv)
    numpy_o = NumpyBackend().mla_attend(q, lat, kpe, w_kb, w_vb, allowed, scale)
    qa64 = np.einsum("shd,hdl->shl", q[..., :dn].astype(np.float64), w_kb.astype(np.float64))
    ctx64, tol = reference64(qa64, q[..., dn:], lat, kpe, scale, S, T - S)
    o64 = np.einsum("shl,hvl->shv", ctx64, w_vb.astype(np.float64)).reshape(S, nh * dv)
    # the q_abs rounding (dn terms) enters the scores like the dot's own rounding; ctx's bound, through w_vb
    # (Lkv terms), bounds o
    qa_err = dn * EPS * np.einsum("shd,hdl->shl", np.abs(q[..., :dn]), np.abs(w_kb)).max()
    d_ctx = tol[:, :, 0] + 4 * qa_err * np.abs(lat).max() * scale * np.abs(lat).max() * Lkv
    bound = (np.einsum("sh,hvl->shv", d_ctx, np.abs(w_vb)) + Lkv * EPS * np.einsum(
        "shl,hvl->shv", np.abs(ctx64), np.abs(w_vb))).reshape(S, nh * dv)
    assert (np.abs(got - o64) <= bound).all()
    assert (np.abs(numpy_o - o64) <= bound).all()
    assert (np.abs(got - numpy_o) <= 2 * bound).all()


def test_chunk_choice_fills_the_device_once_and_bounds_the_partials():
    for n, S, nh, sms in [(2048, 1, 64, 132), (16384, 1, 64, 132), (2048, 1, 64, 46), (50, 1, 4, 132),
                          (2048, 4, 64, 132), (1, 1, 64, 132)]:
        chunk, nchunk = AS.split_chunks(n, S, nh, 512, sms)
        assert chunk % AS.TILE_KEYS == 0 and nchunk == -(-n // chunk)
        rows = AS.head_groups(nh) * S
        want = -(-sms * AS.BLOCKS_PER_SM // rows)                           # chunks per row for one wave
        tiles, per = -(-n // AS.TILE_KEYS), chunk // AS.TILE_KEYS
        assert nchunk <= want                                               # not more than one wave ...
        assert per == 1 or -(-tiles // (per - 1)) > want                    # ... with the smallest whole-tile chunk
    assert AS.split_chunks(2048, 1, 64, 512, 132) == (64, 32)               # GLM-5 decode on the H200
    chunk, nchunk = AS.split_chunks(8192, 16, 128, 512, 10_000)             # many partials: capped
    assert 16 * 128 * nchunk * 512 * 4 <= AS.PARTIAL_CAP_BYTES


def test_split_fits_needs_16_byte_rows_and_bases():
    assert AS.split_fits(512, 64, 0, 4096)
    assert not AS.split_fits(512, 64, 0, 4100)        # k_pe base not 16-byte aligned
    assert not AS.split_fits(30, 16, 0, 0) and not AS.split_fits(512, 66, 0, 0) and not AS.split_fits(544, 64, 0, 0)


def test_constants_are_the_kernels():
    src = (kernels_dir() / "attention.cu").read_text()
    defs = dict(re.findall(r"#define (ATT_\w+) (\d+)", src))
    assert int(defs["ATT_TK"]) == AS.TILE_KEYS
    assert int(defs["ATT_HPW"]) == AS.HEADS_PER_WARP
    assert int(defs["ATT_WARPS"]) == AS.WARPS


def test_tile_kernel_at_glm5_decode_shape_matches_the_float64_attention():
    """mla_attend_tile's order at GLM-5's decode shape (Lkv 512, rope 64: 144 float4 columns over 16 slices, 9 each)
    for one head group over 2 chunks of the default size, the second one short (a zero-filled tile)."""
    rng = np.random.default_rng(5)
    S, nh, Lkv, dr, T = 1, 16, 512, 64, 100
    qa, qpe, lat, kpe = _inputs(rng, S, nh, Lkv, dr, T)
    qa *= 0.05                                              # scores of a few units, as a trained model's
    chunk, nchunk = AS.split_chunks(T, S, nh, Lkv, sm_count=132, chunk=64)
    assert (chunk, nchunk) == (64, 2)
    got = emulate_split(qa, qpe, lat, kpe, 1 / 24, chunk, nchunk, S, T - S, kernel="tile")
    want, tol = reference64(qa, qpe, lat, kpe, 1 / 24, S, T - S)
    assert (np.abs(got - want) <= tol).all()


def test_tile_constants_are_the_kernels_and_share_the_part_kernels_cutting():
    """The tile kernel reuses split_chunks, head_groups and attn_span (coli/gpu/graphs.py): only right while its
    tiles and head groups are the part kernel's."""
    src = (kernels_dir() / "attention.cu").read_text()
    defs = dict(re.findall(r"#define (AT2_\w+) (\d+)", src))
    assert int(defs["AT2_TK"]) == AS.TILE2_KEYS == AS.TILE_KEYS
    assert int(defs["AT2_HB"]) == AS.TILE2_HEADS == AS.HEADS_PER_BLOCK
    assert int(defs["AT2_KS"]) == AS.TILE2_SLICES
    assert int(defs["AT2_THREADS"]) == AS.TILE2_THREADS
    # thread ownership covers each output once: scores (slice, 4 heads x 4 keys) per thread, context 8 heads x 4
    # dims per thread over Lkv <= 512
    assert AS.TILE2_SLICES * 16 == AS.TILE2_THREADS and AS.TILE2_HEADS * AS.TILE2_KEYS == AS.TILE2_THREADS
    assert (AS.TILE2_THREADS // 128) * 8 == AS.TILE2_HEADS
    for D in (48, 128, 576):
        assert AS.tile_row_stride(D) % 32 == 4 and AS.tile_row_stride(D) >= D


def test_tile3_kernel_at_glm5_decode_shape_matches_the_float64_attention():
    """mla_attend_tile3's order at GLM-5's decode shape, one head group, 2 chunks of the default 64 keys (two 32-key
    tiles each), the second one 36 keys long: its second tile has 4 keys, 28 zero rows."""
    rng = np.random.default_rng(5)
    S, nh, Lkv, dr, T = 1, 16, 512, 64, 100
    qa, qpe, lat, kpe = _inputs(rng, S, nh, Lkv, dr, T)
    qa *= 0.05
    chunk, nchunk = AS.split_chunks(T, S, nh, Lkv, sm_count=132, chunk=64)
    got = emulate_split(qa, qpe, lat, kpe, 1 / 24, chunk, nchunk, S, T - S, kernel="tile3")
    want, tol = reference64(qa, qpe, lat, kpe, 1 / 24, S, T - S)
    assert (np.abs(got - want) <= tol).all()


def test_tile3_constants_are_the_kernels():
    src = (kernels_dir() / "attention.cu").read_text()
    defs = dict(re.findall(r"#define (AT3_\w+) (\d+)", src))
    assert int(defs["AT3_TK"]) == AS.TILE3_KEYS == 2 * AS.TILE_KEYS
    assert int(defs["AT3_HB"]) == AS.TILE3_HEADS == AS.HEADS_PER_BLOCK   # split_chunks / head_groups / attn_span serve it
    assert int(defs["AT3_KS"]) == AS.TILE3_SLICES
    assert int(defs["AT3_THREADS"]) == AS.TILE3_THREADS
    assert int(defs["AT3_PTS"]) == AS.TILE3_PT_STRIDE
    # ownership: scores (slice, 4 heads x 8 keys) per thread, softmax 2 keys per thread, context 8 heads x 4 dims
    assert AS.TILE3_SLICES * 16 == AS.TILE3_THREADS and AS.TILE3_HEADS * AS.TILE3_KEYS == 2 * AS.TILE3_THREADS
    assert (AS.TILE3_THREADS // 128) * 8 == AS.TILE3_HEADS
    assert AS.TILE3_PT_STRIDE % 4 == 0 and AS.TILE3_PT_STRIDE >= AS.TILE3_HEADS   # 16-byte rows of 16 heads
    for D in (48, 128, 576):
        assert AS.tile3_row_stride(D) % 32 == 8 and AS.tile3_row_stride(D) >= D


@pytest.mark.parametrize("D", [48, 96, 128, 336, 576])     # Lkv + dr, from a small test model to GLM-5's 512 + 64
def test_tile3_staging_pattern_covers_each_piece_of_a_tile_once(D):
    """The (row, float4) pieces the threads stage per tile, stepped by additions from one division per block
    (mla_tile3_body's stage): every piece of the TILE3_KEYS x D/4 tile exactly once, none outside it."""
    D4 = D // 4
    seen = [p for tid in range(AS.TILE3_THREADS) for p in AS.tile3_pieces(tid, D4)]
    assert sorted(seen) == [(r, f) for r in range(AS.TILE3_KEYS) for f in range(D4)]
    for tid in (0, 1, 200, 255):                               # the steps are e = tid + k * THREADS
        assert AS.tile3_pieces(tid, D4) == [divmod(e, D4) for e in range(tid, AS.TILE3_KEYS * D4, AS.TILE3_THREADS)]
    # the queries' 16-byte staging walks the same pattern over the block's heads (AT3_QE steps)
    seen = [p for tid in range(AS.TILE3_THREADS) for p in AS.tile3_pieces(tid, D4, keys=AS.TILE3_HEADS)]
    assert sorted(seen) == [(h, f) for h in range(AS.TILE3_HEADS) for f in range(D4)]


def test_tile3_partial_scores_meet_each_bank_once_per_warp():
    """at3_sp_col: a bijection of a row's 32 key columns; a score-pass warp's 32 writes of one (i, j) and a softmax
    warp's 32 reads of one (slice, key half) land in 32 distinct banks (rows are 32 floats: bank = column)."""
    H, TK = AS.TILE3_HEADS, AS.TILE3_KEYS
    for sl in range(AS.TILE3_SLICES):
        for h in range(H):
            assert sorted(AS.tile3_sp_col(sl, h, k) for k in range(TK)) == list(range(TK))
    for w in range(AS.TILE3_THREADS // 32):
        for i in range(4):
            for j in range(8):                                 # score pass: lane -> slice, head hq + 4i, key kq + 4j
                banks = set()
                for tid in range(32 * w, 32 * w + 32):
                    sl, hq, kq = tid >> 4, tid & 3, (tid >> 2) & 3
                    h = hq + 4 * i
                    banks.add(((sl * H + h) * TK + AS.tile3_sp_col(sl, h, kq + 4 * j)) % 32)
                assert len(banks) == 32
        for k in range(AS.TILE3_SLICES):
            for half in (0, 16):                               # softmax: lane -> head sh, key st (+ 16)
                banks = {((k * H + (tid >> 4)) * TK + AS.tile3_sp_col(k, tid >> 4, (tid & 15) + half)) % 32
                         for tid in range(32 * w, 32 * w + 32)}
                assert len(banks) == 32


def test_tile3_shared_memory_fits_an_sm90_block_and_not_an_sm89_one():
    """217 KB at GLM-5's shape: within an H100/H200 block's 227 KB (232,448 bytes opt-in), past sm_86/89's 99 KB --
    which is why "auto" there never picks it (cuda_backend._split_kernels checks the device)."""
    assert 101376 < AS.tile3_smem_bytes(512, 64) <= 232448 - 1024


def test_onepass_combine_constants_and_grid_are_the_kernels():
    """mla_attend_combine_onepass: CMB_COLS float4 columns of a head per block, every column of Lkv <= 512 covered by
    ceil(Lkv / 4 / CMB_COLS) blocks, and a batch's CMB_LANES x CMB_BATCH chunk weights one per thread."""
    src = (kernels_dir() / "attention.cu").read_text()
    defs = dict(re.findall(r"#define (CMB_\w+) (\d+)", src))
    assert int(defs["CMB_COLS"]) == AS.ONEPASS_COLS and int(defs["CMB_LANES"]) == AS.ONEPASS_LANES
    assert int(defs["CMB_BATCH"]) == AS.ONEPASS_BATCH
    assert AS.ONEPASS_LANES * AS.ONEPASS_BATCH <= AS.ONEPASS_THREADS
    assert AS.combine_grid(AS.ONEPASS_COMBINE, 512, 64, 1) == (2, 64, 1)      # GLM-5 decode: 128 blocks
    assert AS.combine_grid(AS.ONEPASS_COMBINE, 32, 4, 3) == (1, 4, 3)
    assert AS.combine_grid(AS.ONEPASS_COMBINE, 260, 8, 1) == (2, 8, 1)        # 65 columns: the second block has one
    assert AS.combine_grid("mla_attend_combine4", 512, 64, 2) == (64, 2)
