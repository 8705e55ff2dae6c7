"""Element-wise kernels, norms, rope, embedding gather, lm_head + argmax against numpy (GLM-5 shapes included)."""

from __future__ import annotations

import numpy as np
import pytest

from coli.container.format import MatrixLayout
from coli.model.backend import cos_sin_table
from coli.model.numpy_backend import NumpyBackend
from gpu_helpers import TOL, qweight, rand, random_quantised, rel_err

pytestmark = pytest.mark.gpu
NP = NumpyBackend()


# 8,192 is the widest row the kernel keeps in registers (NORM_U x NORM_THREADS); 9,000 and 20,000 take the loop that
# re-reads the row
@pytest.mark.parametrize("S,D", [(1, 6144), (7, 6144), (3, 2048), (5, 512), (4, 128), (2, 100), (1, 8192), (2, 9000),
                                 (1, 20000)])
def test_rmsnorm(gb, rng, S, D):
    x, w = rand(rng, S, D, scale=3.0), rand(rng, D) + 1
    got = gb.to_host(gb.rms_norm(gb.upload(x), gb.upload(w), 1e-5))
    assert rel_err(got, NP.rms_norm(x, w, 1e-5)) < 1e-6


@pytest.mark.parametrize("S,D", [(1, 128), (9, 128), (3, 32), (2, 1000)])
def test_layernorm(gb, rng, S, D):
    x, w, b = rand(rng, S, D, scale=2.0) + 0.5, rand(rng, D) + 1, rand(rng, D)
    got = gb.to_host(gb.layer_norm(gb.upload(x), gb.upload(w), gb.upload(b), 1e-6))
    assert rel_err(got, NP.layer_norm(x, w, b, 1e-6)) < 1e-6


@pytest.mark.parametrize("S,n,d,off,dr", [(1, 64, 256, 192, 64), (5, 64, 256, 192, 64), (3, 32, 128, 0, 64),
                                          (4, 1, 64, 0, 64), (6, 4, 48, 32, 16), (2, 32, 32, 0, 16)])
def test_rope(gb, rng, S, n, d, off, dr):
    x = rand(rng, S, n, d)
    pos = np.arange(17, 17 + S)
    cos, sin = cos_sin_table(pos, dr, 1e6)
    got = gb.to_host(gb.rope(gb.upload(x).reshape(S, n, d), cos, sin, off))
    np.testing.assert_array_equal(got, NP.rope(x, cos, sin, off))


def test_add_split_last_row_silu(gb, rng):
    a, b = rand(rng, 5, 576), rand(rng, 5, 576)
    da, db = gb.upload(a), gb.upload(b)
    np.testing.assert_array_equal(gb.to_host(gb.add(da, db)), a + b)
    lat, kpe = gb.split_cols(da, 512)
    np.testing.assert_array_equal(gb.to_host(lat), a[:, :512])
    np.testing.assert_array_equal(gb.to_host(kpe), a[:, 512:])
    l1, k1 = gb.split_cols(gb.last_row(da), 512)
    np.testing.assert_array_equal(gb.to_host(l1), a[-1:, :512])
    np.testing.assert_array_equal(gb.to_host(k1), a[-1:, 512:])
    h = gb.to_host(gb.silu_mul(da, db))
    assert rel_err(h, a / (1 + np.exp(-a)) * b) < 1e-6


def test_embed_and_lm_head_argmax_at_glm5_vocab(gb, rng):
    V, H = 154880, 6144
    data, meta, _ = random_quantised(V, H, "int4", 64, rng)
    lay = MatrixLayout.make(V, H, "int4", 64, 512)
    from coli.container.quant import dequantize, encode_matrix
    table = qweight(gb, encode_matrix(lay, data, meta), lay)
    ids = np.array([0, 154879, 77777, 5, 77777])
    got = gb.to_host(gb.embed(table, ids))
    ref = dequantize(data[ids], meta[ids], "int4", 64, H)
    np.testing.assert_array_equal(got, ref)
    hn = rand(rng, 1, H)
    logits_d = gb.linear(gb.upload(hn), table)
    logits = gb.to_host(logits_d)[0]
    rows = np.sort(rng.choice(V, 4096, replace=False))
    want = hn[0] @ dequantize(data[rows], meta[rows], "int4", 64, H).T
    assert rel_err(logits[rows], want) < TOL
    assert int(gb.argmax(logits_d)[0]) == int(np.argmax(logits))


def test_argmax_first_maximum(gb, rng):
    x = rand(rng, 3, 154880)
    x[1, 100] = x[1, 90000] = x[1].max() + 1          # a tie: the first index wins, like np.argmax
    x[2, -1] = 50.0
    assert gb.argmax(gb.upload(x)).tolist() == np.argmax(x, axis=-1).tolist() == [int(np.argmax(x[0])), 100, 154879]
