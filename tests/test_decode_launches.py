"""The CUDA backend's host side of the decode attention and GEMV launches, on a recording stand-in runtime (no GPU):
which kernels a one-token mla_attend / linear launches under each version setting, their grids, and that every
launch passes exactly as many arguments as the kernel's signature in SIGNATURES (which tests/test_kernels_compile.py
checks against the C source) -- so a host-side slip fails here, not first on the GPU machine."""

from __future__ import annotations

import numpy as np
import pytest

from coli.container.format import MatrixLayout
from coli.gpu.cuda_runtime import DeviceArray
from recording_runtime import RecordingRuntime


class _RecordingRuntime(RecordingRuntime):
    """Records each launch's grid, block and shared memory, after checking every argument is a plain number."""

    def record(self, name, argtypes, grid, block, args, smem):
        for a, t in zip(args, argtypes):
            assert isinstance(a, (int, np.integer, np.floating, float)), (name, a)
            if t in "Piq":
                assert isinstance(a, (int, np.integer)), f"{name}: {a!r} for {t}"
        self.launches.append((name, tuple(grid), block, smem))


def _backend(attn="auto", gemv="v2"):
    from coli.gpu.cuda_backend import CudaBackend
    gb = CudaBackend.__new__(CudaBackend)
    gb.rt, gb.busy = _RecordingRuntime(), None
    gb.attn_kernels, gb.attn_chunk, gb.gemv_kernels, gb.gemv_ks = attn, None, gemv, None
    gb.step = None                      # not inside a captured decode step (coli/gpu/graphs.py)
    gb.prefill_kernels, gb._pf_usable = "mma", True    # S > 1: int4 on the tensor cores (no module to compile here)
    gb.prefill_int8 = True                              # COLI_PREFILL_INT8's default (pf_linear_int8)
    return gb


def _weight(gb, rows, cols, fmt, group=64):
    from coli.gpu.cuda_weights import QWeight
    lay = MatrixLayout.make(rows, cols, fmt, group, 512)
    return QWeight(gb.rt.empty((lay.nbytes,), np.uint8).ptr, lay, (rows, cols))


@pytest.mark.parametrize("attn,want", [
    ("auto", ["mla_qabs_int8", "mla_attend_tile3", "mla_attend_combine_onepass", "mla_o_int8"]),
    ("tile2", ["mla_qabs_int8", "mla_attend_tile2", "mla_attend_combine4", "mla_o_int8"]),
    ("tile1", ["mla_qabs_int8", "mla_attend_tile1", "mla_attend_combine4", "mla_o_int8"]),
    ("tile3", ["mla_qabs_int8", "mla_attend_tile3", "mla_attend_combine_onepass", "mla_o_int8"]),
    ("split2", ["gemv_t_int8", "mla_attend_part_16", "mla_attend_combine", "gemv2_int8"]),
    ("split1", ["gemv_t_int8", "mla_attend_part1_16", "mla_attend_combine", "gemv2_int8"]),
    ("v1", ["gemm_nn_int8", "mla_attend_16", "gemm_nt_int8"]),
])
@pytest.mark.parametrize("masking", ["dense", "topk"])
def test_glm5_decode_attention_launches(attn, want, masking):
    from coli.gpu.cuda_backend import DeviceMask
    from coli.gpu.cuda_weights import HeadView
    gb = _backend(attn)
    nh, dn, dr, dv, L, T = 64, 192, 64, 256, 512, 2048
    kvb = _weight(gb, nh * (dn + dv), L, "int8")
    w_kb, w_vb = HeadView(kvb, 0, dn + dv, dn, nh), HeadView(kvb, dn, dn + dv, dv, nh)
    q, lat, kpe = gb.rt.empty((1, nh, dn + dr)), gb.rt.empty((T, L)), gb.rt.empty((T, dr))
    mask = DeviceMask(1, T, T - 1)
    if masking == "topk":
        mask = DeviceMask(1, T, T - 1, gb.rt.empty((1, 2048), np.int32), gb.rt.empty((1,), np.int32), 2048)
    o = gb.mla_attend(q, lat, kpe, w_kb, w_vb, mask, 0.1)
    assert o.shape == (1, nh * dv)
    names = [x[0] for x in gb.rt.launches]
    assert names == want
    if attn != "v1":
        part = gb.rt.launches[1]
        assert part[1] == (32, 4, 1) and part[2] == 256       # 32 chunks of 64 keys x 4 head groups: one wave
    if attn in ("auto", "tile1", "tile2", "tile3"):           # the projections: 4 (q_abs) and 8 (o) blocks per head
        assert gb.rt.launches[0][1] == (4, nh) and gb.rt.launches[3][1] == (8, nh)
    if attn in ("auto", "tile3"):                             # its combine: 2 blocks of 64 float4 columns per head
        assert gb.rt.launches[2][1:3] == ((2, nh, 1), 128)
    elif attn != "v1":
        assert gb.rt.launches[2][1] == (nh, 1)


def test_one_chunk_needs_no_combine():
    from coli.gpu.cuda_backend import DeviceMask
    gb = _backend()
    q_abs, q = gb.rt.empty((40, 4, 32)), gb.rt.empty((40, 4, 48))
    lat, kpe = gb.rt.empty((40, 32)), gb.rt.empty((40, 16))
    gb.attn_chunk = 4096
    gb.attend_core(q_abs, q, 32, lat, kpe, DeviceMask(40, 40, 0), 0.1)
    assert [x[0] for x in gb.rt.launches] == ["mla_attend_tile3"]


@pytest.mark.parametrize("optin,want", [(232448, "mla_attend_tile2"), (101376, "mla_attend_tile1"),
                                        (65536, "mla_attend_part_16")])
def test_tile2_takes_the_tile_kernel_the_devices_shared_memory_allows(optin, want):
    """COLI_ATTN_KERNELS=tile2 (the default before tile3): an H100/H200 block can have 227 KB of shared memory (tile2's
    two key buffers: 129 KB at GLM-5's shape), an sm_86/89 block 99 KB (tile1's one buffer: 92 KB); below that the
    part kernel (41 KB)."""
    from coli.gpu import attention_split as AS
    from coli.gpu.cuda_backend import DeviceMask
    assert AS.tile_smem_bytes(512, 64, 2) > 101376 >= AS.tile_smem_bytes(512, 64, 1) > 65536
    gb = _backend("tile2")
    gb.rt.smem_optin = optin
    q_abs, q = gb.rt.empty((1, 64, 512)), gb.rt.empty((1, 64, 256))
    lat, kpe = gb.rt.empty((2048, 512)), gb.rt.empty((2048, 64))
    gb.attend_core(q_abs, q, 192, lat, kpe, DeviceMask(1, 2048, 2047), 0.1)
    names = [x[0] for x in gb.rt.launches]
    assert names == [want, "mla_attend_combine" if want.startswith("mla_attend_part") else "mla_attend_combine4"]
    assert gb.rt.launches[0][3] <= optin


@pytest.mark.parametrize("optin,want", [(232448, "mla_attend_tile3"), (200000, "mla_attend_tile2"),
                                        (101376, "mla_attend_tile1"), (65536, "mla_attend_part_16")])
@pytest.mark.parametrize("attn", ["auto", "tile3"])
def test_tile3_falls_back_to_the_kernels_the_devices_shared_memory_allows(optin, want, attn):
    """COLI_ATTN_KERNELS=tile3: its two 32-key tiles take 217 KB at GLM-5's shape (an sm_90 block's 227 KB holds them);
    a smaller block gets what "auto" would pick there -- never a launch past the device's shared memory."""
    from coli.gpu import attention_split as AS
    from coli.gpu.cuda_backend import DeviceMask
    assert 232448 >= AS.tile3_smem_bytes(512, 64) > 200000 >= AS.tile_smem_bytes(512, 64, 2)
    gb = _backend(attn)                                      # auto is tile3 since the H200 run of 2026-12-01
    gb.rt.smem_optin = optin
    q_abs, q = gb.rt.empty((1, 64, 512)), gb.rt.empty((1, 64, 256))
    lat, kpe = gb.rt.empty((2048, 512)), gb.rt.empty((2048, 64))
    gb.attend_core(q_abs, q, 192, lat, kpe, DeviceMask(1, 2048, 2047), 0.1)
    names = [x[0] for x in gb.rt.launches]
    combine = {"mla_attend_tile3": "mla_attend_combine_onepass", "mla_attend_part_16": "mla_attend_combine"}
    assert names == [want, combine.get(want, "mla_attend_combine4")]
    assert gb.rt.launches[0][3] <= optin
    assert gb.rt.launches[0][1] == (32, 4, 1)                  # the same chunks and head groups as tile2


def test_misaligned_cache_takes_the_first_version():
    from coli.gpu.cuda_backend import DeviceMask
    gb = _backend()
    q_abs, q = gb.rt.empty((1, 4, 32)), gb.rt.empty((1, 4, 48))
    lat = gb.rt.empty((41, 32))
    kpe = DeviceArray(gb.rt.empty((41, 16)).ptr + 4, (40, 16))           # a row view 4 bytes in
    gb.attend_core(q_abs, q, 32, DeviceArray(lat.ptr, (40, 32)), kpe, DeviceMask(1, 40, 39), 0.1)
    assert [x[0] for x in gb.rt.launches] == ["mla_attend_1"]
    with pytest.raises(ValueError, match="T_dev"):
        gb.attend_core(q_abs, q, 32, DeviceArray(lat.ptr, (40, 32)), kpe, DeviceMask(1, 40, 39), 0.1, T_dev=64)


@pytest.mark.parametrize("rows,cols,fmt,group,gemv,want", [
    (2048, 6144, "int4", 64, "v2", "gemv2_int4"),
    (256, 6144, "f32", 64, "v2", "gemv2_f32"),
    (576, 6144, "int8", 64, "v2", "gemv2_int8"),
    (2048, 6144, "int4", 64, "v1", "gemv_int4"),
    (2048, 6144, "int4", 256, "v2", "gemv_int4"),       # a group gemv2 cannot find by a shift
])
def test_decode_linear_launches(rows, cols, fmt, group, gemv, want):
    gb = _backend(gemv=gemv)
    w = _weight(gb, rows, cols, fmt, group)
    out = gb.linear(gb.rt.empty((1, cols)), w)
    assert out.shape == (1, rows)
    assert [x[0] for x in gb.rt.launches] == [want]


def test_a_kernel_version_setting_must_name_a_version():
    from coli.errors import ColiError
    from coli.gpu.cuda_backend import ATTN_VERSIONS, GEMV_VERSIONS, kernel_choice
    assert kernel_choice("COLI_ATTN_KERNELS", "split1", ATTN_VERSIONS) == "split1"
    with pytest.raises(ColiError, match=r"COLI_ATTN_KERNELS='v2' is not a kernel version: use one of auto, tile3, tile2, tile1, split2, split1, v1"):
        kernel_choice("COLI_ATTN_KERNELS", "v2", ATTN_VERSIONS)
    with pytest.raises(ColiError, match="COLI_GEMV_KERNELS='fast'"):
        kernel_choice("COLI_GEMV_KERNELS", "fast", GEMV_VERSIONS)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_a_glm5_layers_projections_of_one_input_share_a_launch(fmt):
    """linear_many at one token (COLI_GEMV_KERNELS=v3): q_a | kv_a | indexer wk of the dense core's format in one
    gemv2x launch, the f32 weights_proj alone; q_b | wq_b in one. v2 launches each matrix alone; a step of a few rows
    (S = 5) goes through gemv2r (int8) or, for int4 past 4 rows, a GEMM per matrix (the tensor cores where its rows
    fill their blocks: q_a, not kv_a's 576); a group gemv2 cannot find by a shift leaves them apart."""
    H, Lq = 6144, 2048
    for gemv, want_x, want_q in (("v3", [f"gemv2x_{fmt}", "gemv2_f32"], [f"gemv2x_{fmt}"]),
                                 ("v2", [f"gemv2_{fmt}"] * 3 + ["gemv2_f32"], [f"gemv2_{fmt}"] * 2)):
        gb = _backend(gemv=gemv)
        of_x = [_weight(gb, 2048, H, fmt), _weight(gb, 576, H, fmt), _weight(gb, 128, H, fmt), _weight(gb, 32, H, "f32")]
        outs = gb.linear_many(gb.rt.empty((1, H)), of_x)
        assert [o.shape for o in outs] == [(1, 2048), (1, 576), (1, 128), (1, 32)]
        assert len({o.ptr for o in outs}) == 4
        assert [x[0] for x in gb.rt.launches] == want_x
        if gemv == "v3":
            name, grid, block, smem = gb.rt.launches[0]
            # 1,376 row pairs at ks 1 (8 pairs per block, gemv2_split): 172 groups, one round on 264 resident blocks
            assert grid == (172,) and block == 256 and smem == 6144 * 4
        gb.rt.launches.clear()
        gb.linear_many(gb.rt.empty((1, Lq)), [_weight(gb, 16384, Lq, fmt), _weight(gb, 4096, Lq, fmt)])
        assert [x[0] for x in gb.rt.launches] == want_q
    gb = _backend(gemv="v3")
    gb.linear_many(gb.rt.empty((5, H)), [_weight(gb, 2048, H, fmt), _weight(gb, 576, H, fmt)])
    # a step of 5 rows: int8 through gemv2r, each matrix read once per launch of 3 + 2 staged rows (gemv_rows_plan);
    # int4 past GEMV_ROWS_INT4 rows on the tensor cores where its rows fill their blocks (q_a), a GEMM for kv_a's 576
    want_s5 = ["pf_split_rows", "pf_linear_int4", "gemm_nt_int4"] if fmt == "int4" else [f"gemv2r_{fmt}"] * 4
    assert [x[0] for x in gb.rt.launches] == want_s5
    if fmt == "int4":
        gb = _backend(gemv="v3")
        gb.linear_many(gb.rt.empty((1, H)), [_weight(gb, 2048, H, fmt, 256), _weight(gb, 576, H, fmt, 256)])
        assert [x[0] for x in gb.rt.launches] == ["gemv_int4"] * 2


def test_linear_many_checks_every_width():
    gb = _backend(gemv="v3")
    with pytest.raises(ValueError, match=r"linear_many: input of width 6144 for a weight of shape \[576, 512\]"):
        gb.linear_many(gb.rt.empty((1, 6144)), [_weight(gb, 2048, 6144, "int8"), _weight(gb, 576, 512, "int8")])
    assert gb.rt.launches == []


@pytest.mark.parametrize("masking", ["dense", "topk"])
def test_a_long_prefills_attention_runs_in_blocks_of_rows_each_with_the_whole_calls_split(masking):
    """S = 1,100 > ATTN_PREFILL_ROWS: q_abs, the context and o per block of 512 + 512 + 76 rows (grids' row axes),
    the same context kernel with the same chunk each time; S = 512 is still one pass."""
    from coli.gpu.cuda_backend import ATTN_PREFILL_ROWS, DeviceMask
    from coli.gpu.cuda_weights import HeadView
    assert ATTN_PREFILL_ROWS == 512
    nh, dn, dr, dv, L = 64, 192, 64, 256, 512
    for S, blocks in ((1100, [512, 512, 76]), (512, [512])):
        gb = _backend("auto")
        T = 3000
        kvb = _weight(gb, nh * (dn + dv), L, "int8")
        w_kb, w_vb = HeadView(kvb, 0, dn + dv, dn, nh), HeadView(kvb, dn, dn + dv, dv, nh)
        q, lat, kpe = gb.rt.empty((S, nh, dn + dr)), gb.rt.empty((T, L)), gb.rt.empty((T, dr))
        mask = DeviceMask(S, T, T - S)
        if masking == "topk":
            mask = DeviceMask(S, T, T - S, gb.rt.empty((S, 2048), np.int32), gb.rt.empty((S,), np.int32), 2048)
        assert gb.mla_attend(q, lat, kpe, w_kb, w_vb, mask, 0.1).shape == (S, nh * dv)
        names = [x[0] for x in gb.rt.launches]
        assert names == ["gemm_nn_int8", "mla_attend_tile3", "gemm_nt_int8"] * len(blocks)
        ctx = gb.rt.launches[1::3]
        assert [g[1][2] for g in ctx] == blocks                        # grid (chunks, head groups, rows)
        assert len({g[1][:2] for g in ctx}) == 1                       # one chunk count for every block
        assert [g[1][1] for g in gb.rt.launches[0::3]] == [-(-n // 64) for n in blocks]
