"""The numpy backend: float32 host arrays. The reference every other backend is checked against,
the CPU fallback for experts the GPU cannot serve, and the whole engine where there is no GPU."""

from __future__ import annotations

from typing import Any, Iterable

import numpy as np

from coli.model.backend import Backend

F32 = np.float32
# Bound the [rows, ih, T] indexer temporary of long prefills to ~64 MB.
_INDEXER_CHUNK_ELEMS = 16 * 1024 * 1024


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (F32(1.0) + np.exp(-x))


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return F32(1.0) / (F32(1.0) + np.exp(-x))


def topk_indices(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest entries of each row (unordered). scores [S, N] -> [S, k]."""
    if k >= scores.shape[-1]:
        return np.broadcast_to(np.arange(scores.shape[-1]), scores.shape).copy()
    return np.argpartition(-scores, k - 1, axis=-1)[..., :k]


def prune_topp(idx: np.ndarray, w: np.ndarray, p: float) -> tuple[np.ndarray, np.ndarray]:
    """Expert top-p pruning (approximate: changes the output). Per token keep the fewest of its routed
    experts whose normalised weights (w / sum w) add up to at least p (always at least one), and scale
    the kept weights so they sum to what all K summed to (routed_scaling_factor included).

    idx, w [S, K] -> idx [S, K] with -1 for dropped experts, w [S, K] with 0 for them; columns are
    reordered heaviest first. docs/policy.md measures what it saves and costs."""
    if not 0.0 < p <= 1.0:
        raise ValueError(f"expert top-p must be in (0, 1] (got {p})")
    order = np.argsort(-w, axis=-1, kind="stable")
    idx = np.take_along_axis(idx, order, axis=-1)
    w = np.take_along_axis(w, order, axis=-1)
    w64 = w.astype(np.float64)
    total = w64.sum(-1, keepdims=True)                                   # [S, 1]
    share = np.cumsum(w64 / np.where(total > 0, total, 1.0), axis=-1)    # [S, K] cumulative normalised mass
    n_keep = 1 + (share[:, :-1] < p).sum(-1)                             # [S]
    keep = np.arange(w.shape[-1])[None, :] < n_keep[:, None]
    kept = np.where(keep, w64, 0.0).sum(-1, keepdims=True)
    scale = np.where(kept > 0, total / np.where(kept > 0, kept, 1.0), 1.0)
    return np.where(keep, idx, -1), np.where(keep, w64 * scale, 0.0).astype(F32)


def expert_ffn(x: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray) -> np.ndarray:
    """SwiGLU: down(silu(x @ gate.T) * (x @ up.T)). x [S, H]; gate/up [Im, H]; down [H, Im] -> [S, H]."""
    return (_silu(x @ gate.T) * (x @ up.T)) @ down.T


class NumpyBackend(Backend):
    name = "numpy"

    def upload(self, host: np.ndarray) -> np.ndarray:
        return host if host.dtype == F32 else host.astype(F32)

    def to_host(self, x: np.ndarray) -> np.ndarray:
        return x

    def empty(self, shape: tuple[int, ...]) -> np.ndarray:
        return np.empty(shape, F32)

    def write_rows(self, dst: np.ndarray, start: int, src: np.ndarray) -> None:
        dst[start:start + src.shape[0]] = src

    def rows(self, x: np.ndarray, n: int) -> np.ndarray:
        return x[:n]

    def row_range(self, x: np.ndarray, start: int, n: int) -> np.ndarray:
        return x[start:start + n]

    def place_rows(self, dst: np.ndarray, start: int, src: np.ndarray) -> None:
        dst[start:start + src.shape[0]] = src

    def weight(self, src, name: str) -> np.ndarray:
        return self.upload(src.dense(name))

    def kv_b(self, src, name: str, nh: int, dn: int, dv: int) -> tuple[np.ndarray, np.ndarray]:
        kv_b = src.dense(name)
        kv_b = kv_b.reshape(nh, dn + dv, kv_b.shape[-1])                 # [nh, dn+dv, Lkv]
        return self.upload(np.ascontiguousarray(kv_b[:, :dn, :])), self.upload(np.ascontiguousarray(kv_b[:, dn:, :]))

    def argmax(self, x: np.ndarray) -> np.ndarray:
        return np.argmax(x, axis=-1).astype(np.int64)

    def embed(self, table: np.ndarray, ids: np.ndarray) -> np.ndarray:
        return np.array(table[np.asarray(ids, dtype=np.int64)], dtype=F32)  # [S, H]

    def add(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return a + b

    def rms_norm(self, x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
        var = np.mean(x * x, axis=-1, keepdims=True)
        return w * (x * (F32(1.0) / np.sqrt(var + F32(eps))))  # x * rsqrt(var + eps), as transformers

    def layer_norm(self, x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
        mu = np.mean(x, axis=-1, keepdims=True)
        xc = x - mu
        var = np.mean(xc * xc, axis=-1, keepdims=True)
        return xc / np.sqrt(var + F32(eps)) * w + b

    def linear(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        return x @ w.T

    def linear_many(self, x: np.ndarray, ws) -> list[np.ndarray]:
        return [self.linear(x, w) for w in ws]

    def split_cols(self, x: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
        return x[:, :n], x[:, n:]

    def last_row(self, x: np.ndarray) -> np.ndarray:
        return x[-1:]

    def rope(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray, offset: int) -> np.ndarray:
        # x [S, n, d]; the span [offset, offset+dr) holds interleaved pairs (x[2i], x[2i+1]); cos/sin
        # [S, dr/2]. The span comes back laid out [rotated evens | rotated odds], exactly as
        # transformers stores it (reference §3.2); the rest of x passes through.
        dr = 2 * cos.shape[-1]
        span = x[..., offset:offset + dr]
        a, b = span[..., 0::2], span[..., 1::2]
        c, s = cos[:, None, :], sin[:, None, :]
        out = np.array(x, dtype=F32)
        out[..., offset:offset + dr // 2] = a * c - b * s
        out[..., offset + dr // 2:offset + dr] = b * c + a * s
        return out

    def mla_attend(self, q, lat, k_pe, w_kb, w_vb, allowed, scale):
        # Absorbed MLA (kv_b_proj folded into query and output): per step O(T * nh * Lkv) instead of
        # re-expanding every cached latent to full keys/values as transformers does.
        dn = w_kb.shape[1]
        qh = np.ascontiguousarray(q.transpose(1, 0, 2))                 # [nh, S, dn+dr]
        q_abs = qh[..., :dn] @ w_kb                                      # [nh, S, Lkv]
        pe = qh[..., dn:]                                                # [nh, S, dr]
        scores = (q_abs @ lat.T + pe @ k_pe.T) * F32(scale)              # [nh, S, T]
        scores = np.where(allowed[None, :, :], scores, F32(-np.inf))
        scores -= scores.max(axis=-1, keepdims=True)
        p = np.exp(scores)
        p /= p.sum(axis=-1, keepdims=True)                               # softmax over T, fp32
        ctx = p @ lat                                                    # [nh, S, Lkv]
        o = ctx @ w_vb.transpose(0, 2, 1)                                # [nh, S, dv]
        S = q.shape[0]
        return np.ascontiguousarray(o.transpose(1, 0, 2)).reshape(S, -1)  # [S, nh*dv] head-major

    def indexer_scores(self, iq: np.ndarray, k_idx: np.ndarray, head_w: np.ndarray) -> np.ndarray:
        """index_score[s, t] = sum_h head_w[s, h]/sqrt(ih) * relu(iq[s, h] . k_idx[t] / sqrt(ihd)) -> [S, T]."""
        S, ih, ihd = iq.shape
        T = k_idx.shape[0]
        out = np.empty((S, T), F32)
        rows = max(1, _INDEXER_CHUNK_ELEMS // max(1, ih * T))
        scale = F32(ihd ** -0.5)
        head_w = head_w * F32(ih ** -0.5)                                # [S, ih]
        for s0 in range(0, S, rows):
            r = np.maximum((iq[s0:s0 + rows] @ k_idx.T) * scale, F32(0))  # [rows, ih, T]
            out[s0:s0 + rows] = (head_w[s0:s0 + rows, None, :] @ r)[:, 0, :]
        return out

    def indexer_select(self, iq, k_idx, head_w, positions, index_topk):
        # Row s sees keys t <= positions[s]; it keeps the min(index_topk, #visible) best of them
        # (equivalent to transformers' top-min(index_topk, T) over causally -inf-masked scores).
        T = k_idx.shape[0]
        positions = np.asarray(positions)
        visible = np.arange(T)[None, :] <= positions[:, None]           # [S, T]
        if int(positions.max()) + 1 <= index_topk:
            return visible
        scores = self.indexer_scores(iq, k_idx, head_w)
        allowed = visible.copy()
        for s in np.nonzero(positions + 1 > index_topk)[0]:
            n_vis = int(positions[s]) + 1
            keep = topk_indices(scores[s, :n_vis][None, :], index_topk)[0]
            allowed[s, :] = False
            allowed[s, keep] = True
        return allowed

    def swiglu(self, x, gate, up, down):
        return expert_ffn(x, gate, up, down)

    def route(self, x, gate_w, bias, n_group, topk_group, top_k, norm_topk_prob, scaling, topp=None):
        p = _sigmoid(x.astype(F32) @ gate_w.T)                           # [S, E] un-biased scores
        choice = p + bias                                                # bias only picks experts
        S, E = choice.shape
        if n_group > 1:
            grouped = choice.reshape(S, n_group, E // n_group)
            top2 = np.sort(grouped, axis=-1)[..., -2:].sum(-1)           # [S, G] group score
            keep = topk_indices(top2, topk_group)                        # [S, topk_group]
            gmask = np.zeros((S, n_group), bool)
            np.put_along_axis(gmask, keep, True, axis=-1)
            choice = np.where(np.repeat(gmask, E // n_group, axis=-1), choice, F32(-np.inf))
        idx = topk_indices(choice, top_k)                                # [S, K]
        w = np.take_along_axis(p, idx, axis=-1)
        if norm_topk_prob:
            w = w / (w.sum(-1, keepdims=True) + F32(1e-20))
        idx, w = idx.astype(np.int64), (w * F32(scaling)).astype(F32)
        if topp is not None:  # approximate: see prune_topp
            idx, w = prune_topp(idx, w, topp)
        return idx, w

    def moe(self, x, idx, weights, experts: Iterable[tuple[int, Any]]):
        # Each expert is one batched SwiGLU over the rows routed to it, computed as soon as the
        # source yields it (its memory may be recycled after).
        out = np.zeros_like(x)
        for e, ew in experts:
            rows, slot = np.nonzero(idx == e)
            y = expert_ffn(x[rows], ew.gate, ew.up, ew.down)              # [n, H]
            out[rows] += y * weights[rows, slot][:, None]  # an expert appears once per token: rows are unique
        return out
