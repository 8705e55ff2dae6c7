"""The host side of the prefill indexer scores (cuda/indexer.cu indexer_scores_rows, coli/gpu/indexer_rows.py), on a
recording stand-in runtime (no GPU): which scores kernel indexer_select launches under each COLI_INDEXER_KERNELS
value, shape and shared-memory limit, its grid and shared memory, the argument count against SIGNATURES (which
tests/test_kernels_compile.py checks against the C source), and that the grid covers every row and key tile once.
The kernel's bits against indexer_scores' are checked on a GPU (tests/gpu/test_gpu_indexer_rows.py)."""

from __future__ import annotations

import re

import numpy as np
import pytest

from coli.gpu import indexer_rows as IR
from coli.gpu.cuda_runtime import kernels_dir
from recording_runtime import RecordingRuntime

SM86_OPTIN = 101376     # sm_86 / sm_89 / sm_120: 99 KiB of shared memory a block


class _Runtime(RecordingRuntime):
    def record(self, name, argtypes, grid, block, args, smem):
        self.launches.append((name, tuple(grid), block, smem, args))


def _backend(version="auto", optin=RecordingRuntime.smem_optin):
    from coli.gpu.cuda_backend import CudaBackend
    gb = CudaBackend.__new__(CudaBackend)
    gb.rt, gb.busy, gb.step = _Runtime(), None, None
    gb.rt.smem_optin = optin
    gb.indexer_kernels = version
    return gb


def _select(gb, S, T, ih=32, ihd=128, topk=2048):
    iq, kidx, hw = gb.rt.empty((S, ih, ihd)), gb.rt.empty((T, ihd)), gb.rt.empty((S, ih))
    return gb.indexer_select(iq, kidx, hw, np.arange(T - S, T), topk)


def test_the_host_constants_are_the_kernels():
    src = (kernels_dir() / "indexer.cu").read_text()
    defs = {k: int(v) for k, v in re.findall(r"#define (IDXR_ROWS|IDXR_WARPS|IDXR_KPW) (\d+)", src)}
    assert defs == {"IDXR_ROWS": IR.ROWS, "IDXR_WARPS": IR.WARPS, "IDXR_KPW": IR.KEYS_PER_WARP}
    assert "#define IDXR_TILE (IDXR_WARPS * IDXR_KPW)" in src and IR.TILE == IR.WARPS * IR.KEYS_PER_WARP


def test_glm5_shape_fits_the_smallest_target_block():
    assert IR.smem_bytes(32, 128) == 98304 <= SM86_OPTIN


@pytest.mark.parametrize("version", ["auto", "rows"])
def test_a_glm5_prefill_takes_the_rows_kernel(version):
    gb = _backend(version)
    S = T = 8192
    mask = _select(gb, S, T)
    (sc, grid, block, smem, args), (tk, *_) = gb.rt.launches
    assert (sc, tk) == ("indexer_scores_rows", "topk_select")
    assert grid == (2, 2048) and block == IR.THREADS and smem == IR.smem_bytes(32, 128)
    assert args[5:8] == (0, S, T) and args[11] == 64             # start, rows, keys; half the tiles a block
    assert (mask.S, mask.T, mask.kmax) == (S, T, 2048)


def test_v1_and_the_shapes_it_does_not_take_launch_indexer_scores():
    for gb, kw in ((_backend("v1"), {}), (_backend(), {"ih": 64}), (_backend(), {"ihd": 30}),
                   (_backend(optin=65536), {})):
        _select(gb, 300, 2500, **kw)
        names = [x[0] for x in gb.rt.launches]
        assert names == ["indexer_scores", "topk_select"], (kw, names)
        assert gb.rt.launches[0][1] == (-(-2500 // 64), 300)


def test_one_row_keeps_indexer_scores():
    """An eager decode step (S = 1): a block of 4 rows would compute 3 for nothing."""
    gb = _backend()
    _select(gb, 1, 3000)
    assert [x[0] for x in gb.rt.launches] == ["indexer_scores", "topk_select"]


def test_the_small_odd_shape_and_the_sm86_limit_take_the_rows_kernel():
    gb = _backend(optin=SM86_OPTIN)
    _select(gb, 301, 2500)
    gb2 = _backend()
    _select(gb2, 10, 200, ih=8, ihd=32, topk=150)
    for g in (gb, gb2):
        assert [x[0] for x in g.rt.launches] == ["indexer_scores_rows", "topk_select"]
    assert gb.rt.launches[0][1][1] == 76                           # ceil(301 / 4) row groups


def test_row_chunks_each_get_their_start(monkeypatch):
    import coli.gpu.cuda_backend as cb
    monkeypatch.setattr(cb, "INDEXER_CHUNK_BYTES", 4 * 2500 * 100)   # 100 rows of scores a chunk
    gb = _backend()
    _select(gb, 300, 2500)
    scores = [x for x in gb.rt.launches if x[0] == "indexer_scores_rows"]
    assert [x[4][5] for x in scores] == [2200, 2300, 2400] and all(x[4][6] == 100 for x in scores)


@pytest.mark.parametrize("S,T", [(1, 30000), (2, 5), (6, 3000), (300, 2500), (301, 2500), (8192, 8192),
                                 (2560, 2560), (64, 100000)])
@pytest.mark.parametrize("sms", [132, 28])
@pytest.mark.parametrize("topk", [0, 2048])
def test_the_grid_covers_every_row_and_tile_once(S, T, sms, topk):
    start = T - S
    per_block, (runs, groups) = IR.rows_grid(S, T, sms, start, topk)
    tiles = -(-T // IR.TILE)
    assert groups * IR.ROWS >= S > (groups - 1) * IR.ROWS
    assert runs * per_block >= tiles > (runs - 1) * per_block       # no run empty, none missing
    first = max(0, topk - start)                                    # rows before it need no scores
    working = max(1, groups - first // IR.ROWS)                   # (none: indexer_select launches nothing)
    # the working blocks reach half the wanted count (whole tiles), unless runs would get shorter than MIN_RUN_TILES
    assert 2 * runs * working >= min(tiles * working, IR.BLOCKS_PER_SM * sms) or per_block >= IR.MIN_RUN_TILES
    # runs shorter than MIN_RUN_TILES only where longer ones would leave the device under 2 blocks an SM
    assert per_block >= min(IR.MIN_RUN_TILES, tiles) or working * tiles // IR.MIN_RUN_TILES < 2 * sms
    if working >= IR.BLOCKS_PER_SM * sms:
        assert runs == 1                     # rows enough: a block takes every tile of its rows (q staged once)


def test_a_prompt_just_past_topk_splits_its_keys():
    """S = T = 2,560 at top-2,048: 128 of the 640 row groups score; alone they would leave 4 warps an SM. A chunk of
    a 30,000-token prompt (2,236 rows): 559 groups alone would be ~2 waves of near-equal blocks, the last one leaving
    most SMs idle; 4 runs of 118 tiles make ~8."""
    per_block, grid = IR.rows_grid(2560, 2560, 132, 0, 2048)
    assert grid == (10, 640) and per_block == IR.MIN_RUN_TILES
    assert IR.rows_grid(2236, 30000, 132, 30000 - 2236, 2048) == (118, (4, 559))


def test_scored_pairs_count_the_rows_past_topk():
    S, start, T, topk = 50, 30, 80, 40
    n = np.minimum(start + np.arange(S) + 1, T)
    assert IR.scored_pairs(S, start, T, topk) == int(n[n > topk].sum())


def test_the_setting_must_name_a_version():
    from coli.errors import ColiError
    from coli.gpu.cuda_backend import INDEXER_VERSIONS, kernel_choice
    assert kernel_choice("COLI_INDEXER_KERNELS", "rows", INDEXER_VERSIONS) == "rows"
    with pytest.raises(ColiError, match=r"COLI_INDEXER_KERNELS='tiled' is not a kernel version: use one of auto, "
                                        r"rows, v1"):
        kernel_choice("COLI_INDEXER_KERNELS", "tiled", INDEXER_VERSIONS)


def _warp_sum(v):
    """coli_common.cuh warp_sum on [32 lanes, n] fp32 values: the xor butterfly, every lane's own + partner's."""
    for o in (16, 8, 4, 2, 1):
        v = (v + v[np.arange(32) ^ o]).astype(np.float32)
    return v


def _reduce_scatter(v):
    """indexer_scores_rows' head sum (idxr_scatter_step over lane bits 16 .. 1) on [32 lanes, 64] fp32 values: keep
    the half lane bit o selects, add lane ^ o's copy of it. -> [32 lanes, 2]."""
    lanes, m = np.arange(32), v.shape[1]
    for o in (16, 8, 4, 2, 1):
        half, up = m // 2, ((lanes & o) != 0)[:, None]
        send = np.where(up, v[:, :half], v[:, half:m])
        keep = np.where(up, v[:, half:m], v[:, :half])
        v = np.concatenate([(keep + send[lanes ^ o]).astype(np.float32), v[:, half:]], axis=1)
        m = half
    return v[:, :2]


def test_the_head_sums_reduce_scatter_adds_warp_sums_pairs():
    """The kernel's scores are indexer_scores' bits only if its head sum adds the same pairs in the same tree as
    warp_sum: emulated step by step in fp32 over values of mixed magnitudes, signed zeros and idle lanes' +0, each of
    a thread's 64 sums equals warp_sum's bit for bit, on lane x / 2 (x = row * IDXR_KPW + key), slot x % 2 -- where
    the kernel writes it."""
    rng = np.random.default_rng(3)
    assert IR.ROWS * IR.KEYS_PER_WARP == 64
    for _ in range(50):
        v = (rng.standard_normal((32, 64)) * np.exp2(rng.integers(-30, 30, (32, 64)))).astype(np.float32)
        v[rng.random((32, 64)) < 0.2] = 0.0
        v[rng.random((32, 64)) < 0.1] = -0.0
        v[24:] = 0.0                                         # ih = 24: idle lanes add +0
        want = _warp_sum(v)
        assert (want.view(np.uint32) == want[0].view(np.uint32)).all()     # every lane ends with the same sum
        got = _reduce_scatter(v)
        x = np.arange(64)
        assert (got[x // 2, x % 2].view(np.uint32) == want[0].view(np.uint32)).all()
