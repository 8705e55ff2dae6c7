"""The integer and indexing tricks inside the CUDA kernels, transliterated to numpy and checked exhaustively on the
CPU (the kernels themselves are checked against numpy on a GPU by tests/gpu/):

- dequantisation without int->float conversions (coli_common.cuh chunk_dot): a 4-bit or 8-bit code OR-ed into
  the mantissa of 2^23, minus a constant, is exactly the code's value;
- the shared-memory swizzle of x (xs_slot): a permutation inside each chunk, and 8 consecutive lanes reading
  float4 k of their chunks hit 8 distinct 16-byte bank groups;
- the row addressing of stored matrices (qmat_row) agrees with the container format's tile layout;
- the radix top-k selection (indexer.cu topk_select) selects what a sort would;
- the tensor-core int4 MoE decode (moe_mma.cu): the four-part int8 split of x is exact to 2^-27 of a block's
  largest value, and the per-lane MMA fragments (nibble unpacking, which lanes feed B, D's post-processing)
  give the rows' dot products -- the MMA emulated with PTX's fragment layout;
- which layouts the tensor-core kernels accept (cuda_backend.mma_layout_ok) and which kernel version the
  backend picks (CudaBackend._moe_version, host logic, on a stand-in runtime);
- the runtime raises a kernel's dynamic shared memory limit whenever static + dynamic passes 48 KiB.
"""

from __future__ import annotations

import numpy as np
import pytest

from coli.container.format import MatrixLayout, align

F32 = np.float32


def _f(bits) -> np.ndarray:
    return np.asarray(bits, np.uint32).view(F32)


def test_int4_nibbles_from_the_mantissa_of_2_pow_23():
    b = np.arange(256, dtype=np.uint32)
    word = b | 0x4B000000                                    # __byte_perm(w, 0x4b000000, 0x7440 + k)
    lo = _f(word & 0x4B00000F) - F32(8388616.0)              # nib_lo - 8
    hi = _f(word & 0x4B0000F0) - F32(8388736.0)              # 16 * (nib_hi - 8)
    np.testing.assert_array_equal(lo, (b & 15).astype(F32) - 8)
    np.testing.assert_array_equal(hi, 16 * ((b >> 4).astype(F32) - 8))
    # fmaf(hi_acc, 1/16, lo_acc) recovers the plain sum exactly for in-range partial sums
    assert F32(16 * -8) * F32(0.0625) == F32(-8)


def test_int4_nibbles_in_place_chunk_dot2():
    """chunk_dot2 (moe kernels, second version): nibble q of a word (bits 4q..4q+3) is column 8i+q; q = 0..3 are
    OR-ed into 2^23's mantissa in place, giving 16^q * (nib - 8) after subtracting 2^23 + 8 * 16^q; q = 4..7 the
    same from the word shifted right by 16. Exhaustive over every 16-bit half, and a chunk's dot against the
    plain formula (column 2j = low nibble of byte j)."""
    M = np.uint32(0x4B000000)
    bias = [F32(8388616.0), F32(8388736.0), F32(8390656.0), F32(8421376.0)]
    half = np.arange(1 << 16, dtype=np.uint32)
    for q in range(4):
        got = _f((half & np.uint32(0xF << (4 * q))) | M) - bias[q]
        np.testing.assert_array_equal(got, F32(16 ** q) * (((half >> (4 * q)) & 15).astype(F32) - 8))
    rng = np.random.default_rng(1)
    chunk = rng.integers(0, 256, 16, dtype=np.uint8)             # 16 bytes = 32 int4 weights
    words = chunk.view(np.uint32)
    x = rng.standard_normal(32).astype(F32)
    a = np.zeros(4, np.float64)
    for i, w in enumerate(words):
        for q in range(8):
            part = w if q < 4 else w >> np.uint32(16)
            v = _f((part & np.uint32(0xF << (4 * (q % 4)))) | M) - bias[q % 4]
            a[q % 4] += float(v) * float(x[8 * i + q])
    got = a[0] + a[1] / 16 + a[2] / 256 + a[3] / 4096
    plain = np.empty(32, np.float64)
    plain[0::2] = (chunk & 15).astype(np.float64) - 8
    plain[1::2] = (chunk >> 4).astype(np.float64) - 8
    assert abs(got - plain @ x.astype(np.float64)) <= 1e-9 * np.abs(plain * x).sum()


def test_int8_codes_from_the_mantissa_of_2_pow_23():
    b = np.arange(256, dtype=np.uint32)
    v = _f((b | 0x4B000000) ^ 0x80) - F32(8388736.0)
    np.testing.assert_array_equal(v, b.astype(np.uint8).view(np.int8).astype(F32))


def test_bf16_halves_of_a_word():
    rng = np.random.default_rng(0)
    x = rng.standard_normal(64).astype(F32)
    bf = (x.view(np.uint32) >> 16).astype(np.uint16)         # truncation is enough to test the unpacking
    words = bf.view(np.uint32)                              # little-endian pairs: value 2i low, 2i+1 high
    even = _f(words << 16)
    odd = _f(words & 0xFFFF0000)
    want = (bf.astype(np.uint32) << 16).view(F32)
    np.testing.assert_array_equal(even, want[0::2])
    np.testing.assert_array_equal(odd, want[1::2])


@pytest.mark.parametrize("f4,shift", [(1, 3), (2, 2), (4, 1), (8, 0)])   # f32, bf16, int8, int4
def test_x_swizzle_is_a_permutation_and_bank_conflict_free(f4, shift):
    def slot(c, k):
        return c * f4 + (k ^ ((c >> shift) & (f4 - 1)))
    for c in range(64):
        assert sorted(slot(c, k) for k in range(f4)) == list(range(c * f4, (c + 1) * f4))
    # a 16-byte shared load is served per quarter warp: lanes 8q..8q+7 read float4 k of chunks c0+lane
    for c0 in range(0, 256, 8):
        for k in range(f4):
            groups = {slot(c0 + lane, k) % 8 for lane in range(8)}
            assert len(groups) == 8, (f4, c0, k)


def qmat_row(lay: MatrixLayout, r: int) -> tuple[int, int]:
    """coli_common.cuh qmat_row: byte offsets of row r's data and metadata from the matrix start."""
    t, i = divmod(r, lay.rows_per_tile)
    tile = t * lay.tile_bytes
    n = min(lay.rows_per_tile, lay.rows - t * lay.rows_per_tile)
    meta = tile + i * lay.row_meta_bytes
    data = tile + align(n * lay.row_meta_bytes, 16) + i * lay.row_data_bytes
    return data, meta


@pytest.mark.parametrize("rows,cols,fmt,group,tile_kb", [
    (2048, 6144, "int4", 64, 512), (6144, 2048, "int4", 128, 512), (77, 100, "int4", 32, 4), (576, 6144, "int8", 0, 512),
    (100, 100, "int8", 0, 4), (33, 100, "bf16", 0, 4), (1000, 64, "f32", 0, 4), (5, 7, "f32", 0, 4)])
def test_row_addressing_matches_the_tile_layout(rows, cols, fmt, group, tile_kb):
    from coli.container.quant import encode_matrix, quantize
    lay = MatrixLayout.make(rows, cols, fmt, group or 64, tile_kb)
    rng = np.random.default_rng(1)
    w = rng.standard_normal((rows, cols)).astype(F32)
    data, meta = quantize(w, fmt, group or 64)
    buf = encode_matrix(lay, data, meta)
    for r in sorted({0, 1, rows // 2, rows - 1} | set(range(0, rows, max(1, rows // 37)))):
        d, m = qmat_row(lay, r)
        assert bytes(buf[d:d + lay.row_data_bytes]) == data[r].tobytes()
        assert bytes(buf[m:m + lay.row_meta_bytes]) == meta[r].tobytes()
        if fmt in ("f32", "bf16", "int8", "int4") and lay.row_data_bytes % 16 == 0:
            assert d % 16 == 0          # the GEMV kernels' 16-byte loads stay aligned


def order_key(x: np.ndarray) -> np.ndarray:
    u = x.astype(F32).view(np.uint32)
    return np.where(u >> 31 == 1, ~u, u | np.uint32(0x80000000)).astype(np.uint32)


def radix_topk(row: np.ndarray, k: int) -> list[int]:
    """indexer.cu topk_select: 4 passes of 8-bit digits from the top, then an ordered compaction."""
    u = order_key(row)
    prefix, mask, krem = 0, 0, k
    for shift in (24, 16, 8, 0):
        sel = (u & np.uint32(mask)) == np.uint32(prefix)
        hist = np.bincount(((u[sel] >> np.uint32(shift)) & np.uint32(255)).astype(np.int64), minlength=256)
        cum = 0
        for d in range(255, -1, -1):
            if cum + hist[d] >= krem:
                prefix |= d << shift
                mask |= 255 << shift
                krem -= cum
                break
            cum += hist[d]
    thr = np.uint32(prefix)
    out, eq_seen = [], 0
    for t in range(len(row)):
        if u[t] > thr:
            out.append(t)
        elif u[t] == thr:
            if eq_seen < krem:
                out.append(t)
            eq_seen += 1
    return out


@pytest.mark.parametrize("seed", range(6))
def test_radix_topk_selects_what_a_sort_selects(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(50, 3000))
    k = int(rng.integers(1, n))
    row = rng.standard_normal(n).astype(F32)
    if seed % 2:
        row = np.round(row, 1).astype(F32)                 # many ties, negative zero included
        row[::7] = F32(-0.0)
    if seed == 4:
        row[:] = F32(1.5)                                   # all equal
    got = radix_topk(row, k)
    want = sorted(np.lexsort((np.arange(n), -row.astype(np.float64)))[:k].tolist())
    assert len(got) == k
    if (row == 0).any():    # -0.0 and +0.0 order apart in the key: compare as sets by value
        assert sorted(row[got].tolist()) == sorted(row[want].tolist())
    else:
        assert got == want


# ---- the tensor-core int4 MoE decode (cuda/moe_mma.cu), transliterated --------------------------------------------
def _split_block64(v: np.ndarray):
    """split_block64 for one 64-value block: (int8 parts [4, 64], part sums [4], factors [4]) -- as the kernel."""
    v = v.astype(F32)
    m = np.max(np.abs(v))
    E = int(np.frexp(m)[1]) - 1 if m > 0 else 0
    u = np.ldexp(v, 5 - E).astype(F32)
    parts = []
    for _ in range(4):
        r = np.rint(u)
        parts.append(r.astype(np.int64))
        u = ((u - r) * F32(128)).astype(F32)
    b = np.stack(parts)
    return b, b.sum(axis=1), np.array([np.ldexp(1.0, E - 5 - 7 * p) for p in range(4)], np.float64)


@pytest.mark.parametrize("seed", range(6))
def test_moe_mma_split_is_exact_to_2_pow_minus_27_of_the_block_max(seed):
    rng = np.random.default_rng(seed)
    v = (rng.standard_normal(64) * np.exp2(rng.integers(-24, 8, 64))).astype(F32)
    b, _, f = _split_block64(v)
    assert np.abs(b).max() <= 64
    back = (b * f[:, None]).sum(axis=0)
    assert np.abs(back - v.astype(np.float64)).max() <= np.abs(v).max() * 2.0 ** -27


def _mma_m16n8k32(a_frag, b_frag):
    """mma.sync.m16n8k32 (u8 x s8 -> s32) from per-lane fragments, with PTX's fragment layout:
    lane (g, t): a0 -> A[g][4t+i], a1 -> A[g+8][4t+i], a2 -> A[g][16+4t+i], a3 -> A[g+8][16+4t+i] (bytes i),
    b0 -> B[4t+i][g], b1 -> B[16+4t+i][g]; D: d0 D[g][2t], d1 D[g][2t+1], d2 D[g+8][2t], d3 D[g+8][2t+1]."""
    A = np.full((16, 32), -999, np.int64)
    B = np.full((32, 8), -999, np.int64)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        a = [np.frombuffer(np.uint32(w).tobytes(), np.uint8).astype(np.int64) for w in a_frag[lane]]
        bb = [np.frombuffer(np.uint32(w).tobytes(), np.int8).astype(np.int64) for w in b_frag[lane]]
        for i in range(4):
            A[g, 4 * t + i], A[g + 8, 4 * t + i] = a[0][i], a[1][i]
            A[g, 16 + 4 * t + i], A[g + 8, 16 + 4 * t + i] = a[2][i], a[3][i]
            B[4 * t + i, g], B[16 + 4 * t + i, g] = bb[0][i], bb[1][i]
    assert (A != -999).all() and (B != -999).all()
    D = A @ B
    return [(D[lane // 4, 2 * (lane % 4)], D[lane // 4, 2 * (lane % 4) + 1], D[lane // 4 + 8, 2 * (lane % 4)],
             D[lane // 4 + 8, 2 * (lane % 4) + 1]) for lane in range(32)]


@pytest.mark.parametrize("group", [64, 128])
def test_moe_mma_fragments_give_the_dot_products(group):
    """One 16-row tile over 256 columns (two 128-column steps) exactly as mma_rows does it: each lane's 16-byte
    chunk of rows g and g + 8 unpacked (low / high nibbles), B fed from the split x of its chunk only when its
    x block is the MMA column's, D post-processed with the part sums, factors and group scales, summed over the
    four lanes t -- equals sum (q - 8) * scale * x per row (float64, to fp32-level error)."""
    rng = np.random.default_rng(group)
    cols, nsteps = 256, 2
    q = rng.integers(0, 16, (16, cols))                              # nibbles
    scale = rng.uniform(0.5, 1.5, (16, cols // group)).astype(np.float16).astype(np.float64)
    x = (rng.standard_normal(cols) * np.exp2(rng.integers(-6, 4, cols))).astype(F32)
    # the stored rows: byte c // 2 of a row holds column c (low nibble, c even) and c + 1 (high nibble)
    packed = (q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8)          # [16, cols / 2]
    # the split x in moe_split_x4's layout: q[chunk][part][8 words], word 2i + (jj & 1), byte jj >> 1
    nblk = cols // 64
    xq = np.zeros((cols // 32, 4, 8, 4), np.int8)
    xc = np.zeros((nblk, 4), np.int64)
    xf = np.zeros((nblk, 4))
    for X in range(nblk):
        b, c, f = _split_block64(x[64 * X:64 * X + 64])
        xc[X], xf[X] = c, f
        for col in range(64):
            chunk, cc = 2 * X + col // 32, col % 32
            i, jj = cc // 8, cc % 8
            xq[chunk, :, 2 * i + (jj & 1), jj >> 1] = b[:, col]
    words = xq.view(np.uint32).reshape(cols // 32, 4, 8)
    gsh = 1 if group == 128 else 0
    acc = np.zeros((32, 2))
    for s in range(nsteps):
        a_frags, b_frags = [[] for _ in range(4)], [[] for _ in range(4)]
        for lane in range(32):
            g, t = lane // 4, lane % 4
            chunk, half = 4 * s + t, t // 2
            w0 = packed[g, 16 * chunk:16 * chunk + 16].view(np.uint32)
            w1 = packed[g + 8, 16 * chunk:16 * chunk + 16].view(np.uint32)
            feeds = (g // 4) == half
            bw = words[chunk, g % 4] if feeds else np.zeros(8, np.uint32)
            for k in range(4):
                lo0, hi0 = w0[k] & 0x0F0F0F0F, (w0[k] >> 4) & 0x0F0F0F0F
                lo1, hi1 = w1[k] & 0x0F0F0F0F, (w1[k] >> 4) & 0x0F0F0F0F
                a_frags[k].append((lo0, lo1, hi0, hi1))
                b_frags[k].append((bw[2 * k], bw[2 * k + 1]))
        d = np.zeros((32, 4), np.int64)
        for k in range(4):
            d += np.array(_mma_m16n8k32(a_frags[k], b_frags[k]), np.int64)
        for lane in range(32):
            g, t = lane // 4, lane % 4
            X, p0 = 2 * s + t // 2, 2 * (t & 1)
            c0, c1, f0, f1 = xc[X, p0], xc[X, p0 + 1], xf[X, p0], xf[X, p0 + 1]
            for r, row in enumerate((g, g + 8)):
                sc = scale[row, X >> gsh]
                acc[lane, r] += sc * f0 * (d[lane, 2 * r] - 8 * c0) + sc * f1 * (d[lane, 2 * r + 1] - 8 * c1)
    got = np.zeros(16)
    for lane in range(32):
        g = lane // 4
        got[g] += acc[lane, 0]
        got[g + 8] += acc[lane, 1]
    want = ((q - 8) * np.repeat(scale, group, axis=1)) @ x.astype(np.float64)
    assert np.abs(got - want).max() <= 1e-6 * np.abs(want).max()


def test_mma_layout_ok_takes_int4_g64_g128_in_whole_steps_only():
    from coli.container.format import RecordLayout
    from coli.gpu.cuda_backend import mma_layout_ok
    glm = RecordLayout.make(6144, 2048, "int4", 64, 512)
    assert mma_layout_ok(glm, 8) and mma_layout_ok(glm, 1)
    assert not mma_layout_ok(glm, 0) and not mma_layout_ok(glm, 9)              # 1 <= K <= 8 per launch
    assert mma_layout_ok(RecordLayout.make(6144, 2048, "int4", 128, 512), 8)
    for fmt, group in (("int4", 32), ("int8", 0), ("bf16", 0), ("f32", 0)):
        assert not mma_layout_ok(RecordLayout.make(6144, 2048, fmt, group, 512), 8), (fmt, group)
    assert not mma_layout_ok(RecordLayout.make(6144 + 64, 2048, "int4", 64, 512), 8)   # not whole 128-col steps
    assert not mma_layout_ok(RecordLayout.make(6144, 2048 + 64, "int4", 64, 512), 8)
    assert mma_layout_ok(RecordLayout.make(256, 128, "int4", 64, 512), 4)


class _FakeRuntime:
    """The attributes CudaBackend's version choice and CudaRuntime.allow_smem read (no GPU)."""

    def __init__(self, smem_optin=232448, static=0):
        self.smem_optin, self.static, self.sm_count = smem_optin, static, 132
        self._smem_set, self.set_calls = {}, []
        self.drv = type("drv", (), {"function_attribute": type("fa", (), {"MAX_DYNAMIC_SHARED_SIZE_BYTES": 8})})

    def _fn_attr(self, fn, name, default=0):
        return self.static if name == "SHARED_SIZE_BYTES" else default

    def module(self, name):
        return object()

    def empty(self, shape, dtype=np.float32):
        from coli.gpu.cuda_runtime import DeviceArray
        return DeviceArray(0, shape, dtype)


def _backend(rt, kernels="auto"):
    from coli.gpu.cuda_backend import CudaBackend
    gb = CudaBackend.__new__(CudaBackend)       # no PyCUDA: only the host-side choice is exercised
    gb.rt, gb.moe_kernels, gb._mma_usable, gb._scratch = rt, kernels, None, {}
    return gb


def test_moe_kernel_choice_on_the_host():
    from coli.container.format import RecordLayout
    from coli.gpu.cuda_backend import MMA_MIN_K
    glm = RecordLayout.make(6144, 2048, "int4", 64, 512)
    gb = _backend(_FakeRuntime())
    assert [gb._moe_version(glm, k) for k in range(1, 9)] == ["v2"] * (MMA_MIN_K - 1) + ["mma"] * (9 - MMA_MIN_K)
    assert gb._moe_version(glm, 1, "mma") == "mma" and gb._moe_version(glm, 8, "v2") == "v2"
    assert gb._moe_version(RecordLayout.make(6144, 2048, "int4", 32, 512), 8) == "v2"
    assert gb._moe_version(RecordLayout.make(6144, 2048, "int4", 256, 512), 8) == "v1"
    # a 99 KiB-per-block card: GLM-5's 2048-wide experts fit at K = 8, 3072-wide ones only on v2
    small = _backend(_FakeRuntime(smem_optin=101376))
    assert small._moe_version(glm, 8) == "mma"
    assert small._moe_version(RecordLayout.make(6144, 3072, "int4", 64, 512), 8) == "v2"
    assert small._moe_version(RecordLayout.make(6144, 3072, "int4", 64, 512), 4) == "mma"


def test_moe_kernel_choice_falls_back_when_the_module_does_not_compile():
    from coli.container.format import RecordLayout
    from coli.gpu.cuda_runtime import CudaError

    class NoMma(_FakeRuntime):
        def module(self, name):
            raise CudaError("compiling cuda/moe_mma.cu for sm_80 failed: ...")
    gb = _backend(NoMma())
    assert gb._moe_version(RecordLayout.make(6144, 2048, "int4", 64, 512), 8) == "v2"
    assert gb._mma_usable is False


@pytest.mark.parametrize("static,dynamic,raised", [(0, 48 * 1024, False), (96, 48 * 1024, True),
                                                   (96, 48 * 1024 - 96, False), (0, 48 * 1024 + 16, True)])
def test_allow_smem_raises_the_limit_when_static_plus_dynamic_passes_48k(static, dynamic, raised):
    """moe_down_int4 (v2) with 6 experts at GLM-5's width asks exactly 48 KiB of dynamic shared memory on top of
    ~100 bytes of static: without the raised limit its launch fails (found by the per-K benchmark)."""
    from coli.gpu.cuda_runtime import CudaRuntime
    rt = _FakeRuntime(static=static)

    class Fn:
        def set_attribute(self, attr, value):
            rt.set_calls.append((attr, value))
    assert CudaRuntime.allow_smem(rt, Fn(), dynamic)
    assert bool(rt.set_calls) == raised


def test_moe_scratch_is_kept_per_layout_k_and_version():
    """The fused decode's buffers are made once per (layout, K, version asked), not per layer and token (the
    decode step is host-bound); a different K or version gets its own, and the cache stays bounded."""
    from coli.container.format import RecordLayout
    glm = RecordLayout.make(6144, 2048, "int4", 64, 512)
    gb = _backend(_FakeRuntime())
    a = gb.moe_scratch(glm, 8)
    assert gb.moe_scratch(glm, 8) is a and a.version == "mma" and a.hq is not None
    assert gb.moe_scratch(glm, 7) is not a
    v2 = gb.moe_scratch(glm, 8, version="v2")
    assert v2 is not a and v2.version == "v2" and v2.hq is None
    gb.moe_kernels = "v2"
    assert gb.moe_scratch(glm, 8).version == "v2"
    for k in range(1, 9):
        for ver in ("v1", "v2", "mma", "auto"):
            for lay in (glm, RecordLayout.make(6144, 2048, "int4", 128, 512), RecordLayout.make(6144, 1024, "int4", 64, 512)):
                gb.moe_scratch(lay, k, version=ver)
    assert len(gb._scratch) <= 64
