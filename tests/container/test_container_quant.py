"""Quantisers: lossless formats exact, error bounds per format, the FP8 fast path, tile independence."""

from __future__ import annotations

import numpy as np
import pytest

from coli.container import quant as Q
from coli.container.format import MatrixLayout, RecordLayout
from coli.safetensors_io import E4M3_TABLE, bf16_to_f32, f32_to_bf16_bits

FP16_REL = 2.0 ** -11


def _w(rows=70, cols=300, seed=0, std=0.02):
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((rows, cols)) * std).astype(np.float32)
    w[3] *= 40.0          # an outlier row
    w[5, 7] = 0.9         # an outlier weight
    return w


def test_f32_is_exact_and_bf16_is_rounding():
    w = _w()
    d, m = Q.quantize(w, "f32")
    assert m.shape == (70, 0)
    assert np.array_equal(Q.dequantize(d, m, "f32", 0, 300), w)
    d, m = Q.quantize(w, "bf16")
    got = Q.dequantize(d, m, "bf16", 0, 300)
    assert np.array_equal(got, bf16_to_f32(f32_to_bf16_bits(w)))
    wb = bf16_to_f32(f32_to_bf16_bits(w))                      # bf16-representable input is lossless
    assert np.array_equal(Q.dequantize(*Q.quantize(wb, "bf16"), "bf16", 0, 300), wb)


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_error_bound(group):
    w = _w()
    d, m = Q.quantize(w, "int4", group)
    got = Q.dequantize(d, m, "int4", group, 300)
    ng = -(-300 // group)
    pad = np.zeros((70, ng * group), np.float32)
    pad[:, :300] = w
    amax = np.abs(pad.reshape(70, ng, group)).max(-1)
    bound = np.repeat(amax / 7 * (0.5 + 7 * FP16_REL) * 1.0001, group, axis=1)[:, :300] + 1e-12
    assert (np.abs(got - w) <= bound).all()
    nib = np.stack([d & 0xF, d >> 4], -1)
    assert nib.min() >= 1 and nib.max() <= 15                   # q + 8 with q in [-7, 7]


def test_int8_error_bound():
    w = _w()
    d, m = Q.quantize(w, "int8")
    got = Q.dequantize(d, m, "int8", 0, 300)
    scale = np.abs(w).max(1, keepdims=True) / 127
    assert (np.abs(got - w) <= scale * (0.5 + 127 * FP16_REL) * 1.0001).all()
    assert d.view(np.int8).min() >= -127


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int2_error_bound(group):
    w = _w()
    d, m = Q.quantize(w, "int2", group)
    got = Q.dequantize(d, m, "int2", group, 300)
    ng = -(-300 // group)
    s16 = m.view("<f2")[:, :ng].astype(np.float32)
    pad = np.pad(w, ((0, 0), (0, ng * group - 300)), mode="edge").reshape(70, ng, group)
    lo, hi = pad.min(-1), pad.max(-1)
    bound = 0.5 * s16 + 4 * FP16_REL * (np.abs(lo) + np.abs(hi)) + 1e-9
    assert (np.abs(got - w) <= np.repeat(bound, group, axis=1)[:, :300]).all()


def test_error_ordering_by_format_and_group():
    w = _w(256, 512, seed=3)
    rms = {}
    for fmt, g in (("int8", 0), ("int4", 32), ("int4", 64), ("int4", 128), ("int2", 64)):
        got = Q.dequantize(*Q.quantize(w, fmt, g or 64), fmt, g or 64, 512)
        rms[(fmt, g)] = float(np.sqrt(((got - w) ** 2).mean()))
    assert rms[("int8", 0)] < rms[("int4", 32)] < rms[("int4", 64)] < rms[("int4", 128)] < rms[("int2", 64)]


def test_zeros_and_constants_are_exact():
    z = np.zeros((4, 96), np.float32)
    for fmt in ("int4", "int8", "int2", "bf16", "f32"):
        assert np.array_equal(Q.dequantize(*Q.quantize(z, fmt, 32), fmt, 32, 96), z)
    c = np.full((2, 64), 0.25, np.float32)
    assert np.array_equal(Q.dequantize(*Q.quantize(c, "int2", 32), "int2", 32, 64), c)


@pytest.mark.parametrize("fmt", ["int4", "int8", "int2", "bf16", "f32"])
def test_nan_and_inf_are_refused(fmt):
    w = _w(8, 64)
    w[2, 3] = np.nan
    with pytest.raises(Q.QuantError, match="NaN"):
        Q.quantize(w, fmt, 32)
    w[2, 3] = np.inf
    with pytest.raises(Q.QuantError):
        Q.quantize(w, fmt, 32)


def test_scale_overflowing_fp16_is_refused():
    with pytest.raises(Q.QuantError, match="overflows fp16"):
        Q.quantize(np.full((1, 32), 1e6, np.float32), "int4", 32)


def _fp8(rows, cols, seed=0):
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 256, (rows, cols), dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x01
    si = (rng.uniform(0.5, 2, (-(-rows // 128), -(-cols // 128))) * 1e-4).astype(np.float32)
    return codes, si


@pytest.mark.parametrize("group", [32, 64, 128])
def test_fp8_fast_path_matches_generic(group):
    codes, si = _fp8(200, 320)                    # ragged blocks in rows (200) and columns (320)
    w = Q.fp8_to_float32(codes, si)
    d1, m1 = Q.quantize_fp8_int4(codes, si, group)
    d2, m2 = Q.quantize(w, "int4", group)
    assert np.array_equal(m1, m2)                  # identical fp16 scales
    q1 = np.stack([d1 & 0xF, d1 >> 4], -1).reshape(200, -1).astype(int)
    q2 = np.stack([d2 & 0xF, d2 >> 4], -1).reshape(200, -1).astype(int)
    diff = q1 != q2
    assert np.abs(q1 - q2).max() <= 1 and diff.mean() < 0.02     # only rounding ties may differ
    # where they differ, the exact value q = v * 7 / amax lies on a half step (a tie)
    mag = np.pad(codes & 0x7F, ((0, 0), (0, q1.shape[1] - 320))).reshape(200, -1, group).max(-1)
    amax = np.repeat(E4M3_TABLE[mag].astype(np.float64), group, 1)
    v = np.pad(E4M3_TABLE[codes].astype(np.float64), ((0, 0), (0, q1.shape[1] - 320)))
    exact = v * 7 / np.where(amax > 0, amax, 1)
    assert np.allclose(np.abs(exact[diff]) % 1, 0.5)
    got = Q.dequantize(d1, m1, "int4", group, 320)
    scale = np.repeat(m1.view("<f2").astype(np.float32), group, 1)[:, :320]
    assert (np.abs(got - w) <= scale * (0.5 + 8 * FP16_REL) + 1e-12).all()


def test_fp8_nan_code_is_refused():
    codes, si = _fp8(128, 128)
    codes[5, 5] = 0x7F
    with pytest.raises(Q.QuantError, match="NaN"):
        Q.quantize_fp8_int4(codes, si, 64)


# ---- tiles ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt,group", [("int4", 32), ("int4", 128), ("int8", 0), ("int2", 64), ("bf16", 0), ("f32", 0)])
def test_every_tile_decodes_alone(fmt, group):
    w = _w(203, 300, seed=4)                       # 203 rows: the last tile is short
    lay = MatrixLayout.make(203, 300, fmt, group or 64, tile_kb=4)
    assert lay.n_tiles > 3 and lay.rows % lay.rows_per_tile
    d, m = Q.quantize(w, fmt, group or 64)
    full = Q.dequantize(d, m, fmt, group or 64, 300)
    buf = Q.encode_matrix(lay, d, m)
    assert buf.nbytes == lay.nbytes
    assert np.array_equal(Q.decode_matrix(buf, lay), full)
    for t in range(lay.n_tiles):
        off, n, r0 = lay.tile(t)
        size = lay.meta_section(n) + lay.data_section(n)
        alone = buf[off:off + size].copy()         # nothing but the tile's own bytes
        shifted = MatrixLayout(n, 300, lay.fmt, lay.group, lay.rows_per_tile)
        assert np.array_equal(Q.decode_tile(alone, shifted, 0), full[r0:r0 + n])
        assert off % 16 == 0 and lay.meta_section(n) % 16 == 0


def test_tiles_packed_in_chunks_equal_whole():
    w = _w(203, 300, seed=5)
    lay = MatrixLayout.make(203, 300, "int4", 64, tile_kb=4)
    d, m = Q.quantize(w, "int4", 64)
    whole = Q.encode_matrix(lay, d, m)
    out = np.full(lay.nbytes, 0xAA, np.uint8)
    step = lay.rows_per_tile * 2
    for r0 in range(0, 203, step):
        r1 = min(203, r0 + step)
        start = lay.tile(r0 // lay.rows_per_tile)[0]
        Q.pack_tiles(lay, d[r0:r1], m[r0:r1], r0, out[start:])
    assert np.array_equal(out, whole)


def test_glm5_record_sizes_match_the_reference_budget():
    # reference §7: one expert at int4 g64 = 20,054,016 B, g32 = 21,233,664, int8 = 37,769,216
    assert RecordLayout.make(6144, 2048, "int4", 64, 512).nbytes == 20_054_016
    assert RecordLayout.make(6144, 2048, "int4", 32, 512).nbytes == 21_233_664
    assert RecordLayout.make(6144, 2048, "int8", 64, 512).nbytes == 37_769_216
    r = RecordLayout.make(6144, 2048, "int4", 64, 512)
    for lay in r.matrices:
        assert lay.offset % 4096 == 0 and 400_000 < lay.tile_bytes <= 512 * 1024 and lay.rows_per_tile % 16 == 0


@pytest.mark.parametrize("shape", [(2048, 512), (576, 256), (200, 320), (64, 256), (192, 160)])
def test_fp8_block_dequant_handles_ragged_edges(shape):
    from coli.weights import dequant_fp8_blocks
    codes, si = _fp8(*shape, seed=9)
    assert np.array_equal(Q.fp8_to_float32(codes, si), dequant_fp8_blocks(E4M3_TABLE[codes], si))
