"""Each numpy backend op against a direct formula (and, where transformers has the op, against it)."""

import numpy as np
import pytest

from coli.model.backend import cos_sin_table
from coli.model.numpy_backend import NumpyBackend, expert_ffn, topk_indices
from coli.weights import ExpertWeights
from tolerances import LIBM_REL, U32, assert_within, gamma, matmul_companion, rounding_bound, swiglu_bound, ulp32

B = NumpyBackend()
rng = np.random.default_rng(0)


def r(*shape):
    return rng.standard_normal(shape).astype(np.float32)


def test_rms_norm_matches_formula():
    x, w = r(5, 64), r(64)
    want = w * (x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-6))
    # against float64: square, a 64-long sum, /n, +eps, sqrt, 1/, two products; all terms positive or
    # relative, so the companion is |want| itself
    assert_within(B.rms_norm(x, w, 1e-6), want, rounding_bound(np.abs(want), 64 + 7), "rms_norm vs float64")


def test_layer_norm_matches_torch():
    torch = pytest.importorskip("torch")
    x, w, b = r(7, 32), r(32), r(32)
    want_t = torch.nn.functional.layer_norm(torch.tensor(x), (32,), torch.tensor(w), torch.tensor(b), 1e-6).numpy()
    x64 = x.astype(np.float64)
    xc = x64 - x64.mean(-1, keepdims=True)
    sd = np.sqrt((xc ** 2).mean(-1, keepdims=True) + 1e-6)
    want = xc / sd * w + b                                            # float64 formula
    # each float32 side vs float64: two 32-long reductions (mean, variance) and ~8 elementwise roundings;
    # the centred value also carries the mean's error, which scales with mean|x|
    bound = rounding_bound((np.abs(xc) + np.abs(x64).mean(-1, keepdims=True)) / sd * np.abs(w) + np.abs(b), 2 * 32 + 8)
    assert_within(B.layer_norm(x, w, b, 1e-6), want, bound, "numpy layer_norm vs float64")
    assert_within(want_t, want, bound, "torch layer_norm vs float64")


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
    for name, v, t in (("q", q, tq), ("k", k, tk)):
        # each output is a*c -/+ b*s: two products and a sum (depth 2), companion |a||c| + |b||s|
        a, bb = np.abs(v[..., 0::2].astype(np.float64)), np.abs(v[..., 1::2].astype(np.float64))
        c, s = np.abs(cos[:, None, :]), np.abs(sin[:, None, :])
        comp = np.concatenate([a * c + bb * s, bb * c + a * s], -1)    # [S, n, dr] in the output layout
        assert_within(B.rope(v, cos, sin, 0), t[0].transpose(0, 1).numpy(), rounding_bound(comp, 2, sides=2),
                      f"rope({name}) vs transformers")


def test_rope_offset_passes_the_rest_through():
    S, dr = 4, 8
    cos, sin = cos_sin_table(np.arange(S), dr, 1e4)
    x = r(S, 2, 20)
    y = B.rope(x, cos, sin, 12)
    np.testing.assert_array_equal(y[..., :12], x[..., :12])
    np.testing.assert_array_equal(y[..., 12:], B.rope(x[..., 12:], cos, sin, 0))   # same IEEE ops, same values


def test_cos_sin_table_matches_transformers():
    torch = pytest.importorskip("torch")
    dr, theta = 64, 1e6
    inv = 1.0 / (theta ** (torch.arange(0, dr, 2, dtype=torch.float) / dr))
    pos = torch.arange(0, 3000, 7).float()
    ang = pos[:, None] * inv[None]
    cos, sin = cos_sin_table(pos.numpy().astype(int), dr, theta)
    # Both sides compute inv_freq with a float32 pow (LIBM_ULPS each: numpy's AVX-512 pow is up to 1.8 ulp
    # off where torch's is 0.75, so they differ in some entries), then angle = pos * inv (one rounding each
    # side), then cos/sin (slope <= 1, LIBM_ULPS each of a result <= 1). At 2996 rad an angle's ulp is 2.4e-4.
    inv64 = 1.0 / theta ** (np.arange(0, dr, 2) / dr)
    p64 = pos.numpy().astype(np.float64)[:, None]
    d_ang = p64 * 2 * (LIBM_REL + gamma(2)) * inv64[None] + ulp32(p64 * inv64[None])      # [S, dr/2]
    bound = d_ang + 2 * LIBM_REL
    assert_within(cos, ang.cos().numpy(), bound, "cos table vs transformers")
    assert_within(sin, ang.sin().numpy(), bound, "sin table vs transformers")


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
    # The absorbed float32 path: scores q_nope @ w_kb @ lat.T + q_pe @ kpe.T (depth dn + Lkv + dr + 2),
    # bounded by their companion; softmax turns a score error e into a relative error <= 2e of p (plus exp
    # and the normalising sum over T); then p @ lat @ w_v.T adds T + Lkv roundings.
    a64 = lambda m: np.abs(m.astype(np.float64))
    s_comp = 0.3 * (np.einsum("shd,hdl,tl->hst", a64(q[..., :dn]), a64(w[:, :dn]), a64(lat))
                    + np.einsum("shd,td->hst", a64(q[..., dn:]), a64(kpe)))                 # [nh, S, T]
    ds = np.where(allowed[None], gamma(dn + Lkv + dr + 2) * s_comp, 0).max(-1, keepdims=True)  # [nh, S, 1]
    rel_p = 2 * ds + LIBM_REL + gamma(T + 2)
    o_comp = np.einsum("hst,tl,hdl->shd", p, a64(lat), a64(w[:, dn:]))                       # [S, nh, dv]
    bound = (rel_p.transpose(1, 0, 2) + gamma(T + Lkv)) * o_comp
    assert_within(got, want, bound.reshape(S, nh * dv), "absorbed MLA vs float64 expanded attention")


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
    # A logit error e (H roundings over |x| @ |gw|.T) moves sigmoid's p by a relative <= e (slope of log
    # sigmoid <= 1), plus exp/add/divide; normalising over K doubles the worst relative error and adds K + 2.
    d_logit = rounding_bound(matmul_companion(x, gw), H)                                      # [S, E]
    rel_p = d_logit + LIBM_REL + gamma(2)
    for s in range(9):
        got = dict(zip(idx[s].tolist(), w[s].tolist()))
        want = dict(zip(ti[s].tolist(), tw[s].tolist()))
        assert got.keys() == want.keys()
        rel_w = 2 * (2 * rel_p[s, idx[s]].max() + gamma(K + 2))                                # two sides
        for e in got:
            assert_within(got[e], want[e], rel_w * abs(want[e]), f"router weight of expert {e}, token {s}")


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
    # batched and one-row BLAS calls sum in different orders: each expert's SwiGLU bound, weighted, plus
    # the K-long accumulation over |w * y|
    bound = np.zeros((S, H))
    for s in range(S):
        for k in range(K):
            ew = experts[int(idx[s, k])]
            y = np.abs(expert_ffn(x[s:s + 1], ew.gate, ew.up, ew.down)[0].astype(np.float64))
            bound[s] += w[s, k] * (swiglu_bound(x[s:s + 1], ew.gate, ew.up, ew.down)[0] + 2 * gamma(K + 1) * y)
    assert_within(got, want, bound, "moe vs per-token loop")


def test_swiglu_formula():
    x, g, u, d = r(3, 8), r(5, 8), r(5, 8), r(8, 5)
    silu = lambda v: v / (1 + np.exp(-v))
    assert_within(B.swiglu(x, g, u, d), (silu(x @ g.T) * (x @ u.T)) @ d.T, swiglu_bound(x, g, u, d), "swiglu vs formula")


def test_topk_indices():
    s = np.array([[0.1, 0.9, 0.5, 0.7]], np.float32)
    assert set(topk_indices(s, 2)[0].tolist()) == {1, 3}
    assert sorted(topk_indices(s, 9)[0].tolist()) == [0, 1, 2, 3]
