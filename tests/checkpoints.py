"""Writes random glm_moe_dsa checkpoints in the Hugging Face on-disk layout without torch (for weight
loading tests): every tensor of `dense_shapes` plus per-expert routed tensors, f32, optionally sharded
with an index and with an extra MTP layer; and torch_mtp_logits, the MTP layer's reference built on transformers'
decoder layer (torch is imported only when that is called)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from coli.config import ModelConfig
from coli.model.tensors import dense_shapes, expert_shapes, expert_tensor_name
from coli.safetensors_io import write_safetensors


def checkpoint_tensors(c: ModelConfig, seed: int = 0, mtp: bool = False) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {n: (rng.standard_normal(s) * 0.05).astype(np.float32) for n, s in dense_shapes(c).items()}
    for layer in c.moe_layers:
        for e in range(c.n_routed_experts):
            for part, s in expert_shapes(c).items():
                out[expert_tensor_name(layer, e, part)] = (rng.standard_normal(s) * 0.05).astype(np.float32)
    if mtp:
        L = c.num_hidden_layers
        out[f"model.layers.{L}.eh_proj.weight"] = np.zeros((c.hidden_size, 2 * c.hidden_size), np.float32)
        out[f"model.layers.{L}.mlp.experts.0.up_proj.weight"] = np.zeros((3, 3), np.float32)
    return out


def write_checkpoint(d: Path, c: ModelConfig, tensors: dict[str, np.ndarray], shards: int = 1) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(c.to_hf_dict()))
    names = list(tensors)
    if shards == 1:
        write_safetensors(d / "model.safetensors", {n: ("F32", tensors[n]) for n in names})
        return d
    weight_map = {}
    for k, part in enumerate(np.array_split(np.arange(len(names)), shards)):
        fname = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        write_safetensors(d / fname, {names[i]: ("F32", tensors[names[i]]) for i in part})
        weight_map.update({names[i]: fname for i in part})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return d


def mtp_layer_tensors(c: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """A complete random MTP layer (layer num_hidden_layers: eh_proj, enorm, hnorm, a decoder layer with a full
    indexer and MoE, shared_head.norm), scaled like scripts/make_oracle.py's model: linears N(0, 0.02), norms
    1 + N(0, 0.1), the router N(0, 0.1) and its correction bias N(0, 0.05) (routing away from ties)."""
    from coli.model.tensors import mtp_dense_shapes, mtp_layer

    rng = np.random.default_rng(seed)
    L = mtp_layer(c)
    out: dict[str, np.ndarray] = {}
    for name, shape in mtp_dense_shapes(c).items():
        if name.endswith("e_score_correction_bias"):
            v = rng.normal(0, 0.05, shape)
        elif name.endswith("mlp.gate.weight"):
            v = rng.normal(0, 0.1, shape)
        elif name.endswith("k_norm.bias"):
            v = rng.normal(0, 0.1, shape)
        elif len(shape) == 1:
            v = 1 + rng.normal(0, 0.1, shape)
        else:
            v = rng.normal(0, 0.02, shape)
        out[name] = v.astype(np.float32)
    for e in range(c.n_routed_experts):
        for part, s in expert_shapes(c).items():
            out[expert_tensor_name(L, e, part)] = rng.normal(0, 0.02, s).astype(np.float32)
    return out


def with_mtp_layer(src: Path, dst: Path, seed: int = 0, tensors: dict[str, np.ndarray] | None = None) -> Path:
    """A copy of the single-file checkpoint `src` (e.g. a transformers-saved oracle) with an MTP layer added to its
    model.safetensors (random, or `tensors`); config.json gets `num_nextn_predict_layers: 1` like GLM-5's."""
    import shutil

    from coli.config import load_config
    from coli.safetensors_io import SafetensorsFile

    dst.mkdir(parents=True, exist_ok=True)
    for p in src.iterdir():
        if p.is_file() and p.name != "model.safetensors":
            shutil.copy(p, dst / p.name)
    f = SafetensorsFile(src / "model.safetensors")
    try:
        main = {n: (f.tensors[n].dtype, np.array(f.raw(n))) for n in f.keys()}
    finally:
        f.close()
    extra = tensors if tensors is not None else mtp_layer_tensors(load_config(src), seed)
    main.update({n: ("F32", v) for n, v in extra.items()})
    write_safetensors(dst / "model.safetensors", main)
    cfg = json.loads((src / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 1
    (dst / "config.json").write_text(json.dumps(cfg, indent=1))
    return dst


def torch_mtp_logits(d, prompt, dtype):
    """The MTP layer's logits for the pairs (h_i, t_{i+1}), i = 0..n-2, in torch: the main model and the MTP
    layer's decoder are transformers' GlmMoeDsa classes; enorm/hnorm/eh_proj/shared_head.norm around it are written
    here from the DeepSeek-V3 layout (vLLM deepseek_mtp.py): eh_proj(concat[enorm(embed), hnorm(h)])."""
    import torch
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    from coli.weights import HFCheckpoint

    main = GlmMoeDsaForCausalLM.from_pretrained(d, dtype=dtype, experts_implementation="eager",
                                                attn_implementation="eager").eval()
    cfg = main.config.to_dict()
    # one layer of the main model's attention kind, spelled as this transformers spells it (5.23: "indexed_attention";
    # other releases name it otherwise and refuse the rest)
    kinds = cfg.get("layer_types") or ["indexed_attention"]
    cfg.update(num_hidden_layers=1, indexer_types=["full"], mlp_layer_types=["sparse"], first_k_dense_replace=0,
               layer_types=[kinds[-1]])
    for k in ("index_topk_pattern", "index_topk_freq"):
        cfg.pop(k, None)
    cfg1 = GlmMoeDsaConfig(**cfg)
    cfg1._attn_implementation = "eager"
    cfg1._experts_implementation = "eager"
    layer_model = GlmMoeDsaForCausalLM(cfg1).to(dtype).eval()
    ck = HFCheckpoint(d)
    L = ck.config.num_hidden_layers
    p = f"model.layers.{L}."
    t = {n: torch.from_numpy(np.array(ck.dense(n))).to(dtype) for n in ck.mtp_names()}
    state = {}
    for n, v in t.items():
        rest = n[len(p):]
        if rest.startswith(("enorm", "hnorm", "eh_proj", "shared_head")) or ".mlp.experts." in "." + rest:
            continue
        state["model.layers.0." + rest] = v
    E, Im = ck.config.n_routed_experts, ck.config.moe_intermediate_size
    ex = ck.experts(L, range(E))
    state["model.layers.0.mlp.experts.gate_up_proj"] = torch.stack(
        [torch.from_numpy(np.concatenate([ex[e].gate, ex[e].up])) for e in range(E)]).to(dtype)
    state["model.layers.0.mlp.experts.down_proj"] = torch.stack([torch.from_numpy(ex[e].down) for e in range(E)]).to(dtype)
    state["model.norm.weight"] = t[p + "shared_head.norm.weight"]
    state["lm_head.weight"] = main.lm_head.weight.detach()
    missing, unexpected = layer_model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"model.embed_tokens.weight"}, (missing, unexpected)

    def rms(x, w):
        var = x.pow(2).mean(-1, keepdim=True)
        return w * (x * torch.rsqrt(var + ck.config.rms_norm_eps))

    ids = torch.tensor([prompt])
    with torch.no_grad():
        h = main.model(input_ids=ids).last_hidden_state               # [1, n, H], after the final norm
        emb = main.model.embed_tokens(ids)                            # [1, n, H]
        x = torch.cat([rms(emb[:, 1:], t[p + "enorm.weight"]), rms(h[:, :-1], t[p + "hnorm.weight"])], dim=-1)
        x = x @ t[p + "eh_proj.weight"].T                             # [1, n-1, H]
        logits = layer_model(inputs_embeds=x).logits[0]               # [n-1, V]
    ck.close()
    return logits.double().numpy()
