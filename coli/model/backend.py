"""The small interface the forward pass is written against.

A backend owns where arrays live (host numpy, or device memory for the CUDA backend) and
implements the handful of operations the GLM-5 forward needs. The forward (`forward.py`) only
composes these; it never touches array storage itself, so the same model code runs on every
backend and the numpy backend is the token-exact reference.

Dimension legend: see `coli.config`. S = query positions in this call, T = key positions (cached
+ new), A = any leading shape.
"""

from __future__ import annotations

from typing import Any, Iterable, Protocol, Sequence

import numpy as np

Array = Any  # backend-specific array (np.ndarray for the numpy backend)


class Backend(Protocol):
    name: str

    # -- storage -----------------------------------------------------------------------------
    def upload(self, host: np.ndarray) -> Array: ...               # float32 host tensor -> backend
    def to_host(self, x: Array) -> np.ndarray: ...
    def empty(self, shape: tuple[int, ...]) -> Array: ...          # float32, contents undefined
    def write_rows(self, dst: Array, start: int, src: Array) -> None: ...  # dst[start:start+n] = src
    def rows(self, x: Array, n: int) -> Array: ...                  # view of x[:n]
    def row_range(self, x: Array, start: int, n: int) -> Array: ... # view of x[start:start+n] (a batch's segment)
    def place_rows(self, dst: Array, start: int, src: Array) -> None: ...  # dst[start:start+n] = src, a step's own
    # arrays (write_rows is the KV-cache write, which a captured decode step redirects to the step's position)
    # weights: a backend may keep matrices in the source's stored format (the CUDA backend keeps the
    # container's quantised tiles); `linear`, `embed`, `swiglu`, `route` and `mla_attend` accept them
    def weight(self, src: Any, name: str) -> Array: ...            # matrix `name` of a WeightSource
    def kv_b(self, src: Any, name: str, nh: int, dn: int, dv: int) -> tuple[Array, Array]: ...
    # kv_b_proj [nh*(dn+dv), Lkv] -> per-head key rows w_kb [nh, dn, Lkv] and value rows w_vb [nh, dv, Lkv]

    # -- elementwise / normalisation ---------------------------------------------------------
    def embed(self, table: Array, ids: np.ndarray) -> Array: ...   # [V, H], [S] -> [S, H]
    def add(self, a: Array, b: Array) -> Array: ...
    def rms_norm(self, x: Array, w: Array, eps: float) -> Array: ...            # [A, D]
    def layer_norm(self, x: Array, w: Array, b: Array, eps: float) -> Array: ...  # [A, D]
    def linear(self, x: Array, w: Array) -> Array: ...             # [S, in] @ [out, in].T -> [S, out]
    def linear_many(self, x: Array, ws: Sequence[Array]) -> list[Array]: ...  # [linear(x, w) for w in ws], the same
    # values; a backend may compute matrices that read the same x together (the CUDA backend: one launch)
    def split_cols(self, x: Array, n: int) -> tuple[Array, Array]: ...  # [S, D] -> [S, n], [S, D-n]
    def last_row(self, x: Array) -> Array: ...                           # [S, D] -> [1, D]
    def rope(self, x: Array, cos: np.ndarray, sin: np.ndarray, offset: int) -> Array: ...
    # x [S, n, d]: rotates the interleaved pairs in x[..., offset:offset+dr] (cos/sin [S, dr/2]) and lays
    # the span out [evens' | odds'] like transformers; the rest passes through

    # -- fused ops: a backend may run each as one launch (the CUDA backend: a replayed decode layer has fewer graph
    # nodes); the defaults compose the ops above, so a fused op's values are those of its composition, bit for bit
    def add_rms_norm(self, h: Array, a: Array, w: Array, eps: float, a2: Array | None = None) -> tuple[Array, Array]:
        """The residual add and the next RMSNorm: (s, rms_norm(s, w, eps)), both [A, D], s = h + a, or h + (a + a2)
        with a2 (a MoE layer's routed and shared sums, added first as the MLP adds them)."""
        s = self.add(h, a if a2 is None else self.add(a, a2))
        return s, self.rms_norm(s, w, eps)

    def norm_many(self, rms: Sequence[tuple[Array, Array]], eps: float,
                  layer: tuple[Array, Array, Array, float] | None = None) -> list[Array]:
        """[rms_norm(x, w, eps) for (x, w) in rms], then layer_norm(x, w, b, eps') where layer = (x, w, b, eps') is
        given: the norms of an attention's first projections (the q_a and kv_a latents, the indexer key; same rows)."""
        out = [self.rms_norm(x, w, eps) for x, w in rms]
        return out if layer is None else out + [self.layer_norm(*layer)]

    def rope_many(self, xs: Sequence[tuple[Array, int]], cos: np.ndarray, sin: np.ndarray) -> list[Array]:
        """[rope(x, cos, sin, offset) for (x, offset) in xs]: several tensors [S, n_k, d_k] with the same angles."""
        return [self.rope(x, cos, sin, off) for x, off in xs]

    def write_rows_many(self, pairs: Sequence[tuple[Array, Array]], start: int) -> None:
        """write_rows(dst, start, src) for every (dst, src) (a layer's cache write: latent, rope key, indexer key)."""
        for dst, src in pairs:
            self.write_rows(dst, start, src)

    # -- attention -----------------------------------------------------------------------------
    def mla_attend(self, q: Array, lat: Array, k_pe: Array, w_kb: Array, w_vb: Array,
                   allowed: np.ndarray, scale: float) -> Array: ...
    # absorbed MLA: q [S, nh, dn+dr] (rope part last, rotated), lat [T, Lkv], k_pe [T, dr],
    # w_kb [nh, dn, Lkv], w_vb [nh, dv, Lkv], allowed [S, T] bool -> [S, nh*dv]
    def indexer_select(self, iq: Array, k_idx: Array, head_w: Array, positions: np.ndarray,
                       index_topk: int) -> np.ndarray: ...
    # iq [S, ih, ihd], k_idx [T, ihd], head_w [S, ih] (unscaled weights_proj output)
    # -> allowed [S, T] (causal AND top-k): a host bool array on the numpy backend; any backend-specific
    #    form (the CUDA backend's DeviceMask stays on the device) that this backend's mla_attend reads

    # -- MLPs ------------------------------------------------------------------------------------
    def swiglu(self, x: Array, gate: Array, up: Array, down: Array) -> Array: ...  # [S, H] -> [S, H]
    def route(self, x: Array, gate_w: Array, bias: Array, n_group: int, topk_group: int, top_k: int,
              norm_topk_prob: bool, scaling: float) -> tuple[np.ndarray, np.ndarray]: ...
    # -> idx [S, K] int64 (host), weights [S, K] float32 (host)
    def moe(self, x: Array, idx: np.ndarray, weights: np.ndarray, experts: Iterable[tuple[int, Any]]) -> Array: ...
    # experts: (expert id, ExpertWeights) pairs, each id of idx once, in any order -> routed sum [S, H]
    # (the CUDA backend also takes device record handles, coli.gpu.cuda_weights.DeviceRecord)

    # -- logits --------------------------------------------------------------------------------------------
    def argmax(self, x: Array) -> np.ndarray: ...   # [S, V] -> [S] int64, first maximum (greedy decoding)


def cos_sin_table(positions: Sequence[int] | np.ndarray, dim: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """RoPE angles as transformers computes them: inv_freq and angles in fp32. -> cos, sin [S, dim/2]."""
    exponent = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
    inv_freq = (np.float32(1.0) / np.power(np.float32(theta), exponent, dtype=np.float32)).astype(np.float32)
    ang = np.asarray(positions, dtype=np.float32)[:, None] * inv_freq[None, :]  # [S, dim/2]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
