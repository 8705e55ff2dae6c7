"""gemv2_<fmt>'s work split (cuda/gemv.cu), transliterated: a block's 8 warps are P = 8 / ks work items (RP rows
each: GEMV2_RP, a pair; the kernel's code takes any, and 4 and 8 are checked too) x ks column segments, blocks walk
groups of P items; every (row, chunk) of the matrix is read by exactly one warp, and the
host's choice of ks (cuda_backend.gemv2_split) and of the kernel (gemv2_fits). The kernel itself is checked
against numpy on a GPU (tests/gpu/test_gpu_linear.py)."""

from __future__ import annotations

import re

import numpy as np
import pytest

from coli.gpu.cuda_backend import GEMV2_ROWS, GEMV2_WARPS, gemv2_fits, gemv2_split
from coli.gpu.cuda_runtime import kernels_dir


def visits(nitems: int, nchunks: int, ks: int, grid: int):
    """gemv2_core's walk (cuda/gemv.cu, transliterated): block b's warp (pp, seg) takes item g * P + pp of every
    group g = b, b + grid, ... and column segment seg. -> (item, segment, first chunk, end chunk) per visit."""
    P = GEMV2_WARPS // ks
    cps = -(-nchunks // ks)
    ngroups = -(-nitems // P)
    for b in range(grid):
        for warp in range(GEMV2_WARPS):
            pp, seg = divmod(warp, ks)
            c_lo = min(nchunks, seg * cps)
            c_hi = min(nchunks, c_lo + cps)
            for g in range(b, ngroups, grid):
                p = g * P + pp
                if p < nitems:
                    yield p, seg, c_lo, c_hi


def coverage(N: int, nchunks: int, ks: int, grid: int, rp: int = 2) -> tuple[np.ndarray, np.ndarray]:
    """How many times gemv2_body's warps read each (row, chunk) -> int [N, nchunks], with items of rp rows (rows past
    the end clamped to the last: loaded, not stored); and how many times each row is written -> int [N]."""
    seen, writes = np.zeros((N, nchunks), int), np.zeros(N, int)
    for p, seg, c_lo, c_hi in visits(-(-N // rp), nchunks, ks, grid):
        for r in {min(rp * p + i, N - 1) for i in range(rp)}:     # a clamped row is loaded again, computed once
            seen[r, c_lo:c_hi] += 1
        if seg == 0:
            for i in range(rp):
                if rp * p + i < N:                              # has(p, i)
                    writes[rp * p + i] += 1
    return seen, writes


@pytest.mark.parametrize("N,nchunks,grid", [(256, 1536, 132), (2048, 192, 132), (576, 384, 50), (7, 40, 3),
                                            (1, 5, 1), (33, 300, 200)])
@pytest.mark.parametrize("ks", [1, 2, 4, 8])
@pytest.mark.parametrize("rp", [2, 4, 8])
def test_every_row_chunk_is_read_once(N, nchunks, grid, ks, rp):
    seen, writes = coverage(N, nchunks, ks, grid, rp)
    assert (seen == 1).all() and (writes == 1).all()


def test_split_choice_at_glm5_shapes():
    """The choices the H200's forced-ks sweep measured best (gemv2_split's docstring), on its 264 resident blocks."""
    blocks = 264
    assert gemv2_split(256, 6144 * 4 // 16, blocks) == 8          # router, f32
    assert gemv2_split(2048, 6144 // 2 // 16, blocks) == 2        # q_a, int4
    assert gemv2_split(576, 6144 // 16, blocks) == 4              # kv_a, int8
    assert gemv2_split(6144, 16384 // 2 // 16, blocks) == 2       # o_proj int4: 384 groups at ks 1 = 1.45 rounds
    assert gemv2_split(6144, 16384 // 16, blocks) == 2            # o_proj int8
    assert gemv2_split(16384, 2048 // 2 // 16, blocks) == 1       # q_b int4: 64 chunks, no room to split
    assert gemv2_split(2048 + 576 + 128, 6144 // 16, blocks) == 1  # q_a | kv_a | wk in one gemv2x launch, int8
    assert gemv2_split(2048 + 576 + 128, 6144 // 2 // 16, blocks) == 1
    assert gemv2_split(16384 + 4096, 2048 // 16, blocks) == 1     # q_b | wq_b, int8: a tie -> the smaller ks
    assert gemv2_split(256, 512 // 16, 4) == 1                    # MLA's o per head: 64 heads share the blocks
    for N, nc in [(256, 1536), (2048, 192), (5, 64), (100, 1)]:
        ks = gemv2_split(N, nc, blocks)
        assert ks in (1, 2, 4, 8) and (ks == 1 or nc // ks >= 64)   # >= 2 chunks per lane per segment


def test_gemv2_fits_needs_aligned_x_and_a_shift_group():
    assert gemv2_fits("int4", 64, 4096, 0) and gemv2_fits("f32", 0, 4096, 512)
    assert not gemv2_fits("int4", 96, 4096, 0)            # group by a shift only
    assert not gemv2_fits("f32", 0, 4100, 0) and not gemv2_fits("f32", 0, 4096, 6)


def test_warps_and_rows_constants_are_the_kernels():
    src = (kernels_dir() / "gemv.cu").read_text()
    assert int(re.search(r"#define GEMV2_WARPS (\d+)", src).group(1)) == GEMV2_WARPS
    assert int(re.search(r"#define GEMV2_RP (\d+)", src).group(1)) == GEMV2_ROWS


def coverage_many(rows: list[int], nchunks: int, ks: int, grid: int, rp: int = 2) -> tuple[list, list]:
    """gemv2x_<fmt>'s item numbering (Gemv2Many in gemv.cu, transliterated): items of rp rows matrix after matrix,
    pend the running sum of ceil(rows / rp); which(p) the first matrix whose running sum exceeds p. -> per matrix,
    int [rows, nchunks]: how many times each (row, chunk) is read; and the writes per row."""
    pend = np.cumsum([-(-r // rp) for r in rows]).tolist()
    seen = [np.zeros((r, nchunks), int) for r in rows]
    writes = [np.zeros(r, int) for r in rows]

    def which(p):
        m = 0
        while m + 1 < len(rows) and p >= pend[m]:
            m += 1
        return m, p - (pend[m - 1] if m else 0)

    for p, seg, c_lo, c_hi in visits(pend[-1], nchunks, ks, grid):
        m, lp = which(p)
        for r in {min(rp * lp + i, rows[m] - 1) for i in range(rp)}:
            seen[m][r, c_lo:c_hi] += 1
        if seg == 0:                                           # the segment-0 warp writes the item's rows
            for i in range(rp):
                if rp * lp + i < rows[m]:
                    writes[m][rp * lp + i] += 1
    return seen, writes


@pytest.mark.parametrize("rows,nchunks,grid", [([2048, 576, 128], 384, 264), ([16384, 4096], 128, 264),
                                               ([7, 1, 33, 2], 4, 3), ([1, 1], 1, 1), ([5, 9], 25, 200)])
@pytest.mark.parametrize("ks", [1, 2, 4, 8])
@pytest.mark.parametrize("rp", [2, 4, 8])
def test_gemv2x_reads_every_row_chunk_of_every_matrix_once(rows, nchunks, grid, ks, rp):
    seen, writes = coverage_many(rows, nchunks, ks, grid, rp)
    for s, w in zip(seen, writes):
        assert (s == 1).all() and (w == 1).all()


def test_gemv2x_limit_is_the_kernels():
    from coli.gpu.cuda_backend import GEMV2X_MAX
    src = (kernels_dir() / "gemv.cu").read_text()
    assert int(re.search(r"#define GEMV2X_MAX (\d+)", src).group(1)) == GEMV2X_MAX


def test_gemv_rows_plan_fits_the_shared_memory_and_spreads_the_rows():
    from coli.gpu.cuda_backend import GEMV2R_MAX, gemv_rows_plan
    optin = 227 * 1024
    assert gemv_rows_plan(4, 8 * 1024, optin) == [(0, 4)]                    # K = 2048 fp32 rows: 4 fit
    assert gemv_rows_plan(8, 8 * 1024, optin) == [(0, 4), (4, 4)]
    assert gemv_rows_plan(5, 8 * 1024, optin) == [(0, 3), (3, 2)]            # evenly, not 4 + 1
    assert gemv_rows_plan(4, 64 * 1024, optin) == [(0, 2), (2, 2)]           # K = 16384: 3 fit -> 2 + 2
    assert gemv_rows_plan(6, 64 * 1024, optin) == [(0, 3), (3, 3)]
    assert gemv_rows_plan(3, 120 * 1024, optin) == []                        # one row at a time: the GEMM instead
    assert gemv_rows_plan(1, 8 * 1024, optin) == []
    for S in range(2, 17):
        plan = gemv_rows_plan(S, 24 * 1024, optin)
        assert sum(n for _, n in plan) == S and all(2 <= n <= GEMV2R_MAX or S < 2 for _, n in plan)
        assert [r for r, _ in plan] == [sum(n for _, n in plan[:i]) for i in range(len(plan))]
