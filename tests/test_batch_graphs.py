"""The host side of the batched decode step replayed from CUDA graphs (coli/gpu/batch_graphs.py), no GPU needed: its
setting, the layout of its per-step inputs, which row's values the backend reads where, and the per-row MoE launches
of a batched step on a recording stand-in runtime (every launch checked against the kernel's signature, as in
tests/test_decode_launches.py). The replayed step itself is checked on the GPU (tests/gpu/test_gpu_batch.py)."""

from __future__ import annotations

import numpy as np
import pytest

from coli.errors import ColiError
from coli.gpu.batch_graphs import BatchStepInputs, BatchStepLayout, batch_graphs_enabled
from coli.gpu.cuda_runtime import CudaError, DeviceArray


def test_the_setting_is_off_by_default_and_must_be_0_or_1():
    assert batch_graphs_enabled({}) is False
    assert batch_graphs_enabled({"COLI_BATCH_GRAPHS": "1"}) is True
    assert batch_graphs_enabled({"COLI_BATCH_GRAPHS": " 0 "}) is False
    with pytest.raises(ColiError, match=r"COLI_BATCH_GRAPHS='yes': use 1 .* or 0"):
        batch_graphs_enabled({"COLI_BATCH_GRAPHS": "yes"})


def test_layout_packs_tokens_positions_and_each_rows_angles():
    lay = BatchStepLayout(B=3, half=4)
    assert (lay.pos_at, lay.angles_at) == (16, 48)          # both 16-byte aligned for the kernels' loads
    assert lay.nbytes == 48 + 8 * 3 * 4
    buf = np.zeros(lay.nbytes, np.uint8)
    cos = np.arange(12, dtype=np.float32).reshape(3, 4)
    sin = -cos
    lay.pack(buf, [7, 8, 9], [0, 41, 5], cos, sin)
    assert buf[:12].view(np.int32).tolist() == [7, 8, 9]
    assert buf[16:40].view(np.int32).reshape(3, 2).tolist() == [[0, 1], [41, 42], [5, 6]]   # (position, T)
    assert lay.pos_offset(1) == 24
    a = buf[48:].view(np.float32)
    np.testing.assert_array_equal(a[:12].reshape(3, 4), cos)
    np.testing.assert_array_equal(a[12:].reshape(3, 4), sin)
    with pytest.raises(ValueError, match="a step of 3 rows got 2 tokens"):
        lay.pack(buf, [7, 8], [0, 41, 5], cos, sin)
    with pytest.raises(ValueError, match="uint8 buffer of 144 bytes"):
        lay.pack(np.zeros(100, np.uint8), [7, 8, 9], [0, 41, 5], cos, sin)
    with pytest.raises(ValueError, match="row 3 of a step of 3"):
        lay.pos_offset(3)


class _Drv:
    @staticmethod
    def pagelocked_empty(n, dtype):
        return np.empty(n, dtype)


class _RecordingRuntime:
    """Hands out fake device addresses and records every launch with its arguments (no GPU)."""

    sm_count = 132
    smem_optin = 232448
    drv = _Drv()

    def __init__(self):
        self.launches: list[tuple] = []
        self._next = 1 << 20

    def function(self, module, name, argtypes):
        return (module, name, argtypes)

    def allow_smem(self, fn, nbytes):
        return nbytes <= self.smem_optin

    def resident_blocks(self, fn, threads, smem=0):
        return self.sm_count * 2

    def empty(self, shape, dtype=np.float32):
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        ptr, self._next = self._next, self._next + ((n + 255) // 256 + 1) * 256
        return DeviceArray(ptr, shape, dtype)

    def zero(self, ptr, nbytes):
        self.launches.append(("zero", (ptr, nbytes)))

    def launch(self, fn, grid, block, *args, smem=0):
        module, name, argtypes = fn
        assert len(args) == len(argtypes), f"{name}: {len(args)} arguments for signature {argtypes!r}"
        self.launches.append((name, args))


def _backend():
    from coli.gpu.cuda_backend import CudaBackend
    gb = CudaBackend.__new__(CudaBackend)
    gb.rt, gb.busy, gb.moe_kernels, gb._scratch, gb._mma_usable = _RecordingRuntime(), None, "v2", {}, None
    gb.step = None
    return gb


def _inputs(gb, B, H=128, Im=64, E=16):
    from coli.container.format import RecordLayout
    lay = RecordLayout.make(H, Im, "int4", 64, 512)
    slots = gb.rt.empty((4, E), np.uint64)
    return BatchStepInputs(gb.rt, BatchStepLayout(B, 8), slots, E, lay), slots


def test_rows_read_their_own_position_span_and_capacity():
    gb = _backend()
    st, _ = _inputs(gb, 3)
    st.positions, st.capacities, st.spans = [10, 20, 30], [64, 128, 64], [64, 64, 128]
    assert st.check_rows(3, "embed") is st and st.token_ptr == st.dyn.ptr
    cs, sn = st.angles(8)
    assert cs.shape == (3, 8) and sn.ptr == cs.ptr + 4 * 3 * 8
    with pytest.raises(CudaError, match="a position outside a row's attention"):
        st.pos_ptr
    with pytest.raises(CudaError, match="write_rows of 1 rows in the batch of a captured batched step"):
        st.check_rows(1, "write_rows")
    st.select(2)
    assert st.check_rows(1, "write_rows") is st
    assert st.pos_ptr == st.dyn.ptr + 16 + 8 * 2
    assert (st.pos, st.capacity, st.attn_n_max) == (30, 64, 128)
    st.check_start(30)
    with pytest.raises(CudaError, match="a row write at 29 in row 2's step of position 30"):
        st.check_start(29)
    with pytest.raises(CudaError, match="embed inside a row's attention"):
        st.token_ptr
    with pytest.raises(CudaError, match="rope with 8 angles"):
        st.angles(8)
    with pytest.raises(CudaError, match="moe_step of 3 rows in row 2's attention"):
        st.check_rows(3, "moe_step")


def test_a_batched_moe_step_runs_each_rows_fused_decode_on_its_own_rows():
    from coli.gpu.cuda_backend import DeviceRoute
    gb = _backend()
    B, H, K = 3, 128, 4
    st, slots = _inputs(gb, B, H=H)
    gb.step = st
    x = gb.rt.empty((B, H))
    route = DeviceRoute(gb.rt.empty((B, K), np.int32), gb.rt.empty((B, K)), K)
    out = gb.moe_step(2, x, route)
    assert out.shape == (B, H)
    names = [n for n, _ in gb.rt.launches]
    assert names == ["expert_table", "moe_gateup_int4", "moe_down_int4"] * B
    for r in range(B):
        tab, gu, dn = (args for _, args in gb.rt.launches[3 * r:3 * r + 3])
        assert tab[0] == route.idx.ptr + 4 * K * r and tab[2] == slots.ptr + 2 * 16 * 8   # row r's top-k, layer 2
        assert gu[10] == x.ptr + 4 * H * r                                                # row r's activation
        assert dn[9] == route.weights.ptr + 4 * K * r and dn[11] == out.ptr + 4 * H * r   # its weights, its output
        assert dn[12] == 0                                                                # K <= 8: one launch, no sum
