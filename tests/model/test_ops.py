"""Each numpy backend op against a direct formula (and, where transformers has the op, against it)."""

import numpy as np
import pytest

from coli.model.backend import cos_sin_table
from coli.model.numpy_backend import NumpyBackend, expert_ffn, topk_indices
from coli.weights import ExpertWeights

B = NumpyBackend()
rng = np.random.default_rng(0)


def r(*shape):
    return rng.standard_normal(shape).astype(np.float32)


def test_rms_norm_matches_formula():
    x, w = r(5, 64), r(64)
    want = w * (x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-6))
    np.testing.assert_allclose(B.rms_norm(x, w, 1e-6), want, rtol=2e-6, atol=1e-6)


def test_layer_norm_matches_torch():
    torch = pytest.importorskip("torch")
    x, w, b = r(7, 32), r(32), r(32)
    want = torch.nn.functional.layer_norm(torch.tensor(x), (32,), torch.tensor(w), torch.tensor(b), 1e-6).numpy()
    np.testing.assert_allclose(B.layer_norm(x, w, b, 1e-6), want, rtol=1e-5, atol=1e-5)


def test_rope_matches_transformers_interleave():
    torch = pytest.importorskip("torch")
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import apply_rotary_pos_emb_interleave
    S, n, dr = 6, 3, 16
    pos = np.arange(10, 10 + S)
    cos, sin = cos_sin_table(pos, dr, 1e6)
    q, k = r(S, n, dr), r(S, 1, dr)
    tcos = torch.tensor(np.concatenate([cos, cos], -1))[None]
    tsin = torch.tensor(np.concatenate([sin, sin], -1))[None]
    # transformers layout: [B, heads, S, d]
    tq, tk = apply_rotary_pos_emb_interleave(torch.tensor(q).transpose(0, 1)[None], torch.tensor(k).transpose(0, 1)[None], tcos, tsin)
    np.testing.assert_allclose(B.rope(q, cos, sin, 0), tq[0].transpose(0, 1).numpy(), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(B.rope(k, cos, sin, 0), tk[0].transpose(0, 1).numpy(), rtol=1e-6, atol=1e-6)


def test_rope_offset_passes_the_rest_through():
    S, dr = 4, 8
    cos, sin = cos_sin_table(np.arange(S), dr, 1e4)
    x = r(S, 2, 20)
    y = B.rope(x, cos, sin, 12)
    np.testing.assert_array_equal(y[..., :12], x[..., :12])
    np.testing.assert_allclose(y[..., 12:], B.rope(x[..., 12:], cos, sin, 0), rtol=1e-7)


def test_cos_sin_table_matches_transformers():
    torch = pytest.importorskip("torch")
    dr, theta = 64, 1e6
    inv = 1.0 / (theta ** (torch.arange(0, dr, 2, dtype=torch.float) / dr))
    pos = torch.arange(0, 3000, 7).float()
    ang = pos[:, None] * inv[None]
    cos, sin = cos_sin_table(pos.numpy().astype(int), dr, theta)
    np.testing.assert_allclose(cos, ang.cos().numpy(), atol=2e-6)
    np.testing.assert_allclose(sin, ang.sin().numpy(), atol=2e-6)


@pytest.mark.parametrize("S,T", [(1, 9), (5, 5), (3, 12)])
def test_absorbed_mla_equals_expanded_attention(S, T):
    nh, dn, dr, dv, Lkv = 4, 8, 4, 6, 10
    q, lat, kpe = r(S, nh, dn + dr), r(T, Lkv), r(T, dr)
    kv_b = r(nh * (dn + dv), Lkv)
    w = kv_b.reshape(nh, dn + dv, Lkv)
    allowed = rng.random((S, T)) < 0.7
    allowed[:, 0] = True
    got = B.mla_attend(q, lat, kpe, np.ascontiguousarray(w[:, :dn]), np.ascontiguousarray(w[:, dn:]), allowed, 0.3)
    # expanded (transformers') form
    kv = (lat.astype(np.float64) @ kv_b.T.astype(np.float64)).reshape(T, nh, dn + dv)
    k = np.concatenate([kv[..., :dn], np.broadcast_to(kpe[:, None, :], (T, nh, dr))], -1)  # [T, nh, dn+dr]
    v = kv[..., dn:]
    s = np.einsum("shd,thd->hst", q.astype(np.float64), k) * 0.3
    s = np.where(allowed[None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    want = np.einsum("hst,thd->shd", p, v).reshape(S, nh * dv)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_indexer_select_matches_brute_force():
    S, T, ih, ihd, topk = 6, 20, 4, 8, 5
    iq, K, hw = r(S, ih, ihd), r(T, ihd), r(S, ih)
    positions = np.arange(T - S, T)
    got = B.indexer_select(iq, K, hw, positions, topk)
    for s in range(S):
        score = np.array([sum(hw[s, h] * ih ** -0.5 * max(iq[s, h] @ K[t] / np.sqrt(ihd), 0) for h in range(ih))
                          for t in range(positions[s] + 1)])
        want = set(np.argsort(-score)[:topk].tolist())
        assert set(np.nonzero(got[s])[0].tolist()) == want


def test_indexer_select_is_causal_and_dense_when_short():
    iq, K, hw = r(4, 2, 8), r(4, 8), r(4, 2)
    got = B.indexer_select(iq, K, hw, np.arange(4), 8)
    np.testing.assert_array_equal(got, np.tril(np.ones((4, 4), bool)))


@pytest.mark.parametrize("n_group,topk_group", [(1, 1), (4, 2)])
def test_route_matches_transformers_router(n_group, topk_group):
    torch = pytest.importorskip("torch")
    from transformers import GlmMoeDsaConfig
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaTopkRouter
    E, H, K = 16, 32, 4
    cfg = GlmMoeDsaConfig(n_routed_experts=E, hidden_size=H, num_experts_per_tok=K, n_group=n_group, topk_group=topk_group)
    router = GlmMoeDsaTopkRouter(cfg)
    gw, bias, x = r(E, H), (0.05 * r(E)), r(9, H)
    with torch.no_grad():
        router.weight.copy_(torch.tensor(gw))
        router.e_score_correction_bias.copy_(torch.tensor(bias))
        _, tw, ti = router(torch.tensor(x))
    idx, w = B.route(x, gw, bias, n_group, topk_group, K, True, 2.5)
    for s in range(9):
        got = dict(zip(idx[s].tolist(), w[s].tolist()))
        want = dict(zip(ti[s].tolist(), tw[s].tolist()))
        assert got.keys() == want.keys()
        for e in got:
            assert abs(got[e] - want[e]) < 1e-6


def test_moe_equals_per_token_loop():
    S, H, Im, E, K = 5, 16, 8, 6, 3
    x = r(S, H)
    experts = {e: ExpertWeights(r(Im, H), r(Im, H), r(H, Im)) for e in range(E)}
    idx = np.stack([rng.choice(E, K, replace=False) for _ in range(S)])
    w = rng.random((S, K)).astype(np.float32)
    got = B.moe(x, idx, w, ((int(e), experts[int(e)]) for e in np.unique(idx)))
    want = np.zeros_like(x)
    for s in range(S):
        for k in range(K):
            ew = experts[int(idx[s, k])]
            want[s] += w[s, k] * expert_ffn(x[s:s + 1], ew.gate, ew.up, ew.down)[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_swiglu_formula():
    x, g, u, d = r(3, 8), r(5, 8), r(5, 8), r(8, 5)
    silu = lambda v: v / (1 + np.exp(-v))
    np.testing.assert_allclose(B.swiglu(x, g, u, d), (silu(x @ g.T) * (x @ u.T)) @ d.T, rtol=1e-5, atol=1e-6)


def test_topk_indices():
    s = np.array([[0.1, 0.9, 0.5, 0.7]], np.float32)
    assert set(topk_indices(s, 2)[0].tolist()) == {1, 3}
    assert sorted(topk_indices(s, 9)[0].tolist()) == [0, 1, 2, 3]
