"""Row-wise quantisation and dequantisation for the container formats (numpy, vectorised).

Every function works on whole rows: `quantize(w [R, C])` returns the rows' packed data `[R, row_data_bytes]` and
metadata `[R, row_meta_bytes]` (both uint8), exactly the per-row byte strings a tile stores (format.py). So any run
of rows — a tile — dequantises on its own.

Per row, with g = group and ng = ceil(C / g) (rows are padded to ng * g columns; padding is dropped on decode):

  int4  meta: ng fp16 scales.  data: ng*g/2 bytes, column 2j in the low nibble and 2j+1 in the high nibble of
        byte j, each stored as q + 8 with q in [-7, 7].  w = (nibble - 8) * scale, scale = amax(group) / 7.
  int8  meta: one fp16 scale.  data: C int8.  w = q * scale, scale = amax(row) / 127, q in [-127, 127].
  int2  meta: ng fp16 scales, then ng fp16 offsets.  data: ng*g/4 bytes, column 4j+k in bits 2k..2k+1 of byte j.
        w = q * scale + offset, q in [0, 3], offset = fp16(min(group)), scale = fp16((max - min) / 3).
  bf16  data: C bfloat16 (little-endian), round-to-nearest-even.  f32: data: C float32.

int4/int8 quantise with the exact scale (q = rint(w * 7 / amax)) and store the scale rounded to fp16, so the
error is at most (0.5 + 7 * 2^-11) * scale per weight. int2 quantises against its stored (rounded) offset and scale.
NaN or infinite weights, and scales that overflow fp16, are errors.

`quantize_fp8_int4` is the converter's fast path for float8_e4m3 sources with 128x128 block scales: a group of
g <= 128 inputs lies inside one scale block, so q depends only on the group's fp8 codes and a 256 x 128 lookup
table gives it directly (about 4x the generic path). It can differ from `quantize(dequantised)` by one step on
exact rounding ties; both meet the same error bound.
"""

from __future__ import annotations

import numpy as np

from coli.container.format import MatrixLayout
from coli.safetensors_io import E4M3_TABLE, bf16_to_f32, f32_to_bf16_bits

F32 = np.float32
_CHUNK_ELEMS = 1 << 18   # rows are processed in chunks of about this many weights, to stay in cache


class QuantError(ValueError):
    """The weights cannot be stored in the requested format (NaN/inf, or a scale beyond fp16)."""


def _layout(fmt: str, group: int, cols: int) -> MatrixLayout:
    return MatrixLayout(1, cols, fmt, group if fmt in ("int4", "int2") else 0, 1)


def _chunks(rows: int, cols: int):
    step = max(1, _CHUNK_ELEMS // max(cols, 1))
    for r0 in range(0, rows, step):
        yield r0, min(rows, r0 + step)


def _fp16_scales(x: np.ndarray, what: str) -> np.ndarray:
    if not np.isfinite(x).all():
        raise QuantError(f"{what}: the weights contain NaN or infinite values")
    with np.errstate(over="ignore"):
        s = x.astype(np.float16)
    if not np.isfinite(s).all():
        raise QuantError(f"{what}: a scale of {float(np.max(x)):.4g} overflows fp16 (weights too large for this format)")
    return s


def _pad_cols(w: np.ndarray, padded: int, mode: str) -> np.ndarray:
    if w.shape[1] == padded:
        return w
    return np.pad(w, ((0, 0), (0, padded - w.shape[1])), mode=mode)


# ---- generic quantisers (float32 input) ---------------------------------------------------------------
def quantize(w: np.ndarray, fmt: str, group: int = 64) -> tuple[np.ndarray, np.ndarray]:
    """w float32 [R, C] -> (data uint8 [R, row_data_bytes], meta uint8 [R, row_meta_bytes])."""
    w = np.asarray(w)
    if w.ndim != 2:
        raise ValueError(f"quantize expects a 2-D matrix, got shape {w.shape}")
    R, C = w.shape
    lay = _layout(fmt, group, C)
    data = np.empty((R, lay.row_data_bytes), np.uint8)
    meta = np.empty((R, lay.row_meta_bytes), np.uint8)
    fn = {"int4": _q_int4, "int8": _q_int8, "int2": _q_int2, "bf16": _q_bf16, "f32": _q_f32}[fmt]
    for r0, r1 in _chunks(R, C):
        fn(np.asarray(w[r0:r1], F32), lay, data[r0:r1], meta[r0:r1])
    return data, meta


def _q_int4(w, lay, data, meta):
    n, g, ng = w.shape[0], lay.group, lay.n_groups
    wg = _pad_cols(w, lay.padded_cols, "constant").reshape(n, ng, g)
    amax = np.abs(wg).max(axis=-1)                                         # [n, ng]
    meta.view("<f2")[:] = _fp16_scales(amax / F32(7), "int4")
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, F32(7) / amax, F32(0)).astype(F32)
    q = np.rint(wg * inv[..., None])
    np.clip(q, -7, 7, out=q)
    q = (q.astype(np.int8) + 8).view(np.uint8).reshape(n, -1)              # [n, Cp] in 1..15
    np.bitwise_or(q[:, 0::2], np.left_shift(q[:, 1::2], 4), out=data)


def _q_int8(w, lay, data, meta):
    amax = np.abs(w).max(axis=-1)                                          # [n]
    meta.view("<f2")[:, 0] = _fp16_scales(amax / F32(127), "int8")
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, F32(127) / amax, F32(0)).astype(F32)
    q = np.rint(w * inv[:, None])
    np.clip(q, -127, 127, out=q)
    data.view(np.int8)[:] = q.astype(np.int8)


def _q_int2(w, lay, data, meta):
    n, g, ng = w.shape[0], lay.group, lay.n_groups
    wg = _pad_cols(w, lay.padded_cols, "edge").reshape(n, ng, g)
    lo, hi = wg.min(axis=-1), wg.max(axis=-1)                              # [n, ng]
    m16 = meta.view("<f2")                                            # [n, 2*ng]
    m16[:, :ng] = _fp16_scales((hi - lo) / F32(3), "int2")
    m16[:, ng:] = _fp16_scales(lo, "int2")
    s, o = m16[:, :ng].astype(F32), m16[:, ng:].astype(F32)
    with np.errstate(divide="ignore", invalid="ignore"):
        inv = np.where(s > 0, F32(1) / s, F32(0)).astype(F32)
    q = np.rint((wg - o[..., None]) * inv[..., None])
    np.clip(q, 0, 3, out=q)
    q = q.astype(np.uint8).reshape(n, -1)
    data[:] = q[:, 0::4] | (q[:, 1::4] << 2) | (q[:, 2::4] << 4) | (q[:, 3::4] << 6)


def _q_bf16(w, lay, data, meta):
    if not np.isfinite(w).all():
        raise QuantError("bf16: the weights contain NaN or infinite values")
    data.view(np.uint16)[:] = f32_to_bf16_bits(w)


def _q_f32(w, lay, data, meta):
    if not np.isfinite(w).all():
        raise QuantError("f32: the weights contain NaN or infinite values")
    data.view(F32)[:] = w


# ---- float8_e4m3 fast path for int4 --------------------------------------------------------------------
def _int4_lut() -> np.ndarray:
    """LUT[a, v] = stored nibble (q + 8) of fp8 code v in a group whose largest magnitude code is a."""
    vals = np.nan_to_num(E4M3_TABLE).astype(F32)
    lut = np.full((128, 256), 8, np.uint8)
    for a in range(1, 127):
        q = np.rint(vals * F32(7.0 / float(E4M3_TABLE[a])))
        lut[a] = (np.clip(q, -7, 7) + 8).astype(np.uint8)
    return lut


_INT4_LUT = _int4_lut()
_PAIR_LUT: np.ndarray | None = None


def _pair_lut() -> np.ndarray:
    """PAIR[a << 16 | c1 << 8 | c0] = the packed int4 byte of the code pair (c0, c1) (c0 = the even column, the
    low byte of a little-endian uint16 view) in a group with magnitude max a. 8 MiB, built on first use."""
    global _PAIR_LUT
    if _PAIR_LUT is None:
        t = np.empty((128, 256, 256), np.uint8)
        for a in range(128):
            t[a] = _INT4_LUT[a][None, :] | (_INT4_LUT[a][:, None] << 4)
        _PAIR_LUT = t.reshape(-1)
    return _PAIR_LUT


def quantize_fp8_int4(codes: np.ndarray, scale_inv: np.ndarray, group: int = 64,
                      block: int = 128) -> tuple[np.ndarray, np.ndarray]:
    """int4 from float8_e4m3 codes [R, C] (uint8) with block scales scale_inv [ceil(R/b), ceil(C/b)]
    (W = fp8 * scale_inv, reference §5.2), without widening to float32. R need not be a multiple of b but the
    rows must start at a block boundary.

    Per row chunk: the group's largest magnitude code a (one uint8 max), then one table lookup per *pair* of
    codes indexed by (a, c0, c1) that yields the packed byte directly."""
    if block % group:
        raise ValueError(f"group {group} must divide the fp8 block size {block}")
    R, C = codes.shape
    lay = _layout("int4", group, C)
    ng, g, Cp = lay.n_groups, group, lay.padded_cols
    if scale_inv.shape != (-(-R // block), -(-C // block)):
        raise ValueError(f"weight_scale_inv has shape {tuple(scale_inv.shape)}, expected "
                         f"({-(-R // block)}, {-(-C // block)}) for a [{R}, {C}] weight in {block}x{block} blocks")
    pair = _pair_lut()
    data = np.empty((R, lay.row_data_bytes), np.uint8)
    amax_all = np.empty((R, ng), np.uint8)
    step = max(1, (1 << 17) // Cp)
    for r0 in range(0, R, step):
        r1 = min(R, r0 + step)
        c = np.ascontiguousarray(codes[r0:r1])
        if Cp != C:
            c = np.pad(c, ((0, 0), (0, Cp - C)))
        n = r1 - r0
        # 2-D shapes throughout: numpy iterates [groups, g] much faster than [rows, groups, g]
        amax = np.bitwise_and(c, 0x7F).reshape(n * ng, g).max(axis=1)     # [n*ng] magnitude codes
        amax_all[r0:r1] = amax.reshape(n, ng)
        idx = np.left_shift(amax.astype(np.uint32), 16)[:, None] | c.view("<u2").reshape(n * ng, g // 2)
        pair.take(idx, out=data[r0:r1].reshape(n * ng, g // 2), mode="wrap")  # indices are in range; wrap is fastest
    if (amax_all == 0x7F).any():
        raise QuantError("int4: the fp8 weights contain NaN codes")
    # scale = amax / 7 with amax = fp8(a) * block scale, computed in float32 as the generic path does.
    bs = np.repeat(np.asarray(scale_inv, F32), block, axis=0)[:R]                       # [R, Cb]
    bs = np.repeat(bs, block // group, axis=1)[:, :ng]                                  # [R, ng]
    amax_f = E4M3_TABLE[amax_all] * bs
    meta = np.ascontiguousarray(_fp16_scales(amax_f / F32(7), "int4")).view(np.uint8).reshape(R, 2 * ng)
    return data, meta


def fp8_to_float32(codes: np.ndarray, scale_inv: np.ndarray, block: int = 128) -> np.ndarray:
    """Block-dequantise float8_e4m3 codes [R, C] (rows starting at a block boundary); ragged edges allowed."""
    R, C = codes.shape
    gr, gc = -(-R // block), -(-C // block)
    if scale_inv.shape != (gr, gc):
        raise ValueError(f"weight_scale_inv has shape {tuple(scale_inv.shape)}, expected ({gr}, {gc}) for a "
                         f"[{R}, {C}] weight in {block}x{block} blocks")
    w = E4M3_TABLE[codes]
    s = np.asarray(scale_inv, F32)
    if C % block == 0:   # whole block columns: broadcast over a [rows/b, b, cols/b, b] view, no temporary
        rb = R // block
        if rb:
            w[:rb * block].reshape(rb, block, gc, block)[...] *= s[:rb, None, :, None]
        if R % block:
            w[rb * block:].reshape(R - rb * block, gc, block)[...] *= s[rb, None, :, None]
    else:
        s_rows = np.repeat(s, block, axis=0)[:R]                                        # [R, gc]
        for j in range(gc):
            w[:, j * block:(j + 1) * block] *= s_rows[:, j:j + 1]
    return w


# ---- dequantisation -------------------------------------------------------------------------------------
def _int4_pairs() -> np.ndarray:
    b = np.arange(256)
    return np.stack([(b & 0xF) - 8, (b >> 4) - 8], axis=1).astype(F32)   # [256, 2]


def _int2_quads() -> np.ndarray:
    b = np.arange(256)
    return np.stack([(b >> s) & 3 for s in (0, 2, 4, 6)], axis=1).astype(F32)  # [256, 4]


_INT4_PAIRS, _INT2_QUADS = _int4_pairs(), _int2_quads()


def dequantize(data: np.ndarray, meta: np.ndarray, fmt: str, group: int, cols: int,
               out: np.ndarray | None = None) -> np.ndarray:
    """Inverse of `quantize` for any run of rows: data [n, row_data_bytes], meta [n, row_meta_bytes] -> [n, cols]."""
    lay = _layout(fmt, group, cols)
    n = data.shape[0]
    if data.shape != (n, lay.row_data_bytes) or meta.shape != (n, lay.row_meta_bytes):
        raise ValueError(f"{fmt}: data {data.shape} / meta {meta.shape} do not hold rows of {cols} columns "
                         f"(expected ({n}, {lay.row_data_bytes}) / ({n}, {lay.row_meta_bytes}))")
    if out is None:
        out = np.empty((n, cols), F32)
    if fmt == "f32":
        out[:] = data.view("<f4")
    elif fmt == "bf16":
        out[:] = bf16_to_f32(data.view("<u2"))
    elif fmt == "int8":
        np.multiply(data.view(np.int8), meta.view("<f2").astype(F32), out=out, casting="unsafe")
    elif fmt == "int4":
        ng, g = lay.n_groups, lay.group
        s = meta.view("<f2").astype(F32)                                   # [n, ng]
        for r0, r1 in _chunks(n, lay.padded_cols):
            q = _INT4_PAIRS[data[r0:r1]].reshape(r1 - r0, ng, g)
            q *= s[r0:r1, :, None]
            out[r0:r1] = q.reshape(r1 - r0, -1)[:, :cols]
    elif fmt == "int2":
        ng, g = lay.n_groups, lay.group
        m = meta.view("<f2").astype(F32)
        s, o = m[:, :ng], m[:, ng:]
        for r0, r1 in _chunks(n, lay.padded_cols):
            q = _INT2_QUADS[data[r0:r1]].reshape(r1 - r0, ng, g)
            q *= s[r0:r1, :, None]
            q += o[r0:r1, :, None]
            out[r0:r1] = q.reshape(r1 - r0, -1)[:, :cols]
    else:
        raise ValueError(f"unknown format {fmt!r}")
    return out


# ---- tiles ------------------------------------------------------------------------------------------------
def pack_tiles(lay: MatrixLayout, data: np.ndarray, meta: np.ndarray, first_row: int, out: np.ndarray) -> None:
    """Write rows first_row.. (a tile boundary) of a quantised matrix into `out`, the byte range of their tiles.
    Padding bytes are written as zeros."""
    r = lay.rows_per_tile
    n = data.shape[0]
    if first_row % r:
        raise ValueError(f"rows must start at a tile boundary (row {first_row}, {r} rows per tile)")
    if first_row + n < lay.rows and n % r:
        raise ValueError("a chunk that does not reach the matrix end must hold whole tiles")
    full = n // r   # uniform tiles; a shorter last tile follows only at the matrix end
    ms = lay.meta_section(r)
    if full:
        tiles = out[:full * lay.tile_bytes].reshape(full, lay.tile_bytes)
        mrow, drow = r * lay.row_meta_bytes, r * lay.row_data_bytes
        tiles[:, :mrow] = meta[:full * r].reshape(full, mrow)
        tiles[:, mrow:ms] = 0
        tiles[:, ms:ms + drow] = data[:full * r].reshape(full, drow)
        tiles[:, ms + drow:] = 0
    rest = n - full * r
    if rest:
        off = full * lay.tile_bytes
        mb, db = rest * lay.row_meta_bytes, rest * lay.row_data_bytes
        m2, d2 = lay.meta_section(rest), lay.data_section(rest)
        seg = out[off:off + m2 + d2]
        seg[:mb] = meta[full * r:].reshape(-1)
        seg[mb:m2] = 0
        seg[m2:m2 + db] = data[full * r:].reshape(-1)
        seg[m2 + db:] = 0


def encode_matrix(lay: MatrixLayout, data: np.ndarray, meta: np.ndarray) -> np.ndarray:
    """All tiles of a quantised matrix as one uint8 array of lay.nbytes."""
    out = np.empty(lay.nbytes, np.uint8)
    pack_tiles(lay, data, meta, 0, out)
    return out


def decode_tile(buf: np.ndarray, lay: MatrixLayout, t: int) -> np.ndarray:
    """Dequantise tile t alone. buf: the matrix's bytes (starting at the matrix start) or at least through the tile.
    Returns float32 [rows in tile, cols]."""
    off, n, _ = lay.tile(t)
    ms = lay.meta_section(n)
    meta = buf[off:off + n * lay.row_meta_bytes].reshape(n, lay.row_meta_bytes)
    data = buf[off + ms:off + ms + n * lay.row_data_bytes].reshape(n, lay.row_data_bytes)
    return dequantize(data, meta, lay.fmt, lay.group, lay.cols)


def decode_matrix(buf: np.ndarray, lay: MatrixLayout) -> np.ndarray:
    """Dequantise a whole matrix from its bytes (buf starts at the matrix start). float32 [rows, cols].

    Lossless f32 stored as plain row-major data comes back as a zero-copy view of `buf` (read-only if buf
    is): the executor computes straight from the RAM tier's shared-memory slot, no copy out of it."""
    if buf.shape[0] < lay.nbytes:
        raise ValueError(f"buffer of {buf.shape[0]} bytes is shorter than the matrix ({lay.nbytes} bytes)")
    if lay.fmt == "f32" and lay.contiguous:
        return buf[:lay.rows * lay.cols * 4].view("<f4").reshape(lay.rows, lay.cols)
    out = np.empty((lay.rows, lay.cols), F32)
    r, T = lay.rows_per_tile, lay.n_tiles
    full = T if lay.rows % r == 0 else T - 1
    if full:
        tiles = buf[:full * lay.tile_bytes].reshape(full, lay.tile_bytes)
        ms = lay.meta_section(r)
        meta = tiles[:, :r * lay.row_meta_bytes].reshape(full * r, lay.row_meta_bytes)
        data = tiles[:, ms:ms + r * lay.row_data_bytes].reshape(full * r, lay.row_data_bytes)
        dequantize(data, meta, lay.fmt, lay.group, lay.cols, out=out[:full * r])
    if full < T:
        out[full * r:] = decode_tile(buf, lay, T - 1)
    return out
