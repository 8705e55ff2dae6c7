#!/usr/bin/env python3
"""Write a synthetic glm_moe_dsa checkpoint in the GLM-5-FP8 hub layout (tiny dims, real names and dtypes).

    .venv/bin/python scripts/make_fp8_checkpoint.py --out DIR [--seed N] [--dtype fp8|bf16|f32] [--shards 3]

What the FP8 layout holds (reference glm5.md §5.2):
  * every quantised linear as `<name>.weight` float8_e4m3fn [out, in] plus `<name>.weight_scale_inv` float32
    [ceil(out/128), ceil(in/128)], W = fp8 * scale_inv — attention projections, indexer wq_b/wk, dense MLPs,
    shared experts and the per-expert routed weights `mlp.experts.E.{gate,up,down}_proj.weight`;
  * bf16 for what the hub leaves unquantised: embed_tokens, lm_head, every norm (incl. the indexer k_norm
    weight and bias), the router `mlp.gate.weight`, `indexer.weights_proj`; fp32 `e_score_correction_bias`;
  * shards `model-0000i-of-0000n.safetensors` plus `model.safetensors.index.json`;
  * an MTP layer (layer index = num_hidden_layers) with the DeepSeek-V3 extras (eh_proj, enorm, hnorm,
    shared_head.norm), which converters must skip;
  * config.json with `quantization_config` (fp8, e4m3, 128x128 blocks) and `num_nextn_predict_layers: 1`,
    a word-level tokenizer.json ("<bos>", "<eos>", "w2" .. "wN") and generation_config.json.

Default dims are chosen so that 128x128 blocks matter: hidden 256 (2 column blocks), kv_lora_rank 160 + rope 32
= 192 kv_a rows (one full and one 64-row edge block), q_lora_rank 192, moe width 192, dense width 384, indexer
32 heads x 64 (wk has 64 rows: a single partial block), so ragged edge blocks occur in rows and in columns.

Values: linears N(0, 0.02 * U(0.5, 2) per tensor) before FP8 block quantisation (so block scales differ); norms
1 + N(0, 0.1); k_norm bias N(0, 0.1); router N(0, 0.1); correction bias N(0, 0.05) (as scripts/make_oracle.py,
to keep routing decisions away from ties). `--random-codes` skips the float sampling and writes uniformly random
(non-NaN) fp8 codes with random scales: much faster, for converter benchmarks only.

Importable: `sys.path.insert(0, "scripts"); import make_fp8_checkpoint as m; m.build_checkpoint(out, seed=1)`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from coli.safetensors_io import E4M3_TABLE, f32_to_bf16_bits  # noqa: E402

BLOCK = 128
DEFAULT_DIMS = dict(
    vocab=512, hidden=256, layers=4, dense_layers=1, experts=16, topk=4, heads=4,
    q_lora=192, kv_lora=160, nope=64, rope=32, v=64, index_heads=32, index_dim=64, index_topk=8,
    inter=384, moe_inter=192, n_shared=1,
)

# ---- fp8 encoding ------------------------------------------------------------------------------------
_POS = E4M3_TABLE[:127].astype(np.float64)  # codes 0..126: all finite non-negative values, ascending


def encode_e4m3(x: np.ndarray) -> np.ndarray:
    """float -> float8_e4m3fn codes, round to nearest (ties to the even code), saturating at 448."""
    a = np.minimum(np.abs(x).astype(np.float64), 448.0)
    hi = np.clip(np.searchsorted(_POS, a), 0, 126)
    lo = np.maximum(hi - 1, 0)
    d_hi, d_lo = _POS[hi] - a, a - _POS[lo]
    code = np.where((d_lo < d_hi) | ((d_lo == d_hi) & (lo % 2 == 0)), lo, hi).astype(np.uint8)
    return code | np.where(np.signbit(x), 0x80, 0).astype(np.uint8)


def fp8_blocks(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Block-quantise float32 [R, C] the way the hub FP8 checkpoints are: scale_inv = amax(block) / 448."""
    R, C = w.shape
    gr, gc = -(-R // BLOCK), -(-C // BLOCK)
    pad = np.zeros((gr * BLOCK, gc * BLOCK), np.float32)
    pad[:R, :C] = w
    amax = np.abs(pad.reshape(gr, BLOCK, gc, BLOCK)).max(axis=(1, 3))
    scale_inv = np.where(amax > 0, amax / 448.0, 1.0).astype(np.float32)
    s = np.repeat(np.repeat(scale_inv, BLOCK, 0)[:R], BLOCK, 1)[:, :C]
    return encode_e4m3(w / s), scale_inv


# ---- tensor list ----------------------------------------------------------------------------------------
def hf_config(d: dict, weight_dtype: str) -> dict:
    L = d["layers"]
    cfg = {
        "architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa",
        "vocab_size": d["vocab"], "hidden_size": d["hidden"], "num_hidden_layers": L,
        "intermediate_size": d["inter"], "moe_intermediate_size": d["moe_inter"],
        "n_routed_experts": d["experts"], "num_experts_per_tok": d["topk"], "n_shared_experts": d["n_shared"],
        "n_group": 1, "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 2.5,
        "num_attention_heads": d["heads"], "num_key_value_heads": d["heads"],
        "q_lora_rank": d["q_lora"], "kv_lora_rank": d["kv_lora"], "qk_nope_head_dim": d["nope"],
        "qk_rope_head_dim": d["rope"], "v_head_dim": d["v"], "head_dim": d["rope"],
        "index_n_heads": d["index_heads"], "index_head_dim": d["index_dim"], "index_topk": d["index_topk"],
        "first_k_dense_replace": d["dense_layers"], "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        "max_position_embeddings": 4096, "tie_word_embeddings": False, "hidden_act": "silu",
        "attention_bias": False, "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": None,
        "num_nextn_predict_layers": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
        "torch_dtype": {"fp8": "bfloat16", "bf16": "bfloat16", "f32": "float32"}[weight_dtype],
    }
    if weight_dtype == "fp8":
        cfg["quantization_config"] = {
            "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [BLOCK, BLOCK],
            "modules_to_not_convert": ["model.embed_tokens", "lm_head"] +
                                      [f"model.layers.{i}.self_attn.indexers_proj" for i in range(L + 1)],
        }
    return cfg


def tensor_specs(d: dict, mtp: bool = True) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, kind, shape) in hub order; kind: linear | norm | knorm_bias | embed | router | corr_bias | small."""
    H, nh = d["hidden"], d["heads"]
    specs: list[tuple[str, str, tuple[int, ...]]] = [("model.embed_tokens.weight", "embed", (d["vocab"], H))]
    for i in range(d["layers"] + (1 if mtp else 0)):  # + the MTP layer
        p = f"model.layers.{i}."
        mtp = i == d["layers"]
        if mtp:
            specs += [(p + "enorm.weight", "norm", (H,)), (p + "hnorm.weight", "norm", (H,)),
                      (p + "eh_proj.weight", "linear", (H, 2 * H))]
        specs += [
            (p + "input_layernorm.weight", "norm", (H,)),
            (p + "self_attn.q_a_proj.weight", "linear", (d["q_lora"], H)),
            (p + "self_attn.q_a_layernorm.weight", "norm", (d["q_lora"],)),
            (p + "self_attn.q_b_proj.weight", "linear", (nh * (d["nope"] + d["rope"]), d["q_lora"])),
            (p + "self_attn.kv_a_proj_with_mqa.weight", "linear", (d["kv_lora"] + d["rope"], H)),
            (p + "self_attn.kv_a_layernorm.weight", "norm", (d["kv_lora"],)),
            (p + "self_attn.kv_b_proj.weight", "linear", (nh * (d["nope"] + d["v"]), d["kv_lora"])),
            (p + "self_attn.o_proj.weight", "linear", (H, nh * d["v"])),
            (p + "self_attn.indexer.wq_b.weight", "linear", (d["index_heads"] * d["index_dim"], d["q_lora"])),
            (p + "self_attn.indexer.wk.weight", "linear", (d["index_dim"], H)),
            (p + "self_attn.indexer.k_norm.weight", "norm", (d["index_dim"],)),
            (p + "self_attn.indexer.k_norm.bias", "knorm_bias", (d["index_dim"],)),
            (p + "self_attn.indexer.weights_proj.weight", "small", (d["index_heads"], H)),
            (p + "post_attention_layernorm.weight", "norm", (H,)),
        ]
        if i < d["dense_layers"]:
            specs += [(p + "mlp.gate_proj.weight", "linear", (d["inter"], H)),
                      (p + "mlp.up_proj.weight", "linear", (d["inter"], H)),
                      (p + "mlp.down_proj.weight", "linear", (H, d["inter"]))]
        else:
            Im, Is = d["moe_inter"], d["moe_inter"] * d["n_shared"]
            specs += [(p + "mlp.gate.weight", "router", (d["experts"], H)),
                      (p + "mlp.gate.e_score_correction_bias", "corr_bias", (d["experts"],))]
            for e in range(d["experts"]):
                specs += [(p + f"mlp.experts.{e}.gate_proj.weight", "linear", (Im, H)),
                          (p + f"mlp.experts.{e}.up_proj.weight", "linear", (Im, H)),
                          (p + f"mlp.experts.{e}.down_proj.weight", "linear", (H, Im))]
            specs += [(p + "mlp.shared_experts.gate_proj.weight", "linear", (Is, H)),
                      (p + "mlp.shared_experts.up_proj.weight", "linear", (Is, H)),
                      (p + "mlp.shared_experts.down_proj.weight", "linear", (H, Is))]
        if mtp:
            specs += [(p + "shared_head.norm.weight", "norm", (H,))]
    specs += [("model.norm.weight", "norm", (H,)), ("lm_head.weight", "embed", (d["vocab"], H))]
    return specs


def _stored(name: str, kind: str, shape: tuple[int, ...], weight_dtype: str) -> list[tuple[str, str, tuple[int, ...]]]:
    """The safetensors entries (name, dtype, shape) one spec becomes."""
    if kind == "corr_bias":
        return [(name, "F32", shape)]
    if weight_dtype == "f32":
        return [(name, "F32", shape)]
    if kind == "linear" and weight_dtype == "fp8":
        return [(name, "F8_E4M3", shape),
                (name + "_scale_inv", "F32", (-(-shape[0] // BLOCK), -(-shape[1] // BLOCK)))]
    return [(name, "BF16", shape)]


class _Gen:
    def __init__(self, seed: int, random_codes: bool):
        self.rng = np.random.default_rng(seed)
        self.random_codes = random_codes

    def values(self, kind: str, shape: tuple[int, ...]) -> np.ndarray:
        r = self.rng
        if kind == "norm":
            return (1.0 + 0.1 * r.standard_normal(shape)).astype(np.float32)
        if kind == "knorm_bias":
            return (0.1 * r.standard_normal(shape)).astype(np.float32)
        if kind == "router":
            return (0.1 * r.standard_normal(shape)).astype(np.float32)
        if kind == "corr_bias":
            return (0.05 * r.standard_normal(shape)).astype(np.float32)
        std = 0.02 * float(r.uniform(0.5, 2.0))
        return (std * r.standard_normal(shape, dtype=np.float32)).astype(np.float32)

    def entries(self, name: str, kind: str, shape: tuple[int, ...], weight_dtype: str) -> dict[str, np.ndarray]:
        stored = _stored(name, kind, shape, weight_dtype)
        if stored[0][1] == "F8_E4M3":
            if self.random_codes:
                codes = np.frombuffer(self.rng.bytes(int(np.prod(shape))), np.uint8).reshape(shape).copy()
                codes[(codes & 0x7F) == 0x7F] ^= 0x01   # no NaN codes
                gr, gc = stored[1][2]
                scale = (self.rng.uniform(0.5, 2.0, (gr, gc)) * (0.02 / 448 * 4)).astype(np.float32)
                return {name: codes, name + "_scale_inv": scale}
            codes, scale = fp8_blocks(self.values(kind, shape))
            return {name: codes, name + "_scale_inv": scale}
        w = self.values(kind, shape)
        if stored[0][1] == "BF16":
            return {name: f32_to_bf16_bits(w)}
        return {name: w}


# ---- writing --------------------------------------------------------------------------------------------
_ITEM = {"F32": 4, "BF16": 2, "F8_E4M3": 1}


def _write_shard(path: Path, entries: list[tuple[str, str, tuple[int, ...]]], produce) -> None:
    """Stream one safetensors file: the header from the entry list, then each tensor as it is produced."""
    header, off = {}, 0
    for name, dtype, shape in entries:
        n = int(np.prod(shape)) * _ITEM[dtype]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    header["__metadata__"] = {"format": "pt"}
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    with open(path, "wb") as f:
        f.write(len(hb).to_bytes(8, "little"))
        f.write(hb)
        for name, arr in produce():
            f.write(np.ascontiguousarray(arr).tobytes())


def write_tokenizer(out: Path, vocab: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    words = {"<bos>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, vocab)}}
    tok = Tokenizer(models.WordLevel(words, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<bos>", "eos_token": "<eos>", "model_max_length": 4096}, indent=2) + "\n")


def build_checkpoint(out_dir: str | os.PathLike, *, seed: int = 0, weight_dtype: str = "fp8", shards: int = 3,
                     random_codes: bool = False, tokenizer: bool = True, mtp: bool = True, **dims) -> dict:
    """Write the checkpoint into out_dir (created; must not hold files). Returns the config dict.
    mtp=False leaves out the MTP layer (benchmarks: it is skipped by the converter anyway)."""
    if weight_dtype not in ("fp8", "bf16", "f32"):
        raise ValueError(f"weight_dtype must be fp8, bf16 or f32, got {weight_dtype!r}")
    unknown = set(dims) - set(DEFAULT_DIMS)
    if unknown:
        raise ValueError(f"unknown dims {sorted(unknown)}; known: {sorted(DEFAULT_DIMS)}")
    d = {**DEFAULT_DIMS, **dims}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if any(out.iterdir()):
        raise FileExistsError(f"{out} is not empty")
    cfg = hf_config(d, weight_dtype)
    specs = tensor_specs(d, mtp)
    # Split into shards of about equal stored size, keeping the hub order.
    sizes = [sum(int(np.prod(s)) * _ITEM[t] for _, t, s in _stored(n, k, sh, weight_dtype)) for n, k, sh in specs]
    total = sum(sizes)
    shards = max(1, min(shards, len(specs)))
    groups: list[list[int]] = [[] for _ in range(shards)]
    acc = 0
    for i, sz in enumerate(sizes):
        groups[min(shards - 1, acc * shards // total)].append(i)
        acc += sz
    groups = [g for g in groups if g]
    gen = _Gen(seed, random_codes)
    weight_map = {}
    for si, g in enumerate(groups):
        fname = f"model-{si + 1:05d}-of-{len(groups):05d}.safetensors" if len(groups) > 1 else "model.safetensors"
        entries = [e for i in g for e in _stored(*specs[i], weight_dtype)]
        for name, _, _ in entries:
            weight_map[name] = fname

        def produce(g=g):
            for i in g:
                name, kind, shape = specs[i]
                made = gen.entries(name, kind, shape, weight_dtype)
                for n2, _, _ in _stored(name, kind, shape, weight_dtype):
                    yield n2, made[n2]

        _write_shard(out / fname, entries, produce)
    if len(groups) > 1:
        (out / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 0, "eos_token_id": 1, "do_sample": False}, indent=2) + "\n")
    if tokenizer:
        write_tokenizer(out, d["vocab"])
    return cfg


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=("fp8", "bf16", "f32"), default="fp8")
    ap.add_argument("--shards", type=int, default=3)
    ap.add_argument("--random-codes", action="store_true", help="uniform random fp8 codes (benchmarks only)")
    ap.add_argument("--no-mtp", action="store_true", help="leave out the MTP layer")
    for k, v in DEFAULT_DIMS.items():
        ap.add_argument("--" + k.replace("_", "-"), type=int, default=v)
    a = ap.parse_args(argv)
    dims = {k: getattr(a, k) for k in DEFAULT_DIMS}
    try:
        build_checkpoint(a.out, seed=a.seed, weight_dtype=a.dtype, shards=a.shards, random_codes=a.random_codes,
                         mtp=not a.no_mtp, **dims)
    except (ValueError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
