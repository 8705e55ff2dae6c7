"""The tensor-core int4 prefill GEMM (cuda/prefill_mma.cu), transliterated to numpy and checked on the CPU (the
kernels themselves are checked against numpy on a GPU by tests/gpu/test_gpu_prefill.py):

- pf_split64: the four int8 parts of a 64-column block land at the byte positions the B fragments read, their
  accumulator starts are MAGIC - 8 sum(b_p), and the parts rebuild x to 2^-27 of the block's largest value;
- pf_mainloop's fragments for one warp: weight words from the staged rows (low nibbles k = 4t.., high k = 16 + 4t..),
  the split x as N = 4 tokens x 2 parts, the accumulator started at MAGIC - 8 sum(b) so that the MMA's integer
  result read as a float is 1.5 * 2^23 + the exact dot product, and the fp32 flush -- against float64 -- with the
  MMA emulated in PTX's fragment layout (tests/test_kernel_formulas.py);
- the host's layout check (pf_layout_ok) and shared-memory size (pf_smem).
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

from coli.container.format import MatrixLayout
from test_kernel_formulas import _mma_m16n8k32

F32 = np.float32
MAGIC = 0x4B400000
MAGIC_F = F32(12582912.0)


def pf_split64(v: np.ndarray):
    """pf_split64 for one block: (q bytes [256] int8, meta words [12] int32: the accumulator starts of parts
    (0, 1, 0, 1) and (2, 3, 2, 3), then fe's bits)."""
    v = v.astype(F32)
    q = np.zeros(256, np.int8)
    meta = np.zeros(12, np.int64)
    finite = bool(np.isfinite(v).all())
    m = F32(np.max(np.abs(v))) if finite else F32(0)
    E = int(np.frexp(m)[1]) - 1 if m > 0 else 0
    u = np.ldexp(v, 5 - E).astype(F32) if finite else np.zeros(64, F32)
    for p in range(4):
        b = np.rint(u)
        u = ((u - b) * F32(128)).astype(F32)
        for col in range(64):
            t, cc = col >> 4, col & 15
            w = cc & 7
            q[p * 64 + t * 16 + 8 * (cc >> 3) + 4 * (w & 1) + (w >> 1)] = int(b[col])
        meta[4 * (p >> 1) + (p & 1)] = meta[4 * (p >> 1) + (p & 1) + 2] = MAGIC - 8 * int(b.sum())
    meta[8] = np.array([np.ldexp(F32(1), E - 5) if finite else np.nan], F32).view(np.int32)[0]
    return q, meta.astype(np.int32)


def _block(rng, wide=False):
    v = rng.standard_normal(64).astype(F32)
    if wide:
        v *= np.exp2(rng.integers(-20, 8, 64)).astype(F32)
    return v


@pytest.mark.parametrize("seed", range(6))
def test_split_bytes_rebuild_the_block_to_2_pow_minus_27(seed):
    rng = np.random.default_rng(seed)
    v = _block(rng, wide=seed % 2 == 1)
    q, meta = pf_split64(v)
    fe = float(meta[8:9].view(F32)[0])
    back = np.zeros(64)
    bsum = np.zeros(4, np.int64)
    for p in range(4):
        for col in range(64):
            # the reader's view (pf_mainloop): piece t, MMA m, low/high nibble side odd, byte j -> column
            t, m, odd, j = col >> 4, (col >> 3) & 1, col & 1, (col & 7) >> 1
            byte = int(q[p * 64 + 16 * t + 8 * m + 4 * odd + j])
            assert abs(byte) <= 64
            back[col] += fe * 2.0 ** (-7 * p) * byte
            bsum[p] += byte
    c = MAGIC - 8 * bsum
    np.testing.assert_array_equal(meta[:8], [c[0], c[1], c[0], c[1], c[2], c[3], c[2], c[3]])
    assert np.abs(back - v.astype(np.float64)).max() <= np.abs(v).max() * 2.0 ** -27


def test_split_of_a_non_finite_block_gives_nan_factor_and_zero_parts():
    v = np.ones(64, F32)
    v[5] = np.inf
    q, meta = pf_split64(v)
    assert not q.any() and np.isnan(meta[8:9].view(F32)[0])


def _stage(wq: np.ndarray, xblocks: list[tuple[np.ndarray, np.ndarray]], G: int):
    """One stage's shared memory for block G: weight rows (32 bytes each), split x (256 bytes per activation row),
    metadata (8 words per activation row) -- as issue() copies them."""
    ws = np.ascontiguousarray(wq[:, 32 * G:32 * G + 32])
    xs = np.stack([xb[G][0] for xb in xblocks]).view(np.uint8)          # [tokens, 256]
    ms = np.stack([xb[G][1] for xb in xblocks])                          # [tokens, 12]
    return ws, xs, ms


def _warp_tile(wq, scales, group, xsplit, ntok_quads=1):
    """pf_mainloop for one warp, one 16-row MMA tile (i = 0, wr = 0) and `ntok_quads` quads of 4 tokens: the lanes'
    fragments built with the kernel's index expressions, the MMA emulated, the flush in fp32."""
    C = wq.shape[1] * 2
    nG, gsh = C // 64, 1 if group == 128 else 0
    acc = np.zeros((32, ntok_quads, 2), F32)
    for G in range(nG):
        ws, xs, ms = _stage(wq, xsplit, G)
        a_frags = [[], []]
        sc = np.zeros((32, 2), F32)
        for lane in range(32):
            g, t = lane >> 2, lane & 3
            w0 = ws[g, 8 * t:8 * t + 8].view(np.uint32)
            w1 = ws[g + 8, 8 * t:8 * t + 8].view(np.uint32)
            for m in range(2):
                x0, x1 = int(w0[m]), int(w1[m])
                a_frags[m].append((x0 & 0x0F0F0F0F, x1 & 0x0F0F0F0F, (x0 >> 4) & 0x0F0F0F0F, (x1 >> 4) & 0x0F0F0F0F))
            sc[lane] = scales[g, G >> gsh], scales[g + 8, G >> gsh]
        for q in range(ntok_quads):
            d = np.zeros((2, 32, 4), np.int64)
            for ab in range(2):
                b_frags = [[], []]
                for lane in range(32):
                    g, t = lane >> 2, lane & 3
                    tb = 4 * q + (g >> 1)
                    piece = xs[tb, (2 * ab + (g & 1)) * 64 + 16 * t:(2 * ab + (g & 1)) * 64 + 16 * t + 16]
                    bw = piece.view(np.uint32)
                    b_frags[0].append((int(bw[0]), int(bw[1])))
                    b_frags[1].append((int(bw[2]), int(bw[3])))
                    td = 4 * q + t
                    d[ab, lane] = ms[td, 4 * ab:4 * ab + 4]          # the MMA's c operand, as loaded
                for m in range(2):
                    d[ab] += np.array(_mma_m16n8k32(a_frags[m], b_frags[m]), np.int64)
            assert (d >= 0).all() and (d < 2 ** 31).all()
            for lane in range(32):
                t = lane & 3
                fe = ms[4 * q + t, 8:9].view(F32)[0]
                for r in range(2):
                    f = [np.array([d[ab, lane, 2 * r + c]], np.int64).astype(np.int32).view(F32)[0] - MAGIC_F
                         for ab in range(2) for c in range(2)]
                    assert all(float(x).is_integer() and abs(x) <= 2 ** 15 for x in f)    # exact integer dots
                    g01 = F32(np.float64(f[1]) * 0.0078125 + np.float64(f[0]))
                    g23 = F32(np.float64(f[3]) * 0.0078125 + np.float64(f[2]))
                    assert g01 == np.float64(f[1]) / 128 + np.float64(f[0])               # the pair sums are exact
                    h = F32(np.float64(g23) * 2.0 ** -14 + np.float64(g01))
                    acc[lane, q, r] = F32(np.float64(sc[lane, r] * fe) * np.float64(h) + np.float64(acc[lane, q, r]))
    return acc


@pytest.mark.parametrize("group,wide", [(64, False), (128, False), (64, True)])
def test_mainloop_fragments_give_the_dot_products(group, wide):
    rng = np.random.default_rng(group + wide)
    C, ntq = 256, 2
    nib = rng.integers(0, 16, (16, C))
    scales = rng.uniform(0.5, 1.5, (16, C // group)).astype(np.float16).astype(F32)
    wq = (nib[:, 0::2] | (nib[:, 1::2] << 4)).astype(np.uint8)          # byte j: column 2j low, 2j + 1 high
    x = np.stack([np.concatenate([_block(rng, wide) for _ in range(C // 64)]) for _ in range(4 * ntq)])
    xsplit = [[pf_split64(row[64 * G:64 * G + 64]) for G in range(C // 64)] for row in x]
    acc = _warp_tile(wq, scales, group, xsplit, ntq)
    W = (nib - 8) * np.repeat(scales.astype(np.float64), group, axis=1)    # [16, C]
    want = W @ x.astype(np.float64).T                                    # [16 rows, tokens]
    companion = np.abs(W) @ np.abs(x.astype(np.float64)).T
    # the split's 2^-27 of each block's largest x against that block's |w|, plus two fp32 roundings per block (the
    # parts' combination and the accumulating FFMA), each at most 2^-24 of the companion
    nG = C // 64
    blkmax = np.abs(x.astype(np.float64)).reshape(len(x), nG, 64).max(axis=2)          # [tokens, nG]
    wblk = np.abs(W).reshape(16, nG, 64).sum(axis=2)                                   # [16, nG]
    bound = 2.0 ** -27 * wblk @ blkmax.T + 2.5 * nG * 2.0 ** -24 * companion
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        for q in range(ntq):
            for r in range(2):
                row, tok = g + 8 * r, 4 * q + t
                assert abs(acc[lane, q, r] - want[row, tok]) <= bound[row, tok], (lane, q, r)

# ---- the flush variants (PF_EPI in prefill_mma.cu): the default's bits, operation by operation ----------------------
def _f32(v: Fraction) -> F32:
    """v rounded once to float32 (nearest, ties to even): float() first, then the float32 neighbour nearest to v."""
    x = F32(float(v))
    cands = [np.nextafter(x, F32(-np.inf)), x, np.nextafter(x, F32(np.inf))]
    best = min(cands, key=lambda c: (abs(Fraction(float(c)) - v), int(np.array(c).view(np.int32)) & 1))
    return F32(best)


def _fma(a, b, c) -> F32:
    return _f32(Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c)))


def _sub(a, b) -> F32:
    return _f32(Fraction(float(a)) - Fraction(float(b)))


def _mul(a, b) -> F32:
    return _f32(Fraction(float(a)) * Fraction(float(b)))


def _flush(epi: int, D, fe, sc, acc) -> F32:
    """One output's flush of a 64-column block as prefill_mma.cu writes it for PF_EPI = epi: D the four parts'
    integer dot products (the MMA registers hold MAGIC + D_p), fe = 2^(E-5), sc the fp16 group scale."""
    X = [np.array([MAGIC + int(d)], np.int32).view(F32)[0] for d in D]        # the MMA registers read as floats
    M1 = F32(12681216.0)                                                         # MAGIC + MAGIC / 2^7
    c7, c14 = F32(0.0078125), F32(6.103515625e-05)
    if epi == 0:
        f = [_sub(v, MAGIC_F) for v in X]
        h = _fma(_fma(f[3], c7, f[2]), c14, _fma(f[1], c7, f[0]))
        return _fma(_mul(sc, fe), h, acc)
    if epi == 1:
        p01, p23 = _fma(X[1], c7, _sub(X[0], M1)), _fma(X[3], c7, _sub(X[2], M1))
        return _fma(_mul(sc, fe), _fma(p23, c14, p01), acc)
    fe7, nm = _mul(fe, c7), _mul(-M1, fe)
    p01, p23 = _fma(X[1], fe7, _fma(X[0], fe, nm)), _fma(X[3], fe7, _fma(X[2], fe, nm))
    return _fma(sc, _fma(p23, c14, p01), acc)


@pytest.mark.parametrize("epi", [1, 2])
def test_flush_variants_give_the_default_flush_bits(epi):
    """PF_EPI 1 folds the magic into the pairs' FFMA, 2 also the block's power-of-two factor fe: every intermediate
    is exact, so each output gets the default's bits -- over the dot products' whole range (|D_p| <= 2^15), fp16
    scales (normal, subnormal, negative) and, for 2, blocks whose largest |x| lies in [2^-98, 2^100]."""
    rng = np.random.default_rng(epi)
    cases = 0
    for i in range(1500):
        D = rng.integers(-2 ** 15, 2 ** 15 + 1, 4)
        if i % 10 == 0:
            D = rng.choice([-2 ** 15, 2 ** 15, 0, 1, -1], 4)          # the range's ends
        E = int(rng.integers(-98, 101)) if i % 3 else int(rng.integers(-8, 9))
        fe = F32(np.ldexp(1.0, E - 5))
        sc = F32(np.float16(rng.choice([1, -1]) * (rng.uniform(2 ** -24, 2 ** -14) if i % 7 == 0
                                                    else rng.uniform(0.001, 4.0))))
        acc = F32(0) if i % 5 == 0 else F32(float(sc) * float(fe) * rng.standard_normal() * 2 ** 15)
        want, got = _flush(0, D, fe, sc, acc), _flush(epi, D, fe, sc, acc)
        assert np.array(want).view(np.int32) == np.array(got).view(np.int32), (D, E, sc, acc, want, got)
        cases += 1
    assert cases == 1500


def test_pf_layout_ok_and_shared_memory():
    from coli.container.format import MatrixLayout, RecordLayout
    from coli.gpu.cuda_backend import pf_layout_ok, pf_moe_layout_ok, pf_smem
    assert pf_layout_ok(MatrixLayout.make(2048, 6144, "int4", 64, 512))
    assert pf_layout_ok(MatrixLayout.make(6144, 16384, "int4", 128, 512))
    assert not pf_layout_ok(MatrixLayout.make(576, 6144, "int4", 64, 512))           # rows not whole blocks of 256
    assert not pf_layout_ok(MatrixLayout.make(2048, 6144 + 32, "int4", 32, 512))     # group 32, ragged columns
    assert not pf_layout_ok(MatrixLayout.make(2048, 6144, "int8", 64, 512))
    assert pf_moe_layout_ok(RecordLayout.make(6144, 2048, "int4", 64, 512))
    assert not pf_moe_layout_ok(RecordLayout.make(6144, 2048, "bf16", 0, 512))
    assert not pf_moe_layout_ok(RecordLayout.make(128, 64, "int4", 64, 512))          # H not whole blocks of 256
    assert not pf_moe_layout_ok(RecordLayout.make(6144, 2048 + 64, "int4", 64, 512))  # Im not whole blocks of 128
    # GLM-5: 3 stages of 17.5 KiB + the block's scales (256 rows x 96 groups x 2 bytes) + its tables: 2 blocks per SM
    assert pf_smem(6144, 64) == 3 * (256 * 32 + 32 * 256 + 32 * 48) + 256 * 96 * 2 + 256 * 16 + 32 * 4
    assert 2 * pf_smem(6144, 64) <= 227 * 1024 and 2 * pf_smem(2048, 64) <= 227 * 1024


# ---- the host side, on the recording stand-in runtime of tests/test_decode_launches.py ----------------------------
def _prefill_backend(version="mma"):
    from test_decode_launches import _RecordingRuntime, _backend

    class Rt(_RecordingRuntime):
        def __init__(self):
            super().__init__()
            self.reduce_masks: list[int] = []          # each moe_reduce's mask argument: 0 = every slot

        def to_device_async(self, host, dtype=None):
            return self.empty(np.asarray(host).shape, np.asarray(host).dtype)

        def zero(self, dst, nbytes):
            self.launches.append(("zero", (), 0, 0))

        def record(self, name, argtypes, grid, block, args, smem):
            super().record(name, argtypes, grid, block, args, smem)
            if name == "moe_reduce":
                self.reduce_masks.append(args[1])

    gb = _backend()
    gb.rt = Rt()
    gb.prefill_kernels, gb._pf_usable = version, True
    gb.faults = gb.on_kernel_error = gb._route = None
    return gb


@pytest.mark.parametrize("rows,cols,fmt,group,version,want", [
    (2048, 6144, "int4", 64, "mma", ["pf_split_rows", "pf_linear_int4"]),
    (6144, 16384, "int4", 128, "mma", ["pf_split_rows", "pf_linear_int4"]),
    (2048, 6144, "int4", 64, "v1", ["gemm_nt_int4"]),
    (576, 6144, "int4", 64, "mma", ["gemm_nt_int4"]),          # rows not whole blocks of 128
    (2048, 6144, "int8+", 64, "mma", ["pf_split_rows", "pf_linear_int8"]),    # +: COLI_PREFILL_INT8=1 (the default)
    (576, 6144, "int8+", 64, "mma", ["pf_split_rows", "pf_linear_int8"]),     # kv_a: the last row block partial
    (2048, 6144, "int8", 64, "mma", ["gemm_nt_int8"]),        # COLI_PREFILL_INT8=0: the fp32 tiles
    (2048, 6144, "int8+", 64, "v1", ["gemm_nt_int8"]),
    (2048, 6144 + 32, "int8+", 64, "mma", ["gemm_nt_int8"]),  # not whole 64-column blocks
    (2048, 6144, "bf16", 64, "mma", ["gemm_nt_bf16"]),
])
def test_prefill_linear_launches(rows, cols, fmt, group, version, want):
    from coli.gpu.cuda_backend import pf_smem
    from coli.gpu.cuda_weights import QWeight
    gb = _prefill_backend(version)
    gb.prefill_int8 = fmt.endswith("+")
    fmt = fmt.rstrip("+")
    lay = MatrixLayout.make(rows, cols, fmt, group, 512)
    w = QWeight(gb.rt.empty((lay.nbytes,), np.uint8).ptr, lay, (rows, cols))
    S = 300
    assert gb.linear(gb.rt.empty((S, cols)), w).shape == (S, rows)
    assert [x[0] for x in gb.rt.launches] == want
    if want[-1] == "pf_linear_int4":
        _, grid, block, smem = gb.rt.launches[-1]
        assert grid == (rows // 256, 10) and block == 256 and smem == pf_smem(cols, group)
        assert gb.rt.launches[0][1] == (S * cols // 64 // 8,)      # a warp per 64-column block
    if want[-1] == "pf_linear_int8":
        _, grid, block, smem = gb.rt.launches[-1]
        assert grid == (-(-rows // 256), 10) and block == 256 and smem == pf_smem(cols, 0, "int8")
        assert gb.rt.launches[0][1] == (S * cols // 64 // 8,)


def test_prefill_moe_launches_one_gateup_and_one_down_for_every_expert():
    """A 300-token prefill over 40 GLM-5 experts: x split once, one gate/up and one down launch over every expert's
    32-pair tiles, then the slot sum over the pairs they cover (the f32 record's slots are not theirs: the masked
    sum, no zeroed partials); that f32 record (a host expert) in the same batch takes the fp32 GEMMs after."""
    from coli.container.format import RecordLayout
    from coli.gpu.cuda_weights import DeviceRecord
    gb = _prefill_backend()
    lay = RecordLayout.make(6144, 2048, "int4", 64, 512)
    lay32 = RecordLayout.make(6144, 2048, "f32", 64, 512)
    E, K, S = 40, 8, 300
    rng = np.random.default_rng(0)
    idx = np.stack([rng.choice(E, K, replace=False) for _ in range(S)]).astype(np.int64)
    w = rng.uniform(0.1, 1, (S, K)).astype(F32)
    recs = [(e, DeviceRecord(gb.rt.empty((16,), np.uint8).ptr, lay32 if e == 7 else lay)) for e in range(E)]
    gb.moe(gb.rt.empty((S, 6144)), idx, w, iter(recs))
    names = [x[0] for x in gb.rt.launches]
    assert names[:4] == ["pf_split_rows", "pf_gateup_int4", "pf_down_int4", "moe_reduce"]
    assert names[4:] == ["zero", "moe_gateup_gemm_f32", "moe_down_gemm_f32", "moe_reduce"]
    masks = gb.rt.reduce_masks
    assert masks[0] != 0 and masks[1] == 0        # the tensor cores' sum is masked; the fp32 path zeroes and sums all
    pairs = np.isin(idx, [e for e in range(E) if e != 7])
    counts = np.bincount(idx[pairs], minlength=E)
    tiles = int(sum(-(-c // 32) for c in counts))
    assert gb.rt.launches[1][1] == (2048 // 128, tiles)
    assert gb.rt.launches[2][1] == (6144 // 256, tiles)


def test_a_prefill_in_batches_splits_x_once_and_sums_each_batchs_own_pairs():
    """The same prefill with its experts in three batches (FLUSH between them, as a pool smaller than the layer
    gives them): x is split by the first batch only, every batch sums just its own (token, slot) pairs (no zeroed
    [rows, K, H] partials), and the batches' sums add into the step's output; with every expert in one batch the
    plain slot sum runs, unmasked."""
    from coli.container.format import RecordLayout
    from coli.gpu.cuda_weights import FLUSH, DeviceRecord
    gb = _prefill_backend()
    lay = RecordLayout.make(6144, 2048, "int4", 64, 512)
    E, K, S = 24, 8, 300
    rng = np.random.default_rng(1)
    idx = np.stack([rng.choice(E, K, replace=False) for _ in range(S)]).astype(np.int64)
    w = rng.uniform(0.1, 1, (S, K)).astype(F32)
    recs = [(e, DeviceRecord(gb.rt.empty((16,), np.uint8).ptr, lay)) for e in range(E)]
    items = recs[:8] + [FLUSH] + recs[8:16] + [FLUSH] + recs[16:]
    gb.moe(gb.rt.empty((S, 6144)), idx, w, iter(items))
    names = [x[0] for x in gb.rt.launches]
    assert names.count("pf_split_rows") == 1 and "zero" not in names
    assert names.count("moe_reduce") == 3 and names.count("pf_gateup_int4") == 3
    assert all(m != 0 for m in gb.rt.reduce_masks)                   # each batch sums only its own pairs
    assert names.count("add") == 2                        # batch 2's and 3's sums onto the step's output
    gb = _prefill_backend()
    gb.moe(gb.rt.empty((S, 6144)), idx, w, iter(recs))
    names = [x[0] for x in gb.rt.launches]
    assert names == ["pf_split_rows", "pf_gateup_int4", "pf_down_int4", "moe_reduce"]
    assert gb.rt.reduce_masks == [0]                                   # every slot its own: no mask


def _pair_tiles_loop(idx, members, tile):
    """The grouped MoE's work list written as the plain loop it replaces (the reference)."""
    g_of = {e: g for g, e in enumerate(members)}
    tok, slot = np.nonzero(np.isin(idx, members))
    gid = np.array([g_of[int(idx[t, k])] for t, k in zip(tok, slot)], np.int64)
    order = np.argsort(gid, kind="stable")
    tok, slot, gid = tok[order], slot[order], gid[order]
    bounds = np.searchsorted(gid, np.arange(len(members) + 1))
    tiles = [(g, p0, min(tile, int(bounds[g + 1]) - p0)) for g in range(len(members))
             for p0 in range(int(bounds[g]), int(bounds[g + 1]), tile)]
    return tok, slot, gid, np.array(tiles, np.int32).reshape(-1, 3)


@pytest.mark.parametrize("seed,tile", [(0, 32), (1, 64), (2, 32), (3, 1)])
def test_moe_pair_tiles_match_the_plain_loop(seed, tile):
    """Pruned slots (-1), experts of other launches (not members), members nobody routes to, members out of order."""
    from coli.gpu.cuda_backend import moe_pair_tiles
    rng = np.random.default_rng(seed)
    S, K, E = int(rng.integers(1, 300)), int(rng.integers(1, 9)), 40
    idx = np.stack([rng.choice(E, K, replace=False) for _ in range(S)]).astype(np.int64)
    idx[rng.random((S, K)) < 0.1] = -1
    members = [int(e) for e in rng.permutation(E + 5)[:25]]          # some ids beyond any routed expert
    got, want = moe_pair_tiles(idx, members, tile), _pair_tiles_loop(idx, members, tile)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    tiles = got[3]
    assert (tiles[:, 2] >= 1).all() and (tiles[:, 2] <= tile).all() and tiles[:, 2].sum() == got[0].size


def test_the_prefill_kernel_setting_must_name_a_version():
    from coli.errors import ColiError
    from coli.gpu.cuda_backend import PREFILL_VERSIONS, kernel_choice
    assert kernel_choice("COLI_PREFILL_KERNELS", "v1", PREFILL_VERSIONS) == "v1"
    with pytest.raises(ColiError, match=r"COLI_PREFILL_KERNELS='fast' is not a kernel version: use one of mma, v1"):
        kernel_choice("COLI_PREFILL_KERNELS", "fast", PREFILL_VERSIONS)


# ---- pf_linear_int8 (int8 weights, one fp16 scale per row) ---------------------------------------------------------
def _prmt(lo: int, hi: int, sel: int) -> int:
    """__byte_perm(lo, hi, sel): result byte i = byte (sel >> 4 i) & 7 of hi:lo."""
    src = int(lo).to_bytes(4, "little") + int(hi).to_bytes(4, "little")
    return int.from_bytes(bytes(src[(sel >> 4 * i) & 7] for i in range(4)), "little")


def _mma_s8s8(a_frag, b_frag):
    """mma.sync.m16n8k32 s8 x s8 from the u8 x s8 emulation: a byte >= 128 is itself - 256 as a signed A."""
    du = np.array(_mma_m16n8k32(a_frag, b_frag), np.int64)
    high = [tuple(int.from_bytes(bytes(b >> 7 for b in int(w).to_bytes(4, "little")), "little") for w in fr)
            for fr in a_frag]
    return du - 256 * np.array(_mma_m16n8k32(high, b_frag), np.int64)


def _warp_tile_int8(q8: np.ndarray, row_scale: np.ndarray, xsplit, ntok_quads=1):
    """pf_mainloop<FMT_INT8> for one warp, one 16-row tile (i = 0, wr = 0), `ntok_quads` quads of 4 tokens, then
    pf_linear_int8's store: 64-byte staged rows, each lane's 16 bytes sorted by PRMT into even / odd columns, the
    s8 x s8 MMA from C = MAGIC, the PF_EPI 1 flush with scale 1 (fp32, each operation rounded once), the row's scale
    times the sum at the end."""
    C = q8.shape[1]
    wq = q8.astype(np.int8).view(np.uint8)
    acc = np.zeros((32, ntok_quads, 2), F32)
    M1, c7, c14 = F32(12681216.0), F32(0.0078125), F32(6.103515625e-05)
    for G in range(C // 64):
        ws = np.ascontiguousarray(wq[:, 64 * G:64 * G + 64])                      # the stage's weight rows
        xs = np.stack([xb[G][0] for xb in xsplit]).view(np.uint8)
        ms = np.stack([xb[G][1] for xb in xsplit])
        a_frags = [[], []]
        for lane in range(32):
            g, t = lane >> 2, lane & 3
            w0 = ws[g, 16 * t:16 * t + 16].view(np.uint32)
            w1 = ws[g + 8, 16 * t:16 * t + 16].view(np.uint32)
            for m in range(2):
                lo0, hi0, lo1, hi1 = int(w0[2 * m]), int(w0[2 * m + 1]), int(w1[2 * m]), int(w1[2 * m + 1])
                a_frags[m].append((_prmt(lo0, hi0, 0x6420), _prmt(lo1, hi1, 0x6420), _prmt(lo0, hi0, 0x7531),
                                   _prmt(lo1, hi1, 0x7531)))
        for q in range(ntok_quads):
            d = np.full((2, 32, 4), MAGIC, np.int64)                                 # C = MAGIC: no offset
            for ab in range(2):
                b_frags = [[], []]
                for lane in range(32):
                    g, t = lane >> 2, lane & 3
                    tb = 4 * q + (g >> 1)
                    bw = xs[tb, (2 * ab + (g & 1)) * 64 + 16 * t:(2 * ab + (g & 1)) * 64 + 16 * t + 16].view(np.uint32)
                    b_frags[0].append((int(bw[0]), int(bw[1])))
                    b_frags[1].append((int(bw[2]), int(bw[3])))
                for m in range(2):
                    d[ab] += _mma_s8s8(a_frags[m], b_frags[m])
            assert (np.abs(d - MAGIC) < 2 ** 19).all()              # within the magic's exact range (2^22)
            for lane in range(32):
                fe = ms[4 * q + (lane & 3), 8:9].view(F32)[0]
                for r in range(2):
                    X = [np.array([d[ab, lane, 2 * r + c]], np.int32).view(F32)[0] for ab in range(2) for c in range(2)]
                    assert all(float(v - MAGIC_F).is_integer() for v in X)       # exact integer dot products
                    p01, p23 = _fma(X[1], c7, _sub(X[0], M1)), _fma(X[3], c7, _sub(X[2], M1))
                    acc[lane, q, r] = _fma(fe, _fma(p23, c14, p01), acc[lane, q, r])
    out = np.zeros_like(acc)
    for lane in range(32):
        g = lane >> 2
        for r in range(2):
            out[lane, :, r] = [_mul(a, row_scale[g + 8 * r]) for a in acc[lane, :, r]]
    return out


@pytest.mark.parametrize("wide", [False, True])
def test_int8_mainloop_fragments_give_the_dot_products(wide):
    """The int8 path against float64, every byte of -127..127 (and the quantiser's ends) in play: the bound is the
    split's 2^-27 of each block's largest x against that block's |w|, plus per block the pairs' two roundings and the
    combination's (F0 + F1 / 2^7 needs 27 bits for int8), the accumulating FFMA's over the nG blocks, and the row
    scale's product: (nG + 4) roundings of 2^-24 of the companion sum |w| |x|."""
    rng = np.random.default_rng(8 + wide)
    C, ntq = 256, 2
    q8 = rng.integers(-127, 128, (16, C))
    q8[0, :64] = 127
    q8[1, :64] = -127                                                    # a block at the MMA's largest sums
    row_scale = rng.uniform(0.5, 1.5, 16).astype(np.float16).astype(F32)
    x = np.stack([np.concatenate([_block(rng, wide) for _ in range(C // 64)]) for _ in range(4 * ntq)])
    x[:, :64] = np.abs(x[:, :64])
    xsplit = [[pf_split64(row[64 * G:64 * G + 64]) for G in range(C // 64)] for row in x]
    got = _warp_tile_int8(q8, row_scale, xsplit, ntq)
    W = q8 * row_scale.astype(np.float64)[:, None]                       # [16, C]
    want = W @ x.astype(np.float64).T                                    # [16 rows, tokens]
    companion = np.abs(W) @ np.abs(x.astype(np.float64)).T
    nG = C // 64
    blkmax = np.abs(x.astype(np.float64)).reshape(len(x), nG, 64).max(axis=2)
    wblk = np.abs(W).reshape(16, nG, 64).sum(axis=2)
    bound = 2.0 ** -27 * wblk @ blkmax.T + (nG + 4) * 2.0 ** -24 * companion
    worst = 0.0
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        for q in range(ntq):
            for r in range(2):
                row, tok = g + 8 * r, 4 * q + t
                err = abs(float(got[lane, q, r]) - want[row, tok])
                assert err <= bound[row, tok], (lane, q, r, err, bound[row, tok])
                worst = max(worst, err / companion[row, tok])
    assert worst > 0          # fp32 roundings happened: the comparison is not vacuous


def test_int8_fragments_wrong_column_order_is_caught():
    """The bound rejects a kernel that pairs the weight bytes with the wrong x columns (the halves of every 8 columns
    swapped)."""
    rng = np.random.default_rng(3)
    C = 64
    q8 = rng.integers(-127, 128, (16, C))
    x = np.stack([_block(rng) for _ in range(4)])
    xsplit = [[pf_split64(row)] for row in x]
    swapped = q8.reshape(16, 8, 2, 4)[:, :, ::-1].reshape(16, C)        # columns 0-3 and 4-7 of each 8 swapped
    got = _warp_tile_int8(swapped, np.ones(16, F32), xsplit)
    want = q8.astype(np.float64) @ x.astype(np.float64).T
    companion = np.abs(q8.astype(np.float64)) @ np.abs(x.astype(np.float64)).T
    errs = [abs(float(got[lane, 0, r]) - want[(lane >> 2) + 8 * r, lane & 3])
            - 6 * 2.0 ** -24 * companion[(lane >> 2) + 8 * r, lane & 3] for lane in range(32) for r in range(2)]
    assert max(errs) > 0


def test_pf_int8_layout_ok_and_shared_memory():
    from coli.gpu.cuda_backend import pf_int8_layout_ok, pf_layout_ok, pf_smem
    for rows, cols in ((2048, 6144), (16384, 2048), (576, 6144), (128, 6144), (6144, 16384)):   # GLM-5's int8 core
        lay = MatrixLayout.make(rows, cols, "int8", 0, 512)
        assert pf_int8_layout_ok(lay) and not pf_layout_ok(lay)
    assert not pf_int8_layout_ok(MatrixLayout.make(2048, 6144 + 32, "int8", 0, 512))   # not whole 64-column blocks
    assert not pf_int8_layout_ok(MatrixLayout.make(2048, 6144, "int4", 64, 512))
    assert not pf_int8_layout_ok(MatrixLayout.make(2048, 6144, "bf16", 0, 512))
    # 3 stages of 25.5 KiB (64-byte weight rows) + the tables, no scales: within sm_86/89's 99 KB, 2 blocks per SM on
    # sm_90, whatever the width
    want = 3 * (256 * 64 + 32 * 256 + 32 * 48) + 256 * 16 + 32 * 4
    assert pf_smem(6144, 0, "int8") == pf_smem(16384, 0, "int8") == want
    assert pf_smem(6144, 0, "int8") <= 99 * 1024 and 2 * pf_smem(6144, 0, "int8") <= 227 * 1024


def test_the_int8_prefill_switch_defaults_on_and_a_bad_value_is_a_one_line_error_naming_it():
    from coli.errors import ColiError
    from coli.gpu.cuda_backend import prefill_int8_enabled
    assert prefill_int8_enabled({}) is True                      # since its GPU tests passed (2026-12-01)
    assert prefill_int8_enabled({"COLI_PREFILL_INT8": "0"}) is False
    assert prefill_int8_enabled({"COLI_PREFILL_INT8": " 1 "}) is True
    for v in ("2", "on", ""):
        with pytest.raises(ColiError) as e:
            prefill_int8_enabled({"COLI_PREFILL_INT8": v})
        msg = str(e.value)
        assert "COLI_PREFILL_INT8" in msg and "use 1" in msg and "or 0" in msg and "\n" not in msg


# ---- the split-x and metadata copies of one stage (pf_mainloop's issue()), PF_HOIST 0 and 2 ------------------------
def _stage_x_copies(hoist: int, act: list[int], nact: int, nG: int, G: int, xq: np.ndarray, xm: np.ndarray,
                    threads: int, toks: int):
    """issue()'s split-x and metadata cp.async for block G, transliterated thread by thread: (xs [toks, 256] bytes,
    ms [toks, 12] words as staged, how often each staged byte / word was written, per copy round j the source byte
    offsets of each warp). xq: [R * nG * 256] bytes, xm: [R * nG * 12] words; act[a] < 0: an absent row."""
    XK = toks * 16 // threads
    xs, ms = np.zeros((toks, 256), np.int64), np.zeros((toks, 12), np.int64)
    nx, nm = np.zeros((toks, 256), np.int64), np.zeros((toks, 12), np.int64)
    srcs: dict[tuple[int, int], list[int]] = {}

    def cp_x(a, pc, src, n):                       # pf_cp16 into the x area: n = 0 fills zeros
        xs[a, 16 * pc:16 * pc + 16] = xq[src:src + 16] if n else 0
        nx[a, 16 * pc:16 * pc + 16] += 1

    def cp_m(a, pc, src, n):
        ms[a, 4 * pc:4 * pc + 4] = xm[src:src + 4] if n else 0
        nm[a, 4 * pc:4 * pc + 4] += 1
    for tid in range(threads):
        if hoist == 2:
            XPR = 16 // XK
            xa, xp, ma = tid // XPR, tid % XPR, tid // 3
            xsrc = act[min(xa, nact - 1)] * nG * 256 + 16 * xp
            msrc = act[min(ma, nact - 1)] * nG * 12 + 4 * (tid - 3 * ma)
            for j in range(XK):
                src = xsrc + 256 * G + 16 * XPR * j
                cp_x(xa, xp + XPR * j, src, 16)
                srcs.setdefault((tid // 32, j), []).append(src)
            if tid < 3 * toks:
                cp_m(ma, tid - 3 * ma, msrc + 12 * G, 16)
        else:
            for k in range(XK):
                idx = tid + threads * k
                a, pc = idx >> 4, idx & 15
                r = act[a]
                src = (r * nG + G) * 256 + 16 * pc if r >= 0 else 0
                cp_x(a, pc, src, 16 if r >= 0 else 0)
                srcs.setdefault((tid // 32, k), []).append(src)
            if tid < 3 * toks:
                a = tid // 3
                pc, r = tid - 3 * a, act[a]
                cp_m(a, pc, (r * nG + G) * 12 + 4 * pc if r >= 0 else 0, 16 if r >= 0 else 0)
    return xs, ms, nx, nm, srcs


@pytest.mark.parametrize("threads,toks", [(256, 32), (128, 32), (512, 64), (256, 64)])   # the sweep's block shapes
@pytest.mark.parametrize("nact", [1, 5, 17, 32])
def test_hoist2_copies_stage_the_defaults_rows_from_one_pointer_each(threads, toks, nact):
    """PF_HOIST 2 stages every present row's split x and metadata exactly as the default does, writes every staged
    byte once, fills an absent row with a present row's bytes (valid data, never zeros from nowhere), and each copy
    round of a warp reads whole 16 x (16 / XK)-byte runs of a row (the contiguous reads it was built for)."""
    rng = np.random.default_rng(threads + toks + nact)
    nact = min(nact, toks)
    R, nG = 70, 3
    xq = rng.integers(0, 256, R * nG * 256)
    xm = rng.integers(-2 ** 31, 2 ** 31, R * nG * 12)
    rows = rng.choice(R, nact, replace=False).tolist()
    act = rows + [-1] * (toks - nact)
    for G in range(nG):
        want = _stage_x_copies(0, act, nact, nG, G, xq, xm, threads, toks)
        got = _stage_x_copies(2, act, nact, nG, G, xq, xm, threads, toks)
        np.testing.assert_array_equal(got[0][:nact], want[0][:nact])
        np.testing.assert_array_equal(got[1][:nact], want[1][:nact])
        assert (got[2] == 1).all() and (got[3] == 1).all()           # every staged byte / word written once
        assert (want[2] == 1).all() and (want[3] == 1).all()
        last = _stage_x_copies(0, [act[nact - 1]] * toks, toks, nG, G, xq, xm, threads, toks)
        np.testing.assert_array_equal(got[0][nact:], last[0][nact:])    # absent rows: the last present row
        np.testing.assert_array_equal(got[1][nact:], last[1][nact:])
        XPR = 16 // (toks * 16 // threads)
        for src in got[4].values():
            runs = np.array(src).reshape(-1, XPR)                      # lanes of one row, in lane order
            assert (np.diff(runs, axis=1) == 16).all()                  # contiguous 16-byte pieces
