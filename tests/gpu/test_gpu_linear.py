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
           ks=gemv2_split(rows, lay.row_data_bytes // 16, 2 * gb.rt.sm_count))
    assert err < TOL


# (rows of each matrix, cols, fmt, group): a decode layer's projections that read one input, and odd cases
MANY_SHAPES = [
    ([2048, 576, 128], 6144, "int8", 0),          # q_a | kv_a | indexer wk (int8 dense core)
    ([2048, 576, 128], 6144, "int4", 64),         # the same, int4 g64
    ([16384, 4096], 2048, "int4", 64),            # q_b | indexer wq_b
    ([2048, 576, 128, 32], 6144, "f32", 0),       # an f32 core: weights_proj joins them
    ([7, 1, 33, 2], 128, "int4", 32),             # odd rows, a one-row matrix: pairs never straddle two matrices
    ([5, 9], 98, "int4", 32),                     # a ragged last float4 of x (98 columns, 16-byte rows)
    ([3, 6], 104, "bf16", 0),
]


@pytest.mark.parametrize("rows,cols,fmt,group", MANY_SHAPES)
def test_gemv2x_writes_every_row_of_every_matrix(gb, rng, rows, cols, fmt, group):
    """gemv2x_<fmt>: several matrices that read one x in one launch; each output equals W_m x (float64 reference) and
    every element is written (outputs poisoned with NaN first)."""
    import numpy as np
    from coli.gpu.cuda_backend import gemv2x_groups
    mats = [stored_matrix(r, cols, fmt, rng, group=group or 64) for r in rows]
    ws = [qweight(gb, buf, lay) for buf, lay, _ in mats]
    assert gemv2x_groups(ws, 0) == [list(range(len(ws)))]        # what the backend would send to gemv2x
    x = rand(rng, 1, cols)
    xd = gb.upload(x)
    ys = [gb.upload(np.full((1, r), np.nan, np.float32)) for r in rows]
    assert gb._gemv_many(ws, xd.ptr, [y.ptr for y in ys])
    for (_, _, ref), y in zip(mats, ys):
        got = gb.to_host(y)
        err = rel_err(got, x.astype("float64") @ ref.T.astype("float64"))
        report("gemv2x", rows=rows, cols=cols, fmt=fmt, rel_err=err)
        assert err < TOL


@pytest.mark.parametrize("version", ["v3", "v2", "v1"])
@pytest.mark.parametrize("S", [1, 3])
def test_linear_many_equals_linear(gb, rng, version, S):
    """linear_many gives linear's values for every matrix, whichever GEMV version: an int8 core's q_a | kv_a | wk
    with the f32 weights_proj beside them (two launches at v3), five matrices (more than one gemv2x launch)."""
    import numpy as np
    shapes = [(64, 256, "int8"), (40, 256, "int8"), (8, 256, "int8"), (4, 256, "f32"), (3, 256, "int8"),
              (6, 256, "int8"), (10, 256, "int8")]
    mats = [stored_matrix(r, c, f, rng) for r, c, f in shapes]
    ws = [qweight(gb, buf, lay) for buf, lay, _ in mats]
    x = rand(rng, S, 256)
    before = gb.gemv_kernels
    gb.gemv_kernels = version
    try:
        outs = [gb.to_host(o) for o in gb.linear_many(gb.upload(x), ws)]
    finally:
        gb.gemv_kernels = before
    for (_, _, ref), got in zip(mats, outs):
        assert got.shape == (S, ref.shape[0])
        assert rel_err(got, x.astype("float64") @ ref.T.astype("float64")) < TOL
    assert np.isfinite(np.concatenate([o.ravel() for o in outs])).all()


@pytest.mark.parametrize("rows,cols,fmt,group", LINEAR_SHAPES + [(98, 98, "int4", 32)])
@pytest.mark.parametrize("S", [2, 3, 4, 5, 8, 16])
def test_gemv2r_gives_every_row_of_a_few_rows_step(gb, rng, rows, cols, fmt, group, S):
    """gemv2r_<fmt> (a step of 2..8 rows, each weight chunk read once per launch and dotted with every staged row;
    o_proj's 16384 columns fit 3 rows a launch): every output element written (NaN-poisoned first), each row
    W x_j against a float64 reference; linear() takes it where the backend says it does."""
    import numpy as np
    buf, lay, ref = stored_matrix(rows, cols, fmt, rng, group=group or 64)
    w = qweight(gb, buf, lay)
    x = rand(rng, S, cols)
    y = gb.upload(np.full((S, rows), np.nan, np.float32))
    if not gb._gemv_rows(w, gb.upload(x).ptr, S, y.ptr):
        pytest.skip(f"gemv2r does not take {fmt} {rows}x{cols} (not vec_ok / alignment)")
    got = gb.to_host(y)
    assert np.isfinite(got).all()
    err = rel_err(got, x.astype("float64") @ ref.T.astype("float64"))
    report("gemv2r", shape=[rows, cols], fmt=fmt, S=S, rel_err=err)
    assert err < TOL
    if S <= gb._rows_gemv_max(w):
        same = gb.to_host(gb.linear(gb.upload(x), w))
        assert np.array_equal(same, got)


@pytest.mark.parametrize("rows,cols,fmt,group", [(2048, 6144, "int4", 64), (576, 6144, "int8", 0),
                                                 (256, 6144, "f32", 0), (77, 128, "int4", 64)])
@pytest.mark.parametrize("ks", [1, 2])
def test_gemv2r_row_equals_gemv2_on_that_row_bit_for_bit(gb, rng, rows, cols, fmt, group, ks):
    """At the same column split a gemv2r row is gemv2 on that row: the same chunks, the same fma order."""
    import numpy as np
    buf, lay, ref = stored_matrix(rows, cols, fmt, rng, group=group or 64)
    w = qweight(gb, buf, lay)
    S = 3
    x = rand(rng, S, cols)
    xd = gb.upload(x)
    before = gb.gemv_ks
    gb.gemv_ks = ks
    try:
        y = gb.upload(np.zeros((S, rows), np.float32))
        assert gb._gemv_rows(w, xd.ptr, S, y.ptr)
        rows_out = gb.to_host(y)
        for j in range(S):
            one = gb.to_host(gb.linear(gb.upload(x[j:j + 1]), w))
            assert np.array_equal(one[0], rows_out[j]), j
    finally:
        gb.gemv_ks = before
