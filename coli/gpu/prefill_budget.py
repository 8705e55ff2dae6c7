"""How many prompt tokens one step may feed while the experts stream (`coli up --prefill-chunk`, default auto), and
the GPU memory those rows take, which the VRAM budget reserves before it sizes the expert slots (coli/gpu/setup.py).

Why large chunks while streaming: a step copies the union of its rows' experts, and 128 GLM-5 tokens already route to
~250 of a layer's 256 experts (uniform top-8: 256 * (1 - (1 - 8/256)^128) = 251.6), so every chunk costs about one
copy of every expert; a 2,048-token prompt fed in 128-token chunks copies the model 16 times, in one chunk once.

What a step's rows cost on the CUDA backend, per row (f32 unless said; the memory pool reuses a layer's buffers at
the next layer, so one layer's set is the peak):
- attention: q_lora [q_lora_rank], q [nh * dq], the new latent and rope key [Lkv + dr], o [nh * dv]; the indexer's
  query [ih * id] and head weights [ih]; the top-k mask's indices [index_topk] int32. The absorbed query and the
  context ([nh, Lkv] each, 256 KB a row at GLM-5's shape, the largest per-row buffers) are made ATTN_PREFILL_ROWS rows
  at a time (cuda_backend._mla_attend_blocks): at most that many rows' worth, whatever the chunk. The split attention's partials are capped (attention_split.PARTIAL_CAP_BYTES) and the
  indexer's [S, T] scores are chunked (cuda_backend.INDEXER_CHUNK_BYTES): both are in the fixed workspace.
- the residual stream, the normed input and the block outputs: ~6 x [H]; the dense MLP's gate and up [I] (the
  first layers), the shared expert's [Im * n_shared], the router's scores [E] and top-k [K] (ids and weights).
- the grouped MoE prefill's [K, H] partial outputs plus the split activations (cuda_backend._moe_prefill_mma's
  per_token), chunked at cuda_backend.PREFILL_CHUNK_BYTES: min(rows x per_token, that); plus x's split of the other
  chunks, which the step keeps for its later batches of experts (H x 19/4 bytes a row past the first chunk).
The numpy backend's bound is its attention's [nh, S, T] scores (coli/model/numpy_backend.py mla_attend): there auto
keeps step_tokens (its step's cost is its arithmetic, which grows with the tokens)."""

from __future__ import annotations

from coli.config import ModelConfig

AUTO_SHARE = 8          # auto: the chunk's rows may take at most 1/AUTO_SHARE of the VRAM budget
AUTO_CAP = 8192         # ... and at most this many tokens (the largest `coli bench stream --prefill` measures)
PREFILL_CHUNK_BYTES = 1 << 30     # cuda_backend.PREFILL_CHUNK_BYTES (not imported: this module stays pure)
ATTN_PREFILL_ROWS = 512           # cuda_backend.ATTN_PREFILL_ROWS (the same)


def row_bytes(cfg: ModelConfig) -> int:
    """Activation bytes one step row holds on the CUDA backend, outside the chunked MoE buffers (docstring)."""
    nh, H = cfg.num_attention_heads, cfg.hidden_size
    dq = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    Lkv, dr = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    attn = cfg.q_lora_rank + nh * dq + Lkv + dr + nh * cfg.v_head_dim
    indexer = cfg.index_n_heads * cfg.index_head_dim + cfg.index_n_heads + cfg.index_topk
    mlp = 6 * H + 2 * cfg.intermediate_size + 2 * cfg.moe_intermediate_size * max(1, cfg.n_shared_experts)
    router = cfg.n_routed_experts + 2 * cfg.num_experts_per_tok
    return 4 * (attn + indexer + mlp + router)


def split_bytes(values: int) -> int:
    """Bytes of the tensor cores' int8 split of `values` fp32 values: four parts and their metadata, 19/4 a value."""
    return values * 19 // 4


def moe_token_bytes(cfg: ModelConfig) -> int:
    """cuda_backend._moe_prefill_mma's per_token: Y [K, H] f32 + split h [K, Im] + split x [H]."""
    K, H, Im = cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size
    return K * H * 4 + split_bytes(K * Im) + split_bytes(H)


def attention_block_bytes(cfg: ModelConfig, rows: int) -> int:
    """The absorbed queries and contexts of one block of a prefill's attention: min(rows, ATTN_PREFILL_ROWS) x
    2 x [nh, Lkv] f32."""
    return min(int(rows), ATTN_PREFILL_ROWS) * 2 * cfg.num_attention_heads * cfg.kv_lora_rank * 4


def moe_workspace_bytes(cfg: ModelConfig, rows: int) -> int:
    """The grouped MoE prefill's buffers for a step of `rows` tokens: one chunk's (rows capped so a chunk stays
    within PREFILL_CHUNK_BYTES, as the backend cuts it) and x's split of every other chunk (kept for the step)."""
    per = moe_token_bytes(cfg)
    chunk = max(1, PREFILL_CHUNK_BYTES // per)
    return min(rows, chunk) * per + max(0, rows - chunk) * split_bytes(cfg.hidden_size)


def prefill_workspace_bytes(cfg: ModelConfig, rows: int) -> int:
    """GPU bytes a step of `rows` tokens takes beyond the fixed workspace: its activations, its attention's block
    and its MoE buffers."""
    return rows * row_bytes(cfg) + attention_block_bytes(cfg, rows) + moe_workspace_bytes(cfg, rows)


def auto_prefill_chunk(cfg: ModelConfig, budget_bytes: int, max_context: int, step_tokens: int) -> int:
    """The default prefill chunk on the GPU: the largest power of two up to min(AUTO_CAP, max_context) whose step
    takes at most 1/AUTO_SHARE of the VRAM budget; never below step_tokens (the budget it replaces)."""
    top = max(1, min(AUTO_CAP, int(max_context)))
    chunk = 1
    while chunk * 2 <= top and prefill_workspace_bytes(cfg, chunk * 2) * AUTO_SHARE <= budget_bytes:
        chunk *= 2
    return max(chunk, min(step_tokens, top))
