"""Names and shapes of every tensor the forward pass reads (reference §2), as stored on disk.

Routed experts are named per expert on disk (`model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight`);
transformers fuses them in memory, we never do. Shapes are [out, in] like nn.Linear.
"""

from __future__ import annotations

import re

from coli.config import ModelConfig

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")
_EXPERT_RE = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def layer_of(name: str) -> int | None:
    m = _LAYER_RE.match(name)
    return int(m.group(1)) if m else None


def parse_expert_name(name: str) -> tuple[int, int, str] | None:
    """'model.layers.3.mlp.experts.7.up_proj.weight' -> (3, 7, 'up_proj')."""
    m = _EXPERT_RE.match(name)
    return (int(m.group(1)), int(m.group(2)), m.group(3)) if m else None


def expert_tensor_name(layer: int, expert: int, part: str) -> str:
    return f"model.layers.{layer}.mlp.experts.{expert}.{part}.weight"


def expert_shapes(c: ModelConfig) -> dict[str, tuple[int, int]]:
    """Shapes of one routed expert's three matrices, in record order gate -> up -> down."""
    H, Im = c.hidden_size, c.moe_intermediate_size
    return {"gate_proj": (Im, H), "up_proj": (Im, H), "down_proj": (H, Im)}


def layer_dense_shapes(c: ModelConfig, i: int, indexer: str | None = None,
                       mlp: str | None = None) -> dict[str, tuple[int, ...]]:
    """Every non-routed tensor of decoder layer i (attention, indexer, norms, dense MLP or router + shared expert).
    `indexer` ("full" | "shared") and `mlp` ("dense" | "sparse") default to the config's kinds of layer i; the MTP
    layer (i = num_hidden_layers, outside those lists) passes them."""
    H, nh = c.hidden_size, c.num_attention_heads
    indexer = indexer or c.indexer_types[i]
    mlp = mlp or c.mlp_layer_types[i]
    p = f"model.layers.{i}."
    s: dict[str, tuple[int, ...]] = {
        p + "input_layernorm.weight": (H,),
        p + "post_attention_layernorm.weight": (H,),
        p + "self_attn.q_a_proj.weight": (c.q_lora_rank, H),
        p + "self_attn.q_a_layernorm.weight": (c.q_lora_rank,),
        p + "self_attn.q_b_proj.weight": (nh * c.qk_head_dim, c.q_lora_rank),
        p + "self_attn.kv_a_proj_with_mqa.weight": (c.kv_lora_rank + c.qk_rope_head_dim, H),
        p + "self_attn.kv_a_layernorm.weight": (c.kv_lora_rank,),
        p + "self_attn.kv_b_proj.weight": (nh * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank),
        p + "self_attn.o_proj.weight": (H, nh * c.v_head_dim),
    }
    if indexer == "full":
        s.update({
            p + "self_attn.indexer.wq_b.weight": (c.index_n_heads * c.index_head_dim, c.q_lora_rank),
            p + "self_attn.indexer.wk.weight": (c.index_head_dim, H),
            p + "self_attn.indexer.k_norm.weight": (c.index_head_dim,),
            p + "self_attn.indexer.k_norm.bias": (c.index_head_dim,),
            p + "self_attn.indexer.weights_proj.weight": (c.index_n_heads, H),
        })
    if mlp == "dense":
        s.update({
            p + "mlp.gate_proj.weight": (c.intermediate_size, H),
            p + "mlp.up_proj.weight": (c.intermediate_size, H),
            p + "mlp.down_proj.weight": (H, c.intermediate_size),
        })
    else:
        Is = c.moe_intermediate_size * c.n_shared_experts
        s.update({
            p + "mlp.gate.weight": (c.n_routed_experts, H),
            p + "mlp.gate.e_score_correction_bias": (c.n_routed_experts,),
            p + "mlp.shared_experts.gate_proj.weight": (Is, H),
            p + "mlp.shared_experts.up_proj.weight": (Is, H),
            p + "mlp.shared_experts.down_proj.weight": (H, Is),
        })
    return s


def dense_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor except the routed experts: the 'dense core'."""
    s: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size)}
    for i in range(c.num_hidden_layers):
        s.update(layer_dense_shapes(c, i))
    s["model.norm.weight"] = (c.hidden_size,)
    if not c.tie_word_embeddings:
        s["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    return s


# The MTP layer (reference §4; DeepSeek-V3 layout, as vLLM's deepseek_mtp.py and SGLang's deepseek_nextn.py load
# it): layer index num_hidden_layers, a full decoder layer whose indexer is always "full" (vLLM builds a full indexer
# for it whatever the pattern says) and whose MLP is MoE, plus eh_proj / enorm / hnorm / shared_head.norm. Its
# `embed_tokens` and `shared_head.head` copies, where a checkpoint has them, equal the main embedding and lm_head
# (both engines load the main ones instead): they are not part of the layer here.
MTP_DUPLICATES = ("embed_tokens.weight", "shared_head.head.weight")


def mtp_layer(c: ModelConfig) -> int:
    return c.num_hidden_layers


def mtp_dense_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every non-routed tensor of the MTP layer (its routed experts are named like any layer's)."""
    L, H = mtp_layer(c), c.hidden_size
    p = f"model.layers.{L}."
    s: dict[str, tuple[int, ...]] = {p + "enorm.weight": (H,), p + "hnorm.weight": (H,), p + "eh_proj.weight": (H, 2 * H)}
    s.update(layer_dense_shapes(c, L, indexer="full", mlp="sparse"))
    s[p + "shared_head.norm.weight"] = (H,)
    return s


# Tensors that stay in full precision whatever the dense format (norms, router, its bias, the
# indexer's head weights): tiny, and the router/indexer decide discrete choices where rounding
# would flip experts or keys.
_FULL_PRECISION = re.compile(
    r"(layernorm|norm)\.(weight|bias)$|\.mlp\.gate\.weight$|e_score_correction_bias$|indexer\.weights_proj\.weight$"
)


def keep_full_precision(name: str) -> bool:
    return bool(_FULL_PRECISION.search(name))
