"""Writes random glm_moe_dsa checkpoints in the Hugging Face on-disk layout without torch (for weight
loading tests): every tensor of `dense_shapes` plus per-expert routed tensors, f32, optionally sharded
with an index and with an extra MTP layer."""

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
