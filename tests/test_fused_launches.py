"""The host side of the fused decode ops (Backend.add_rms_norm, norm_many, rope_many, write_rows_many) on a
recording stand-in runtime (no GPU): each is one launch where it replaces several, with the grid and the argument
count its kernel's signature says (tests/test_kernels_compile.py checks those against the C source), and a GLM-5
layer's attention inputs and cache write at one token in a captured step launch the fused kernels -- the node count of
a replayed layer. The bits are checked on the GPU (tests/gpu/test_gpu_fused.py)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from coli.config import preset
from coli.container.format import MatrixLayout
from coli.gpu.cuda_backend import NORM_THREADS
from recording_runtime import RecordingRuntime


class _Runtime(RecordingRuntime):
    """Records launches (name, grid, block, args) and device copies ("copy", dst, src, nbytes)."""

    # a DeviceStep's pinned blocks, as host arrays
    drv = SimpleNamespace(pagelocked_empty=lambda n, dtype: np.zeros(n, dtype))

    def record(self, name, argtypes, grid, block, args, smem):
        self.launches.append((name, tuple(grid), block, args))

    def copy(self, dst, src, nbytes):
        self.launches.append(("copy", dst, src, nbytes))

    def to_device_async(self, host, dtype=None):
        return self.empty(np.shape(host), dtype or np.asarray(host).dtype)


def _backend():
    from coli.gpu.cuda_backend import CudaBackend
    gb = CudaBackend.__new__(CudaBackend)
    gb.rt, gb.busy, gb.step, gb._cs = _Runtime(), None, None, None
    gb.attn_kernels, gb.attn_chunk, gb.gemv_kernels, gb.gemv_ks = "auto", None, "v3", None
    gb.prefill_kernels, gb._pf_usable, gb.prefill_int8 = "mma", True, False
    return gb


def _names(gb):
    return [x[0] for x in gb.rt.launches]


def _step(gb, pos=41, half=32):
    from coli.gpu.graphs import DeviceStep, StepLayout
    st = DeviceStep(gb.rt, StepLayout(half, (), 8), None, 1, None, 16)
    st.pos, st.capacity = pos, 64
    return st


@pytest.mark.parametrize("S,D", [(1, 6144), (5, 777)])
def test_add_rms_norm_is_one_launch_of_a_block_per_row(S, D):
    gb = _backend()
    h, a, w = gb.rt.empty((S, D)), gb.rt.empty((S, D)), gb.rt.empty((D,))
    s, y = gb.add_rms_norm(h, a, w, 1e-5)
    assert s.shape == y.shape == (S, D) and len({s.ptr, y.ptr, h.ptr, a.ptr}) == 4
    [(name, grid, block, args)] = gb.rt.launches
    assert (name, grid, block) == ("add_rmsnorm", (S,), NORM_THREADS)
    assert args[:6] == (h.ptr, a.ptr, 0, w.ptr, s.ptr, y.ptr) and args[6] == D      # no second addend: null
    gb.rt.launches.clear()
    a2 = gb.rt.empty((S, D))                        # a MoE layer's routed + shared sums: one launch too
    s, y = gb.add_rms_norm(h, a, w, 1e-5, a2)
    [(name, grid, block, args)] = gb.rt.launches
    assert (name, grid) == ("add_rmsnorm", (S,)) and args[:6] == (h.ptr, a.ptr, a2.ptr, w.ptr, s.ptr, y.ptr)


def test_norm_many_of_the_latents_and_the_indexer_key_is_one_launch():
    gb = _backend()
    q, lat, ik = gb.rt.empty((1, 2048)), gb.rt.empty((1, 512)), gb.rt.empty((1, 128))
    wq, wl, wk, bk = gb.rt.empty((2048,)), gb.rt.empty((512,)), gb.rt.empty((128,)), gb.rt.empty((128,))
    yq, yl, yk = gb.norm_many([(q, wq), (lat, wl)], 1e-6, (ik, wk, bk, 1e-5))
    assert (yq.shape, yl.shape, yk.shape) == ((1, 2048), (1, 512), (1, 128))
    [(name, grid, block, args)] = gb.rt.launches
    assert (name, grid, block) == ("norms3", (1, 3), NORM_THREADS)
    assert args[:8] == (q.ptr, wq.ptr, yq.ptr, 2048, lat.ptr, wl.ptr, yl.ptr, 512)
    assert args[9:14] == (ik.ptr, wk.ptr, bk.ptr, yk.ptr, 128) and np.float32(args[14]) == np.float32(1e-5)
    # a shared-indexer layer: the two latents alone, the third slice not launched (its pointers null)
    gb.rt.launches.clear()
    yq, yl = gb.norm_many([(q, wq), (lat, wl)], 1e-6)
    [(name, grid, block, args)] = gb.rt.launches
    assert (name, grid) == ("norms3", (1, 2)) and args[9:13] == (0, 0, 0, 0)
    # tensors of different rows (or not two latents) are normed one launch each, as before
    gb.rt.launches.clear()
    gb.norm_many([(gb.rt.empty((2, 64)), wq), (gb.rt.empty((3, 64)), wl)], 1e-6)
    gb.norm_many([(q, wq)], 1e-6, (ik, wk, bk, 1e-5))
    gb.norm_many([(q, wq), (lat, wl)], 1e-6, (gb.rt.empty((2, 128)), wk, bk, 1e-5))
    assert _names(gb) == ["rmsnorm"] * 3 + ["layernorm"] + ["rmsnorm"] * 2 + ["layernorm"]


def test_rope_many_of_a_glm5_layer_is_one_launch():
    """q [1, 64, 256] (rope part at 192), k_pe [1, 1, 64], indexer q [1, 32, 128], indexer key [1, 1, 128]: one rope4
    launch, one y-slice per tensor, as many blocks as the largest tensor's own rope launch had (64)."""
    gb = _backend()
    cos = sin = np.zeros((1, 32), np.float32)
    shapes = [((1, 64, 256), 192), ((1, 1, 64), 0), ((1, 32, 128), 0), ((1, 1, 128), 0)]
    xs = [(gb.rt.empty(s), off) for s, off in shapes]
    outs = gb.rope_many(xs, cos, sin)
    assert [o.shape for o in outs] == [s for s, _ in shapes]
    [(name, grid, block, args)] = gb.rt.launches
    assert (name, grid, block) == ("rope4", (64, 4), 256)
    assert args[2:4] == (1, 32)
    for k, ((x, off), o) in enumerate(zip(xs, outs)):
        assert args[4 + 5 * k:9 + 5 * k] == (x.ptr, o.ptr, x.shape[1], x.shape[2], off)
    # five tensors: two launches (four, then one, its unused slots zero)
    gb.rt.launches.clear()
    gb.rope_many(xs + xs[:1], cos, sin)
    assert [(n, g) for n, g, _, _ in gb.rt.launches] == [("rope4", (64, 4)), ("rope4", (64, 1))]
    assert gb.rt.launches[1][3][9:] == (0,) * 15


def test_rope_many_refuses_tensors_of_different_rows_before_any_launch():
    gb = _backend()
    cos = sin = np.zeros((2, 8), np.float32)
    with pytest.raises(ValueError, match=r"rope_many of tensors with different rows: \[\(2, 1, 16\), \(1, 1, 16\)\]"):
        gb.rope_many([(gb.rt.empty((2, 1, 16)), 0), (gb.rt.empty((1, 1, 16)), 0)], cos, sin)
    assert gb.rt.launches == []


def test_write_rows_many_is_one_kv_put_in_a_step_and_copies_eagerly():
    gb = _backend()
    caches = [gb.rt.empty((64, n)) for n in (512, 64, 128)]
    rows = [gb.rt.empty((1, n)) for n in (512, 64, 128)]
    gb.write_rows_many(list(zip(caches, rows)), 41)                   # eager: a copy each, at row 41
    assert [(x[0], x[1], x[3]) for x in gb.rt.launches] == [("copy", c.ptr + 41 * 4 * r.size, 4 * r.size)
                                                          for c, r in zip(caches, rows)]
    gb.rt.launches.clear()
    gb.step = st = _step(gb, pos=41)
    gb.write_rows_many(list(zip(caches, rows)), 41)
    [(name, grid, block, args)] = gb.rt.launches
    assert (name, grid, block) == ("kv_put3", (2, 3), 256)
    assert args == (st.pos_ptr, rows[0].ptr, 512, caches[0].ptr, rows[1].ptr, 64, caches[1].ptr,
                    rows[2].ptr, 128, caches[2].ptr)


def test_write_rows_many_in_a_step_checks_every_row_before_any_launch():
    from coli.gpu.cuda_runtime import CudaError
    gb = _backend()
    gb.step = _step(gb, pos=41)
    ok = (gb.rt.empty((64, 8)), gb.rt.empty((1, 8)))
    with pytest.raises(CudaError, match="write_rows_many of 2 rows in a captured decode step"):
        gb.write_rows_many([ok, (gb.rt.empty((64, 8)), gb.rt.empty((2, 8)))], 41)
    with pytest.raises(ValueError, match=r"cannot write rows \(1, 9\) into \(64, 8\) at 41"):
        gb.write_rows_many([ok, (gb.rt.empty((64, 8)), gb.rt.empty((1, 9)))], 41)
    assert gb.rt.launches == []


def _weight(gb, rows, cols, fmt="int8", group=64):
    from coli.gpu.cuda_weights import QWeight
    lay = MatrixLayout.make(rows, cols, fmt, group, 512)
    return QWeight(gb.rt.empty((lay.nbytes,), np.uint8).ptr, lay, (rows, cols))


def test_a_glm5_full_layers_attention_inputs_and_cache_write_in_a_step():
    """The row-wise attention of a GLM-5 "full" layer at one token, in a captured step (int8 core): 5 launches -- the
    q_a | kv_a | wk GEMV, the f32 weights_proj, one norms3 for both latents and the indexer key, q_b | wq_b, and one
    rope4 for q, k_pe, the indexer q and key (before the fused ops: 9) -- and its cache write one kv_put3 (before: 3)."""
    from coli.gpu.graphs import DeviceStep, StepLayout
    from coli.model.forward import AttentionWeights, GlmMoeDsaModel
    from coli.model.kv_cache import KVCache
    c = preset("glm5")
    H, Lq, Lkv, dr = c.hidden_size, c.q_lora_rank, c.kv_lora_rank, c.qk_rope_head_dim
    nh, qk, ih, ihd = c.num_attention_heads, c.qk_head_dim, c.index_n_heads, c.index_head_dim
    gb = _backend()
    vec = gb.rt.empty
    w = AttentionWeights(
        q_a=_weight(gb, Lq, H), q_a_norm=vec((Lq,)), q_b=_weight(gb, nh * qk, Lq), kv_a=_weight(gb, Lkv + dr, H),
        kv_a_norm=vec((Lkv,)), w_kb=None, w_vb=None, o=None, idx_wq_b=_weight(gb, ih * ihd, Lq),
        idx_wk=_weight(gb, ihd, H), idx_k_norm_w=vec((ihd,)), idx_k_norm_b=vec((ihd,)),
        idx_weights=_weight(gb, ih, H, "f32"))
    model = GlmMoeDsaModel.__new__(GlmMoeDsaModel)
    model.config, model.backend = c, gb
    gb.step = st = DeviceStep(gb.rt, StepLayout(dr // 2, (), 8), None, 1, None, H)
    st.pos = 5
    cos = sin = np.zeros((1, dr // 2), np.float32)
    p = model._attention_inputs(0, w, vec((1, H)), cos, sin)
    assert _names(gb) == ["gemv2x_int8", "gemv2_f32", "norms3", "gemv2x_int8", "rope4"]
    assert (p.q.shape, p.lat.shape, p.k_pe.shape, p.iq.shape, p.k_idx.shape, p.head_w.shape) == (
        (1, nh, qk), (1, Lkv), (1, dr), (1, ih, ihd), (1, ihd), (1, ih))
    gb.rt.launches.clear()
    cache = KVCache.empty(c, gb, 64)
    full = c.indexer_types.index("full")
    cache.write(full, 5, p.lat, p.k_pe, p.k_idx)
    [(name, grid, _, args)] = gb.rt.launches
    lc = cache.layers[full]
    assert (name, grid, args[3::3]) == ("kv_put3", (2, 3), (lc.lat.ptr, lc.k_pe.ptr, lc.k_idx.ptr))
