"""The dense linear over stored weights: GEMV (one token) and tiled GEMM (S > 1), every format, GLM-5 shapes."""

from __future__ import annotations

import pytest

from gpu_helpers import TOL, qweight, rand, rel_err, report, stored_matrix

pytestmark = pytest.mark.gpu


LINEAR_SHAPES = [
    (2048, 6144, "int4", 64),     # q_a_proj
    (576, 6144, "int8", 0),       # kv_a_proj_with_mqa
    (4096, 2048, "bf16", 0),      # indexer wq_b
    (32, 6144, "f32", 0),         # indexer weights_proj (kept f32)
    (256, 6144, "f32", 0),        # router
    (6144, 16384, "int4", 128),   # o_proj
    (100, 100, "int4", 32), (100, 100, "int8", 0), (100, 100, "bf16", 0), (100, 100, "f32", 0),
    (77, 128, "int4", 64), (64, 32, "int4", 64),
]


@pytest.mark.parametrize("rows,cols,fmt,group", LINEAR_SHAPES)
@pytest.mark.parametrize("S", [1, 5])
def test_linear(gb, rng, rows, cols, fmt, group, S):
    buf, lay, ref = stored_matrix(rows, cols, fmt, rng, group=group or 64)
    w = qweight(gb, buf, lay)
    x = rand(rng, S, cols)
    got = gb.to_host(gb.linear(gb.upload(x), w))
    err = rel_err(got, x @ ref.T)
    report("linear", shape=[rows, cols], fmt=fmt, S=S, rel_err=err, gemv=bool(S == 1 and w.vec_ok))
    assert err < TOL


@pytest.mark.parametrize("rows,cols,fmt,group", LINEAR_SHAPES + [(98, 98, "int4", 32), (3, 6144, "f32", 0)])
@pytest.mark.parametrize("version", ["v1", "v2"])
def test_gemv_versions(gb, rng, rows, cols, fmt, group, version):
    """Both dense GEMV versions at one token: gemv_<fmt> and gemv2_<fmt> (split-K: the router's 256 x 6144 and
    kv_a's 576 x 6144 take 8 and 4 column segments; a ragged int4 row; fewer rows than one block's pairs)."""
    from coli.gpu.cuda_backend import gemv2_split
    buf, lay, ref = stored_matrix(rows, cols, fmt, rng, group=group or 64)
    w = qweight(gb, buf, lay)
    x = rand(rng, 1, cols)
    before = gb.gemv_kernels
    gb.gemv_kernels = version
    try:
        got = gb.to_host(gb.linear(gb.upload(x), w))
    finally:
        gb.gemv_kernels = before
    err = rel_err(got, x.astype("float64") @ ref.T.astype("float64"))
    report("gemv", shape=[rows, cols], fmt=fmt, version=version, rel_err=err,
           ks=gemv2_split(rows, lay.row_data_bytes // 16, gb.rt.sm_count))
    assert err < TOL
