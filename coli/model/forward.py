"""The GLM-5 (`glm_moe_dsa`) forward pass, written once over the backend interface.

    h = embed[ids]
    for each layer: h += Attention(RMSNorm(h)); h += (DenseMLP | MoE)(RMSNorm(h))
    logits = lm_head(RMSNorm(h))

Attention is MLA with the compressed cache (absorbed form) masked by the DSA indexer's top-k;
the MoE block routes with sigmoid scores + correction bias (group-limited top-k) and asks its
expert source for the chosen experts of the whole layer in one call — the seam where the
runtime's RAM tier and VRAM cache plug in. Shapes use the legend in `coli.config`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Protocol, Sequence

import numpy as np

from coli.config import ModelConfig
from coli.model.backend import Array, Backend, cos_sin_table
from coli.model.cache_pool import CachePool
from coli.model.kv_cache import KVCache
from coli.weights import ExpertWeights, WeightSource


class ExpertSource(Protocol):
    """Provides a MoE layer's routed experts: all of a step's choices are asked for in one batched
    call, and experts are yielded as they become available (hits first, misses as their reads land).
    A yielded ExpertWeights is only valid until the next one is requested: a runtime source may
    recycle its memory (the RAM tier's slots) once the consumer moves on."""

    def stream(self, layer: int, ids: list[int]) -> Iterator[tuple[int, ExpertWeights]]: ...

    # Optional: `begin_step(tokens)`, called when a forward step of `tokens` rows begins, before its first layer
    # (begin_step below). The VRAM cache (coli/gpu/vram_experts.py) starts a long prefill's first MoE layer's copies
    # there; a source without it has nothing to start, and a wrapper around one must pass it on.


def begin_step(experts, tokens: int) -> None:
    """Tell the expert source that a step of `tokens` rows begins, where it has the hook (ExpertSource's note)."""
    hook = getattr(experts, "begin_step", None)
    if hook is not None:
        hook(int(tokens))


class WeightExperts:
    """ExpertSource over a WeightSource that holds every expert (a checkpoint or a container)."""

    def __init__(self, weights: WeightSource):
        self.weights = weights

    def stream(self, layer: int, ids: list[int]) -> Iterator[tuple[int, ExpertWeights]]:
        for e in ids:
            yield e, self.weights.experts(layer, [e])[e]


# Called with (layer, idx [S, K], weights [S, K]) after each MoE router; used for routing traces
# (coli.trace.RoutingRecorder). With expert top-p on, pruned slots have idx -1 and weight 0.
RoutingHook = Callable[[int, np.ndarray, np.ndarray], None]

# Called with (layer, h, mlp_side) at every layer once its router has run and before its routed experts
# are asked for (coli.pilot: router lookahead). h [S, H] is the residual stream after the layer's attention
# add, before its MLP (the input of its post_attention_layernorm); mlp_side [S, H] is the shared expert's
# output on a MoE layer, the dense MLP's output on a dense one. Values are unchanged by it: only the
# shared expert is computed before the routed experts instead of after.
PilotHook = Callable[[int, Array, Array], None]

# Called with (layer, n_rows) at every MoE layer right after its router has run; returning (idx [S, K] int64,
# weights [S, K] float32) replaces the router's choice for those S rows (None keeps it). The router still runs,
# so its cost is paid and timed as in a real run; routing_hook sees the replacement. Benchmarks replay a stored
# trace this way (coli.bench.trace_router.TraceRouting).
RouteOverride = Callable[[int, int], "tuple[np.ndarray, np.ndarray] | None"]


@dataclass
class AttentionWeights:
    q_a: Array          # [Lq, H]
    q_a_norm: Array     # [Lq]
    q_b: Array          # [nh*(dn+dr), Lq]
    kv_a: Array         # [Lkv+dr, H]
    kv_a_norm: Array    # [Lkv]
    w_kb: Array         # [nh, dn, Lkv]  kv_b_proj rows of the key part, per head
    w_vb: Array         # [nh, dv, Lkv]  kv_b_proj rows of the value part, per head
    o: Array            # [H, nh*dv]
    # indexer ("full" layers only)
    idx_wq_b: Array | None = None    # [ih*ihd, Lq]
    idx_wk: Array | None = None      # [ihd, H]
    idx_k_norm_w: Array | None = None  # [ihd]
    idx_k_norm_b: Array | None = None  # [ihd]
    idx_weights: Array | None = None   # [ih, H]


@dataclass
class LayerWeights:
    input_norm: Array   # [H]
    post_norm: Array    # [H]
    attn: AttentionWeights
    # dense layers
    mlp_gate: Array | None = None    # [I, H]
    mlp_up: Array | None = None      # [I, H]
    mlp_down: Array | None = None    # [H, I]
    # MoE layers
    router: Array | None = None      # [E, H]
    router_bias: Array | None = None  # [E]
    shared_gate: Array | None = None  # [Im*ns, H]
    shared_up: Array | None = None    # [Im*ns, H]
    shared_down: Array | None = None  # [H, Im*ns]


def load_layer_weights(c: ModelConfig, src: WeightSource, backend: Backend, i: int, indexer: str | None = None,
                       mlp: str | None = None) -> LayerWeights:
    """Decoder layer i's weights; `indexer`/`mlp` override the config's kinds (the MTP layer lies outside them)."""
    indexer = indexer or c.indexer_types[i]
    mlp = mlp or c.mlp_layer_types[i]

    def up(name: str) -> Array:        # a vector (norm weight/bias), float32
        return backend.upload(src.dense(name))

    def mat(name: str) -> Array:       # a matrix; a backend may keep it in its stored (quantised) format
        return backend.weight(src, name)

    p = f"model.layers.{i}."
    a = p + "self_attn."
    nh, dn, dv = c.num_attention_heads, c.qk_nope_head_dim, c.v_head_dim
    w_kb, w_vb = backend.kv_b(src, a + "kv_b_proj.weight", nh, dn, dv)  # [nh, dn, Lkv], [nh, dv, Lkv]
    attn = AttentionWeights(
        q_a=mat(a + "q_a_proj.weight"),
        q_a_norm=up(a + "q_a_layernorm.weight"),
        q_b=mat(a + "q_b_proj.weight"),
        kv_a=mat(a + "kv_a_proj_with_mqa.weight"),
        kv_a_norm=up(a + "kv_a_layernorm.weight"),
        w_kb=w_kb,
        w_vb=w_vb,
        o=mat(a + "o_proj.weight"),
    )
    if indexer == "full":
        x = a + "indexer."
        attn.idx_wq_b = mat(x + "wq_b.weight")
        attn.idx_wk = mat(x + "wk.weight")
        attn.idx_k_norm_w = up(x + "k_norm.weight")
        attn.idx_k_norm_b = up(x + "k_norm.bias")
        attn.idx_weights = mat(x + "weights_proj.weight")
    lw = LayerWeights(up(p + "input_layernorm.weight"), up(p + "post_attention_layernorm.weight"), attn)
    if mlp == "dense":
        lw.mlp_gate, lw.mlp_up, lw.mlp_down = (mat(p + f"mlp.{n}.weight") for n in ("gate_proj", "up_proj", "down_proj"))
    else:
        lw.router = mat(p + "mlp.gate.weight")
        lw.router_bias = up(p + "mlp.gate.e_score_correction_bias")
        lw.shared_gate, lw.shared_up, lw.shared_down = (
            mat(p + f"mlp.shared_experts.{n}.weight") for n in ("gate_proj", "up_proj", "down_proj"))
    return lw


@dataclass
class AttentionInputs:
    """One layer's attention projections of S rows (GlmMoeDsaModel._attention_inputs)."""
    q: Array                     # [S, nh, dn+dr], rope part rotated
    lat: Array                   # [S, Lkv] normalised latent (what the cache stores)
    k_pe: Array                  # [S, dr] rotated rope key
    iq: Array | None = None      # [S, ih, ihd] indexer queries ("full" layers only)
    k_idx: Array | None = None   # [S, ihd] indexer keys
    head_w: Array | None = None  # [S, ih] indexer head weights

    def rows(self, b: Backend, start: int, n: int) -> "AttentionInputs":
        """Rows [start, start+n) of every field (one sequence's segment of a batch)."""
        def cut(a):
            return None if a is None else b.row_range(a, start, n)
        return AttentionInputs(cut(self.q), cut(self.lat), cut(self.k_pe), cut(self.iq), cut(self.k_idx),
                               cut(self.head_w))


def checked_ids(ids: Sequence[int], vocab_size: int, what: str) -> np.ndarray:
    """ids as int64 [S], or a ValueError naming the problem before anything runs: no position, or the first token
    outside the vocabulary."""
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    if ids.size == 0:
        raise ValueError(f"{what} needs at least one new position")
    if ids.min() < 0 or ids.max() >= vocab_size:
        bad = int(ids[(ids < 0) | (ids >= vocab_size)][0])
        raise ValueError(f"token id {bad} is outside the vocabulary (0..{vocab_size - 1})")
    return ids


class GlmMoeDsaModel:
    """Weights resident on a backend plus the forward pass. Routed experts come from `experts`."""

    def __init__(self, config: ModelConfig, weights: WeightSource, backend: Backend,
                 experts: ExpertSource | None = None):
        self.config = c = config
        self.backend = backend
        self.weights = weights        # kept for the MTP draft head (coli.model.mtp), which loads on demand
        self.experts = experts if experts is not None else WeightExperts(weights)
        self.embed = backend.weight(weights, "model.embed_tokens.weight")             # [V, H]
        self.layers = [load_layer_weights(c, weights, backend, i) for i in range(c.num_hidden_layers)]
        self.final_norm = backend.upload(weights.dense("model.norm.weight"))          # [H]
        self.lm_head = self.embed if c.tie_word_embeddings else backend.weight(weights, "lm_head.weight")
        self.routing_hook: RoutingHook | None = None
        self.pilot_hook: PilotHook | None = None
        self.route_override: RouteOverride | None = None
        # Expert top-p pruning (approximate, off = None = exact): routed experts of a token beyond the
        # fewest that carry this share of its routing weight are dropped (idx -1). See prune_topp.
        self.topp: float | None = None
        # A backend's replayed decode step (the CUDA backend's GraphDecoder, coli/gpu/graphs.py): greedy() asks it
        # first; it captures this forward once per cache shape and replays it (None: every step eager).
        make = getattr(backend, "graph_decoder", None)
        self.step_graphs = make(self) if make is not None else None
        # released caches' buffers, for the next cache of the same capacity (the same addresses: the replayed decode
        # graphs captured for them replay from its first step; coli/model/cache_pool.py)
        self.cache_pool = CachePool()

    def new_cache(self, capacity: int = 256) -> KVCache:
        """A cache of at least `capacity` positions (bucket(capacity)), from the pool when it has a released one;
        whoever owns its lifetime gives it back with `cache.release()`."""
        return KVCache.empty(self.config, self.backend, capacity, pool=self.cache_pool)

    # ------------------------------------------------------------------------------------------
    def forward(self, ids: Sequence[int], cache: KVCache, all_logits: bool = False) -> np.ndarray:
        """Run S new positions (prefill S > 1, decode S = 1) after the cache's `length` positions.

        Returns host float32 logits: [S, V] if all_logits else [1, V] for the last position.
        """
        return self.backend.to_host(self._logits(ids, cache, all_logits))

    def greedy(self, ids: Sequence[int], cache: KVCache) -> int:
        """Like forward(), but returns the greedy next token (first maximum of the last position's logits),
        taken on the backend so the logits stay where they are (the GPU). A decode step (one position) may be a
        replayed graph (step_graphs); the result is the same."""
        if self.step_graphs is not None:
            tok = self.step_graphs.greedy(ids, cache)
            if tok is not None:
                return tok
        return self.greedy_eager(ids, cache)

    def greedy_eager(self, ids: Sequence[int], cache: KVCache) -> int:
        """greedy() with every kernel issued from here (the reference of the replayed step)."""
        return int(self.backend.argmax(self._logits(ids, cache, False))[-1])

    def hidden_device(self, ids: Sequence[int], cache: KVCache) -> Array:
        """The last position's final-normed hidden state [1, H], left on the backend (a captured decode step
        computes it, keeps a copy and applies the lm_head)."""
        return self._final_hidden(ids, cache, False)

    def greedy_hidden(self, ids: Sequence[int], cache: KVCache) -> tuple[int, Array]:
        """greedy() and the last position's final-normed hidden state [1, H] on the backend (an MTP decoder's
        plain round queues it for the MTP layer): a replayed graph where greedy() would replay one with every
        expert resident, else eagerly; the same token either way."""
        if self.step_graphs is not None:
            got = self.step_graphs.greedy(ids, cache, hidden=True)
            if got is not None:
                return got
        hn = self._final_hidden(ids, cache, False)                      # [1, H]
        return int(self.backend.argmax(self.backend.linear(hn, self.lm_head))[-1]), hn

    def forward_hidden(self, ids: Sequence[int], cache: KVCache) -> tuple[Array, Array]:
        """Every new position's final-normed hidden state [S, H] and logits [S, V], both left on the backend: a
        speculative verification step (coli.model.mtp) reads all S logits and drafts from the hidden states."""
        hn = self._final_hidden(ids, cache, True)
        return hn, self.backend.linear(hn, self.lm_head)

    def _logits(self, ids: Sequence[int], cache: KVCache, all_logits: bool) -> Array:
        return self.backend.linear(self._final_hidden(ids, cache, all_logits), self.lm_head)   # [S or 1, V]

    def _final_hidden(self, ids: Sequence[int], cache: KVCache, all_rows: bool) -> Array:
        c, b = self.config, self.backend
        ids = checked_ids(ids, c.vocab_size, "forward()")
        S = int(ids.shape[0])
        start = cache.length
        cache.reserve(S)
        positions = np.arange(start, start + S)                        # [S]
        cos, sin = cos_sin_table(positions, c.qk_rope_head_dim, c.rope_theta)  # [S, dr/2]

        eps, layers = c.rms_norm_eps, self.layers
        begin_step(self.experts, S)                                    # a long prefill's first copies start here
        h = b.embed(self.embed, ids)                                   # [S, H]
        allowed = None                                                  # [S, T] from the last full indexer
        # every residual add runs with the RMSNorm that reads its sum as one op (add_rms_norm: one launch on the GPU,
        # the same bits): the post-attention norm, the next layer's input norm, and after the last layer the final
        # norm where it norms every row of h (all rows wanted, or one row)
        final_fused = all_rows or S == 1
        x = b.rms_norm(h, layers[0].input_norm, eps)                    # [S, H]
        for i, lw in enumerate(layers):
            nxt = layers[i + 1].input_norm if i + 1 < len(layers) else self.final_norm if final_fused else None
            h, x, allowed = self._layer(i, lw, h, x, positions, cos, sin, cache, start, allowed, nxt)
        cache.length = start + S

        if final_fused:
            return x                                                    # [S or 1, H]
        return b.rms_norm(b.last_row(h), self.final_norm, eps)         # [1, H]

    def _layer(self, i, lw: LayerWeights, h, x, positions, cos, sin, cache: KVCache, start, allowed, next_norm):
        """Decoder layer i on the residual stream h [S, H] and its normed input x [S, H] -> (h, x_next, allowed):
        h += Attention(x); h += MLP(RMSNorm(h)); x_next = RMSNorm(h) with next_norm's weight, from the residual add's
        own op (add_rms_norm; None without a next_norm)."""
        a, allowed = self._attention(i, lw.attn, x, positions, cos, sin, cache, start, allowed)
        h, x2 = self.backend.add_rms_norm(h, a, lw.post_norm, self.config.rms_norm_eps)   # [S, H] each
        h, x = self._add_mlp(h, *self._mlp(i, lw, x2, h), next_norm)
        return h, x, allowed

    def _add_mlp(self, h, mlp, mlp2, next_norm):
        """The layer's last residual add, h + mlp (+ mlp2: a MoE layer's routed and shared sums, added first), and
        the next RMSNorm of it in the same op where next_norm is given -> (h, x_next or None)."""
        b = self.backend
        if next_norm is None:
            return b.add(h, mlp if mlp2 is None else b.add(mlp, mlp2)), None
        return b.add_rms_norm(h, mlp, next_norm, self.config.rms_norm_eps, mlp2)

    # ------------------------------------------------------------------------------------------
    def _attention(self, i, w: AttentionWeights, x, positions, cos, sin, cache: KVCache, start, prev_allowed):
        p = self._attention_inputs(i, w, x, cos, sin)
        o, allowed = self._attention_segment(i, w, p, positions, cache, start, prev_allowed)
        return self.backend.linear(o, w.o), allowed

    def _attention_inputs(self, i, w: AttentionWeights, x, cos, sin) -> "AttentionInputs":
        """The row-wise part of attention: every projection of x [S, H] (rows may belong to different sequences:
        coli.model.batch runs it once over a whole batch), rope with each row's angles cos/sin [S, dr/2]."""
        c, b = self.config, self.backend
        S = x.shape[0]
        nh, dn, dr, Lkv = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.kv_lora_rank

        full = w.idx_wq_b is not None      # the layer's kind, from its weights (the MTP layer is outside the config)
        # the projections that read the same input are asked for together (the CUDA backend: one launch each)
        of_x = b.linear_many(x, [w.q_a, w.kv_a] + ([w.idx_wk, w.idx_weights] if full else []))
        lat, k_pe = b.split_cols(of_x[1], Lkv)                          # [S, Lkv], [S, dr]
        # the norms of the first projections as one op (norm_many: one launch on the GPU): both latents and the
        # indexer key's LayerNorm; q_lat also feeds the indexer
        normed = b.norm_many([(of_x[0], w.q_a_norm), (lat, w.kv_a_norm)], 1e-6,
                             (of_x[2], w.idx_k_norm_w, w.idx_k_norm_b, 1e-6) if full else None)
        q_lat, lat = normed[0], normed[1]                               # [S, Lq], [S, Lkv]
        of_q = b.linear_many(q_lat, [w.q_b] + ([w.idx_wq_b] if full else []))
        # every rope of the layer as one op (rope_many: one launch on the GPU), the same angles for all
        ropes = [(of_q[0].reshape(S, nh, dn + dr), dn),                # q: rope part last
                 (k_pe.reshape(S, 1, dr), 0)]                          # one rope key for all heads
        if full:
            ih, ihd = c.index_n_heads, c.index_head_dim
            ropes += [(of_q[1].reshape(S, ih, ihd), 0),                 # indexer queries: rope first
                      (normed[2].reshape(S, 1, ihd), 0)]                # indexer key [S, ihd], layer-normed
        roped = b.rope_many(ropes, cos, sin)

        p = AttentionInputs(roped[0], lat, roped[1].reshape(S, dr))    # q [S, nh, dn+dr] rotated, lat, k_pe [S, dr]
        if full:
            p.iq = roped[2]                                             # [S, ih, ihd]
            p.k_idx = roped[3].reshape(S, ihd)                          # [S, ihd]
            p.head_w = of_x[3]                                          # [S, ih] (scaled by ih^-0.5 inside)
        return p

    def _attention_segment(self, i, w: AttentionWeights, p: "AttentionInputs", positions, cache: KVCache, start,
                           prev_allowed):
        """The per-sequence part of attention for the S rows of p, one sequence at positions start..start+S-1:
        cache write, the indexer's selection (the previous full layer's `prev_allowed` on a shared one) and MLA.
        -> (o [S, nh*dv] before o_proj, allowed)."""
        c, b = self.config, self.backend
        T = start + p.q.shape[0]
        # the absorbed queries read only q: a backend may compute them beside the cache write and the indexer (a
        # captured step's second graph branch, CudaBackend.side: join() gives them); else mla_attend does
        side = getattr(b, "side", None)
        absorbed = side(lambda: b.mla_absorb(p.q, w.w_kb)) if side is not None else None
        cache.write(i, start, p.lat, p.k_pe, p.k_idx)
        lat_all, kpe_all, kidx_all = cache.view(i, T)                  # [T, Lkv], [T, dr], [T, ihd]
        if w.idx_wq_b is not None:   # a "full" layer (from its weights: the MTP layer is outside the config's kinds)
            allowed = b.indexer_select(p.iq, kidx_all, p.head_w, positions, c.index_topk)   # [S, T] bool, host
        else:
            allowed = prev_allowed                                      # shared layer reuses the top-k
        kw = {} if absorbed is None else {"q_abs": absorbed()}           # [S, nh, Lkv]
        o = b.mla_attend(p.q, lat_all, kpe_all, w.w_kb, w.w_vb, allowed, c.softmax_scale, **kw)  # [S, nh*dv]
        return o, allowed

    def _mlp(self, i, lw: LayerWeights, x2, h) -> tuple[Array, Array | None]:
        """Layer i's MLP of x2 [S, H] (h: the residual stream, for the pilot hook) as (out, None) on a dense layer and
        (routed, shared) on a MoE one, whose output is routed + shared: the residual add adds both in one op
        (add_rms_norm's a2, in the order routed + shared)."""
        c, b = self.config, self.backend
        if lw.router is None:
            dense = b.swiglu(x2, lw.mlp_gate, lw.mlp_up, lw.mlp_down)
            if self.pilot_hook is not None:
                self.pilot_hook(i, h, dense)
            return dense, None

        def shared_expert():
            return b.swiglu(x2, lw.shared_gate, lw.shared_up, lw.shared_down)
        # the shared expert before the routed experts when a pilot wants it, or when the backend can run it while
        # the routed experts' copies are on their way (a streaming step: coli/gpu/segments.py); else a backend may
        # run it beside the router and the routed experts (a captured step's second graph branch, CudaBackend.side:
        # join() gives it); else in place after them. The same values every way.
        first = self.pilot_hook is not None or getattr(b, "shared_first", False)
        side = None if first else getattr(b, "side", None)
        shared_after = (side(shared_expert) if side is not None else None) or shared_expert
        kw = {} if self.topp is None else {"topp": self.topp}
        idx, wts = b.route(x2, lw.router, lw.router_bias, c.n_group, c.topk_group, c.num_experts_per_tok,
                           c.norm_topk_prob, c.routed_scaling_factor, **kw)   # [S, K], [S, K]; -1 = pruned
        if not isinstance(idx, np.ndarray):
            # a decode step being captured (coli/gpu/graphs.py): the choice stayed on the device, the backend's slot
            # table serves it (a forced routing comes from the step's inputs); hooks and top-p are off there
            routed = b.moe_step(i, x2, idx)                              # [1, H]
            return routed, shared_after()
        if self.route_override is not None:
            forced = self.route_override(i, int(idx.shape[0]))
            if forced is not None:
                idx, wts = forced                                        # [S, K] int64, [S, K] float32
        if self.routing_hook is not None:
            self.routing_hook(i, idx, wts)
        wanted = sorted(e for e in set(idx.ravel().tolist()) if e >= 0)
        shared = shared_expert() if first else None
        if self.pilot_hook is not None:
            self.pilot_hook(i, h, shared)
        routed = b.moe(x2, idx, wts, self.experts.stream(i, wanted))    # [S, H]
        return routed, shared if first else shared_after()
