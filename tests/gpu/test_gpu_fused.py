"""The fused decode ops (Backend.add_rms_norm, norm_many, rope_many, write_rows_many: one launch each on the CUDA
backend, fewer nodes in a replayed layer) give the same bits as the unfused kernels they replace, on GLM-5's decode
shapes and small odd ones -- eagerly and in step mode (the per-token values read from a DeviceStep's device inputs, as
inside a captured decode step). Their numpy composition (the Backend defaults) is the reference of the unfused
kernels' own tests (test_gpu_elementwise.py); here the bar is np.array_equal against those kernels."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from coli.model.backend import cos_sin_table
from coli.model.numpy_backend import NumpyBackend
from gpu_helpers import rand

pytestmark = pytest.mark.gpu
NP = NumpyBackend()

# GLM-5 at one token and a short prefill: hidden 6144, q_lora 2048, kv_lora 512, rope 64, nope 192, 64 heads, indexer
# 32 heads of 128; then small odd shapes (a D not a multiple of the block, one row, rows past one block's loads)
GLM5_ROPES = [((64, 256), 192), ((1, 64), 0), ((32, 128), 0), ((1, 128), 0)]
ODD_ROPES = [((3, 48), 32), ((1, 16), 0), ((5, 16), 0), ((1, 40), 8)]


def _host(gb, xs):
    return [gb.to_host(x) for x in xs]


@pytest.mark.parametrize("S,D", [(1, 6144), (7, 6144), (3, 2048), (1, 100), (5, 777), (2, 3100), (1, 9000)])
def test_add_rms_norm_is_add_then_rmsnorm_bit_for_bit(gb, rng, S, D):
    h, a, w = rand(rng, S, D, scale=3.0), rand(rng, S, D), rand(rng, D) + 1
    dh, da, dw = gb.upload(h), gb.upload(a), gb.upload(w)
    s, y = _host(gb, gb.add_rms_norm(dh, da, dw, 1e-5))
    s_ref = gb.add(dh, da)
    np.testing.assert_array_equal(s, gb.to_host(s_ref))
    np.testing.assert_array_equal(y, gb.to_host(gb.rms_norm(s_ref, dw, 1e-5)))
    np.testing.assert_array_equal(s, h + a)                 # the sum is numpy's (one fp32 add)
    # the inputs are left as they were (the sum and the norm go to buffers of their own)
    np.testing.assert_array_equal(gb.to_host(dh), h)
    np.testing.assert_array_equal(gb.to_host(da), a)


@pytest.mark.parametrize("S,D", [(1, 6144), (4, 6144), (3, 777)])
def test_add_rms_norm_of_two_addends_is_two_adds_then_rmsnorm_bit_for_bit(gb, rng, S, D):
    """A MoE layer's residual add takes the routed and the shared sums: h + (routed + shared), in that order, as
    add(h, add(routed, shared)) computes it."""
    h, r, sh, w = rand(rng, S, D, scale=3.0), rand(rng, S, D), rand(rng, S, D, scale=0.3), rand(rng, D) + 1
    dh, dr, ds, dw = gb.upload(h), gb.upload(r), gb.upload(sh), gb.upload(w)
    s, y = _host(gb, gb.add_rms_norm(dh, dr, dw, 1e-5, ds))
    s_ref = gb.add(dh, gb.add(dr, ds))
    np.testing.assert_array_equal(s, gb.to_host(s_ref))
    np.testing.assert_array_equal(y, gb.to_host(gb.rms_norm(s_ref, dw, 1e-5)))
    np.testing.assert_array_equal(s, h + (r + sh))
    assert not np.array_equal(s, (h + r) + sh)               # the order is seen at these magnitudes: a real check


def test_add_rms_norm_refuses_mismatched_shapes(gb, rng):
    with pytest.raises(ValueError, match=r"add_rms_norm of \(1, 64\) and \(2, 64\)"):
        gb.add_rms_norm(gb.upload(rand(rng, 1, 64)), gb.upload(rand(rng, 2, 64)), gb.upload(rand(rng, 64)), 1e-5)
    with pytest.raises(ValueError, match=r"add_rms_norm of \(1, 64\) and \(1, 64\) and \(1, 63\)"):
        gb.add_rms_norm(gb.upload(rand(rng, 1, 64)), gb.upload(rand(rng, 1, 64)), gb.upload(rand(rng, 64)), 1e-5,
                        gb.upload(rand(rng, 1, 63)))


@pytest.mark.parametrize("S,D0,D1,D2", [(1, 2048, 512, 128), (5, 2048, 512, 128), (1, 100, 37, 33), (3, 3100, 1, 1000),
                                        (2, 2048, 512, None)])
def test_norm_many_is_one_rmsnorm_and_layernorm_each_bit_for_bit(gb, rng, S, D0, D1, D2):
    x0, x1 = rand(rng, S, D0, scale=2.0), rand(rng, S, D1, scale=0.5)
    w0, w1 = rand(rng, D0) + 1, rand(rng, D1) + 1
    d = [(gb.upload(x0), gb.upload(w0)), (gb.upload(x1), gb.upload(w1))]
    ln = None if D2 is None else (gb.upload(rand(rng, S, D2, scale=2.0) + 0.5), gb.upload(rand(rng, D2) + 1),
                                  gb.upload(rand(rng, D2)), 1e-6)
    got = _host(gb, gb.norm_many(d, 1e-5, ln))
    want = [gb.to_host(gb.rms_norm(x, w, 1e-5)) for x, w in d] + ([] if ln is None else [gb.to_host(gb.layer_norm(*ln))])
    assert len(got) == len(want) == (2 if ln is None else 3)
    for g, r in zip(got, want):
        np.testing.assert_array_equal(g, r)


def test_norm_many_of_a_row_view(gb, rng):
    """The kv_a latent of a decode step is a view into kv_a's output (split_cols of one row): read where it lies."""
    kv, q = rand(rng, 1, 576), rand(rng, 1, 2048)
    dkv = gb.upload(kv)
    lat, _ = gb.split_cols(dkv, 512)
    w0, w1 = gb.upload(rand(rng, 2048) + 1), gb.upload(rand(rng, 512) + 1)
    got = _host(gb, gb.norm_many([(gb.upload(q), w0), (lat, w1)], 1e-6))
    np.testing.assert_array_equal(got[1], gb.to_host(gb.rms_norm(gb.upload(kv[:, :512].copy()), w1, 1e-6)))
    np.testing.assert_array_equal(got[0], gb.to_host(gb.rms_norm(gb.upload(q), w0, 1e-6)))


def _ropes(gb, rng, S, specs):
    hosts = [rand(rng, S, n, d) for (n, d), _ in specs]
    return hosts, [(gb.upload(x), off) for x, ((_, _), off) in zip(hosts, specs)]


@pytest.mark.parametrize("S", [1, 5])
@pytest.mark.parametrize("specs,dr", [(GLM5_ROPES, 64), (ODD_ROPES, 16), (GLM5_ROPES + GLM5_ROPES[:1], 64),
                                      (GLM5_ROPES[:2], 64)])
def test_rope_many_is_one_rope_each_bit_for_bit(gb, rng, S, specs, dr):
    cos, sin = cos_sin_table(np.arange(40, 40 + S), dr, 1e6)
    hosts, xs = _ropes(gb, rng, S, specs)
    got = _host(gb, gb.rope_many(xs, cos, sin))
    assert [g.shape for g in got] == [x.shape for x in hosts]
    for g, (x, off), h in zip(got, xs, hosts):
        np.testing.assert_array_equal(g, gb.to_host(gb.rope(x, cos, sin, off)))
        np.testing.assert_array_equal(g, NP.rope(h, cos, sin, off))


def test_rope_many_refuses_tensors_of_different_rows(gb, rng):
    cos, sin = cos_sin_table([3], 16, 1e6)
    xs = [(gb.upload(rand(rng, 1, 2, 16)).reshape(1, 2, 16), 0), (gb.upload(rand(rng, 2, 1, 16)).reshape(2, 1, 16), 0)]
    with pytest.raises(ValueError, match="rope_many of tensors with different rows"):
        gb.rope_many(xs, cos, sin)


def _step(gb, pos: int, dr: int):
    """A DeviceStep (coli/gpu/graphs.py) holding position `pos` and its angles on the device, as a replayed step's
    first node leaves them."""
    from coli.gpu.graphs import DeviceStep, StepLayout
    layout = StepLayout(dr // 2, (), 8)
    st = DeviceStep(gb.rt, layout, None, 1, None, 16)
    cos, sin = cos_sin_table([pos], dr, 1e6)
    layout.pack(st.pinned_in, 0, pos, cos, sin)
    gb.rt.upload_bytes(st.pinned_in, st.dyn.ptr)
    st.pos, st.capacity = pos, 64
    return st, cos, sin


@pytest.mark.parametrize("widths", [(512, 64, 128), (512, 64), (37, 1, 300)])
def test_write_rows_many_in_a_step_is_one_kv_put_each_bit_for_bit(gb, rng, widths):
    """Inside a captured step the cache rows go to the step's device position in one kv_put3; the caches hold what
    one kv_put each (the unfused step) and the eager copies write, and nothing else of them changes."""
    cap, pos = 64, 41
    fill = [rand(rng, cap, n) for n in widths]
    rows = [rand(rng, 1, n) for n in widths]
    st, _, _ = _step(gb, pos, 64)

    def run(fused: bool, in_step: bool):
        caches = [gb.upload(f) for f in fill]
        pairs = [(c, gb.upload(r)) for c, r in zip(caches, rows)]
        gb.step = st if in_step else None
        try:
            if fused:
                gb.write_rows_many(pairs, pos)
            else:
                for c, r in pairs:
                    gb.write_rows(c, pos, r)
        finally:
            gb.step = None
        return _host(gb, caches)

    fused = run(True, True)
    for got, one, eager, f, r in zip(fused, run(False, True), run(True, False), fill, rows):
        np.testing.assert_array_equal(got, one)
        np.testing.assert_array_equal(got, eager)
        want = f.copy()
        want[pos] = r[0]
        np.testing.assert_array_equal(got, want)


def test_write_rows_many_in_a_step_refuses_a_write_elsewhere(gb, rng):
    from coli.gpu.cuda_runtime import CudaError
    st, _, _ = _step(gb, 9, 64)
    gb.step = st
    try:
        with pytest.raises(CudaError, match="a row write at 8 in the step of position 9"):
            gb.write_rows_many([(gb.upload(rand(rng, 16, 8)), gb.upload(rand(rng, 1, 8)))], 8)
    finally:
        gb.step = None


def test_rope_many_in_a_step_reads_the_steps_angles(gb, rng):
    """In step mode the angles come from the step's device inputs (what a replayed step's first node wrote), not from
    the host tables passed in: the same bits as the eager rope with the host's angles of that position."""
    st, cos, sin = _step(gb, 77, 64)
    hosts, xs = _ropes(gb, rng, 1, GLM5_ROPES)
    zeros = np.zeros_like(cos)
    gb.step = st
    try:
        got = _host(gb, gb.rope_many(xs, zeros, zeros))   # the host tables are not read inside a step
    finally:
        gb.step = None
    for g, (x, off) in zip(got, xs):
        np.testing.assert_array_equal(g, gb.to_host(gb.rope(x, cos, sin, off)))


def test_a_replayed_glm5_dense_layer_launches_the_fused_kernels(gb):
    """scripts/bench_kernels.py's dense layer (one GLM-5 "full" layer, int8 core, a short cache) captured as a graph:
    each fused kernel where the unfused ones were (two add_rmsnorm, one norms3, rope4, kv_put3; no rmsnorm, layernorm,
    rope, kv_put or add left), the graph's nodes its kernels and the dropped routed sum's memset (20 at T = 2,048, 30
    before the fused ops), and its replay the eager step's bits."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    import bench_kernels
    tm = bench_kernels.Timer(gb.rt, spin=True)
    out = bench_kernels.dense_layer_bench(gb, tm, "int8", 64, 2, versions=("v3",), layers=1)
    kernels = [k["kernel"] for k in out["kernels"]]
    assert out["v3"]["replay_equals_eager"] and out["v3"]["finite"]
    assert [kernels.count(k) for k in ("add_rmsnorm", "norms3", "rope4", "kv_put3")] == [2, 1, 1, 1], kernels
    assert not {"rmsnorm", "layernorm", "rope", "kv_put", "add"} & set(kernels), kernels
    assert out["v3"]["graph_nodes"] == len(kernels) + 1, (out["v3"]["graph_nodes"], kernels)
