"""Model configuration for `glm_moe_dsa` (GLM-5.x), read from a Hugging Face `config.json`.

Every field the forward pass needs is here, derived the way transformers 5.23 derives it
(`GlmMoeDsaConfig.__post_init__`): `indexer_types` from `index_topk_pattern` or
`index_topk_freq`/`index_skip_topk_offset`, `mlp_layer_types` from `first_k_dense_replace`,
rope theta from `rope_parameters` or the legacy `rope_theta`.

Dimension legend used across the model code:
    H   hidden_size                 V   vocab_size
    nh  num_attention_heads         Lq  q_lora_rank          Lkv kv_lora_rank
    dn  qk_nope_head_dim            dr  qk_rope_head_dim     dv  v_head_dim
    ih  index_n_heads               ihd index_head_dim
    E   n_routed_experts            K   num_experts_per_tok  Im  moe_intermediate_size
    I   intermediate_size (dense MLP)
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from coli.errors import ConfigError

MODEL_TYPE = "glm_moe_dsa"


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 154880
    hidden_size: int = 6144
    num_hidden_layers: int = 78
    intermediate_size: int = 12288
    moe_intermediate_size: int = 2048
    n_routed_experts: int = 256
    num_experts_per_tok: int = 8
    n_shared_experts: int = 1
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 2.5
    num_attention_heads: int = 64
    num_key_value_heads: int = 64
    q_lora_rank: int = 2048
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 192
    qk_rope_head_dim: int = 64
    v_head_dim: int = 256
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 2048
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_type: str = "default"
    # Extra softmax scale for non-default rope types with mscale_all_dim (1.0 for GLM-5).
    attention_mscale: float = 1.0
    max_position_embeddings: int = 202752
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    bos_token_id: int | None = 0
    eos_token_ids: tuple[int, ...] = (1,)
    pad_token_id: int | None = None
    # Per-layer kinds, length num_hidden_layers: "full" | "shared"; "dense" | "sparse".
    indexer_types: tuple[str, ...] = field(default_factory=tuple)
    mlp_layer_types: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        L = self.num_hidden_layers
        if not self.indexer_types:
            object.__setattr__(self, "indexer_types", derive_indexer_types(L))
        if not self.mlp_layer_types:
            object.__setattr__(self, "mlp_layer_types", ("dense",) * min(3, L) + ("sparse",) * max(L - 3, 0))
        self.validate()

    # ---- derived sizes -------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        return self.qk_head_dim ** -0.5 * self.attention_mscale

    @property
    def moe_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.mlp_layer_types) if t == "sparse"]

    @property
    def dense_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.mlp_layer_types) if t == "dense"]

    def kv_values_per_token(self) -> int:
        """Cached values per token: latent + rope key per layer, plus the indexer key on full layers."""
        full = sum(1 for t in self.indexer_types if t == "full")
        return self.num_hidden_layers * (self.kv_lora_rank + self.qk_rope_head_dim) + full * self.index_head_dim

    def validate(self) -> None:
        L = self.num_hidden_layers
        problems = []
        if len(self.indexer_types) != L:
            problems.append(f"indexer_types has {len(self.indexer_types)} entries for {L} layers")
        elif any(t not in ("full", "shared") for t in self.indexer_types):
            problems.append(f"indexer_types must be 'full' or 'shared', got {sorted(set(self.indexer_types))}")
        elif self.indexer_types[0] != "full":
            problems.append("indexer_types[0] must be 'full' (a shared layer reuses a previous full layer's top-k)")
        if len(self.mlp_layer_types) != L:
            problems.append(f"mlp_layer_types has {len(self.mlp_layer_types)} entries for {L} layers")
        elif any(t not in ("dense", "sparse") for t in self.mlp_layer_types):
            problems.append(f"mlp_layer_types must be 'dense' or 'sparse', got {sorted(set(self.mlp_layer_types))}")
        if self.n_group < 1 or self.n_routed_experts % self.n_group:
            problems.append(f"n_routed_experts {self.n_routed_experts} is not divisible by n_group {self.n_group}")
        if not 1 <= self.topk_group <= self.n_group:
            problems.append(f"topk_group {self.topk_group} must be in 1..n_group ({self.n_group})")
        if not 1 <= self.num_experts_per_tok <= self.n_routed_experts:
            problems.append(f"num_experts_per_tok {self.num_experts_per_tok} must be in 1..{self.n_routed_experts}")
        if self.n_group > 1 and self.n_routed_experts // self.n_group < 2:
            problems.append("group-limited routing needs at least 2 experts per group (groups score by their top-2)")
        if self.num_key_value_heads != self.num_attention_heads:
            problems.append("num_key_value_heads must equal num_attention_heads (MLA expands one latent to all heads)")
        if self.index_head_dim < self.qk_rope_head_dim:
            problems.append(f"index_head_dim {self.index_head_dim} < qk_rope_head_dim {self.qk_rope_head_dim}")
        if self.qk_rope_head_dim % 2:
            problems.append(f"qk_rope_head_dim {self.qk_rope_head_dim} must be even (RoPE rotates pairs)")
        if self.hidden_act != "silu":
            problems.append(f"hidden_act {self.hidden_act!r} is not supported (only 'silu')")
        if self.rope_type != "default":
            problems.append(f"rope_type {self.rope_type!r} is not supported (only 'default', as GLM-5 uses)")
        if problems:
            raise ConfigError("invalid glm_moe_dsa config: " + "; ".join(problems))

    # ---- (de)serialisation -----------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        d["indexer_types"] = list(self.indexer_types)
        d["mlp_layer_types"] = list(self.mlp_layer_types)
        return d

    def to_hf_dict(self) -> dict[str, Any]:
        """A config.json transformers' GlmMoeDsaConfig accepts and that reads back to this config."""
        d = self.to_dict()
        d.pop("eos_token_ids")
        d.pop("rope_theta")
        d.pop("rope_type")
        d.pop("attention_mscale")
        eos = list(self.eos_token_ids)
        d.update(
            model_type=MODEL_TYPE,
            architectures=["GlmMoeDsaForCausalLM"],
            eos_token_id=eos[0] if len(eos) == 1 else eos,
            rope_parameters={"rope_type": self.rope_type, "rope_theta": self.rope_theta},
            first_k_dense_replace=sum(1 for t in self.mlp_layer_types if t == "dense"),
            head_dim=self.qk_rope_head_dim,
        )
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        d = dict(d)
        d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
        d["indexer_types"] = tuple(d.get("indexer_types", ()))
        d["mlp_layer_types"] = tuple(d.get("mlp_layer_types", ()))
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ConfigError(f"unknown ModelConfig fields: {sorted(unknown)}")
        return cls(**d)


def derive_indexer_types(num_layers: int, pattern: Any = None, freq: int = 1, offset: int = 2) -> tuple[str, ...]:
    """transformers' rule: an explicit 'F'/'S' pattern, else layer i is full iff max(i-offset+1, 0) % freq == 0."""
    if pattern is not None:
        if isinstance(pattern, str):
            bad = set(pattern) - {"F", "S"}
            if bad:
                raise ConfigError(f"index_topk_pattern {pattern!r} may only contain 'F' and 'S', found {sorted(bad)}")
            return tuple({"F": "full", "S": "shared"}[c] for c in pattern)
        return tuple(pattern)
    freq = max(int(freq), 1)
    return tuple("full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(num_layers))


def _rope_from_hf(raw: dict[str, Any], path: str) -> tuple[float, str, float]:
    rp = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(rp, dict):
        raise ConfigError(f"{path}: rope_parameters must be an object, got {type(rp).__name__}")
    theta = rp.get("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = rp.get("rope_type", rp.get("type", "default")) or "default"
    mscale = 1.0
    if rope_type != "default" and rp.get("mscale_all_dim"):
        factor = float(rp["factor"])
        m = 0.1 * float(rp["mscale_all_dim"]) * math.log(factor) + 1.0 if factor > 1 else 1.0
        mscale = m * m
    return float(theta), str(rope_type), mscale


def config_from_hf_dict(raw: dict[str, Any], path: str = "config.json") -> ModelConfig:
    """Build a ModelConfig from a parsed Hugging Face config.json, the way transformers derives fields."""
    mt = raw.get("model_type")
    if mt != MODEL_TYPE:
        raise ConfigError(f"{path}: model_type is {mt!r}; ColiStream serves {MODEL_TYPE!r} (GLM-5.x) models only")
    defaults = ModelConfig.__dataclass_fields__
    kw: dict[str, Any] = {}
    for name in (
        "vocab_size hidden_size num_hidden_layers intermediate_size moe_intermediate_size n_routed_experts "
        "num_experts_per_tok n_shared_experts n_group topk_group norm_topk_prob routed_scaling_factor "
        "num_attention_heads num_key_value_heads q_lora_rank kv_lora_rank qk_nope_head_dim qk_rope_head_dim "
        "v_head_dim index_n_heads index_head_dim index_topk rms_norm_eps max_position_embeddings "
        "tie_word_embeddings hidden_act bos_token_id pad_token_id"
    ).split():
        if name in raw and raw[name] is not None:
            kw[name] = raw[name]
        elif name in raw and raw[name] is None and name in ("bos_token_id", "pad_token_id"):
            kw[name] = None
    if "num_experts" in raw and raw["num_experts"] is not None:
        kw["n_routed_experts"] = raw["num_experts"]
    if kw.get("num_key_value_heads") is None:
        kw["num_key_value_heads"] = kw.get("num_attention_heads", defaults["num_attention_heads"].default)
    if raw.get("q_lora_rank", 1) is None:
        raise ConfigError(f"{path}: q_lora_rank is null; glm_moe_dsa needs the q LoRA path (the indexer reads it)")
    for name, kind in (("hidden_size", int), ("num_hidden_layers", int), ("vocab_size", int)):
        if name in kw and not isinstance(kw[name], int):
            raise ConfigError(f"{path}: {name} must be an integer, got {kw[name]!r}")
    L = int(kw.get("num_hidden_layers", defaults["num_hidden_layers"].default))

    eos = raw.get("eos_token_id", 1)
    if eos is None:
        eos_ids: tuple[int, ...] = ()
    elif isinstance(eos, int):
        eos_ids = (eos,)
    elif isinstance(eos, list) and all(isinstance(e, int) for e in eos):
        eos_ids = tuple(eos)
    else:
        raise ConfigError(f"{path}: eos_token_id must be an int or a list of ints, got {eos!r}")

    if raw.get("indexer_types") is not None:
        indexer_types = tuple(raw["indexer_types"])
    else:
        indexer_types = derive_indexer_types(
            L, raw.get("index_topk_pattern"), raw.get("index_topk_freq", 1), raw.get("index_skip_topk_offset", 2)
        )
    if raw.get("mlp_layer_types") is not None:
        mlp_layer_types = tuple(raw["mlp_layer_types"])
    else:
        n_dense = min(int(raw.get("first_k_dense_replace", 3)), L)
        mlp_layer_types = ("dense",) * n_dense + ("sparse",) * (L - n_dense)

    theta, rope_type, mscale = _rope_from_hf(raw, path)
    try:
        return ModelConfig(
            **kw,
            rope_theta=theta,
            rope_type=rope_type,
            attention_mscale=mscale,
            eos_token_ids=eos_ids,
            indexer_types=indexer_types,
            mlp_layer_types=mlp_layer_types,
        )
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    except TypeError as e:
        raise ConfigError(f"{path}: {e}") from None


def load_config(model_dir: str | Path) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{path}: not found (is {model_dir} a Hugging Face checkpoint or ColiStream container?)")
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: cannot parse: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: top level must be a JSON object")
    return config_from_hf_dict(raw, str(path))


# ---- presets ---------------------------------------------------------------------------------
# `glm5` is the full model (reference §1, hub rope_theta 1e6, hub eos list); `tiny` matches
# scripts/make_oracle.py's default; `tiny-shared` and `tiny-groups` exercise shared indexer
# layers and group-limited routing.
PRESETS: dict[str, ModelConfig] = {
    "glm5": ModelConfig(rope_theta=1_000_000.0, eos_token_ids=(154820, 154827, 154829)),
    "tiny": ModelConfig(
        vocab_size=512, hidden_size=128, num_hidden_layers=4, intermediate_size=256, moe_intermediate_size=64,
        n_routed_experts=16, num_experts_per_tok=4, num_attention_heads=4, num_key_value_heads=4,
        q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
        index_n_heads=32, index_head_dim=32, index_topk=8, rope_theta=1_000_000.0, max_position_embeddings=4096,
        mlp_layer_types=("dense", "sparse", "sparse", "sparse"),
    ),
}
PRESETS["tiny-shared"] = dataclasses.replace(PRESETS["tiny"], indexer_types=("full", "full", "shared", "shared"))
PRESETS["tiny-groups"] = dataclasses.replace(PRESETS["tiny"], n_group=4, topk_group=2)


def preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown preset {name!r}; known presets: {', '.join(sorted(PRESETS))}") from None
