"""Acceptance (a): a synthetic FP8 checkpoint made with a fresh seed, converted with --experts f32 --dense f32,
generates the same greedy tokens with `coli run` as transformers on the block-dequantised model.

The reference side does not use any coli code: it reads the shards with safetensors.torch, block-dequantises
with torch's own float8_e4m3fn conversion (W = fp8 * scale_inv per 128x128 block, ragged edges included),
loads the result into transformers' GlmMoeDsaForCausalLM and calls generate(attention_mask=ones,
eos_token_id=None, do_sample=False). Set COLI_FP8_SEED to replay a seed."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

import make_fp8_checkpoint as mk

from container_cli import coli

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

NEW_TOKENS = 20


def _dequantised_state(ck: Path, model) -> dict:
    from safetensors.torch import load_file
    weight_map = json.loads((ck / "model.safetensors.index.json").read_text())["weight_map"]
    raw = {}
    for f in sorted(set(weight_map.values())):
        raw.update(load_file(str(ck / f)))

    def deq(name):
        w = raw[name]
        if w.dtype == torch.float8_e4m3fn:
            s = raw[name + "_scale_inv"]
            R, C = w.shape
            s = s.repeat_interleave(128, 0)[:R].repeat_interleave(128, 1)[:, :C]
            return w.to(torch.float32) * s
        return w.to(torch.float32)

    E = model.config.n_routed_experts
    sd = {}
    for name in model.state_dict():
        if name.endswith("mlp.experts.gate_up_proj"):           # transformers fuses the per-expert tensors
            p = name[: -len("gate_up_proj")]
            sd[name] = torch.stack([torch.cat([deq(f"{p}{e}.gate_proj.weight"), deq(f"{p}{e}.up_proj.weight")])
                                    for e in range(E)])
        elif name.endswith("mlp.experts.down_proj"):
            p = name[: -len("down_proj")]
            sd[name] = torch.stack([deq(f"{p}{e}.down_proj.weight") for e in range(E)])
        else:
            sd[name] = deq(name)
    # the hub checkpoint's kv_a_proj_with_mqa is ragged (192 rows = 128 + 64): make sure this one is too
    kv = raw["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"]
    assert kv.shape[0] % 128 and kv.dtype == torch.float8_e4m3fn
    assert any(n.startswith(f"model.layers.{model.config.num_hidden_layers}.") for n in raw)   # the MTP layer
    return sd


def _transformers_tokens(ck: Path, prompt: list[int]) -> list[int]:
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM
    torch.set_num_threads(1)
    cfg = json.loads((ck / "config.json").read_text())
    cfg.pop("quantization_config")        # the weights below are already dequantised
    model = GlmMoeDsaForCausalLM(GlmMoeDsaConfig(**cfg)).to(torch.float32).eval()
    model.load_state_dict(_dequantised_state(ck, model), strict=True)
    ids = torch.tensor([prompt])
    pad = next(t for t in range(cfg["vocab_size"] - 1, 0, -1) if t not in prompt)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False,
                             eos_token_id=None, pad_token_id=pad)
    return out[0, len(prompt):].tolist()


def test_fp8_checkpoint_f32_container_matches_transformers(tmp_path):
    seed = int(os.environ.get("COLI_FP8_SEED") or int.from_bytes(os.urandom(3), "little"))
    ck, dst = tmp_path / "ckpt", tmp_path / "container"
    mk.build_checkpoint(ck, seed=seed)
    rng = np.random.default_rng(seed)
    prompt = [0] + rng.integers(2, 512, 19).tolist()             # 20 tokens > index_topk 8: DSA really selects
    coli("convert", ck, dst, "--experts", "f32", "--dense", "f32", "--no-progress", check=True)
    r = coli("run", "--model", dst, "--prompt-ids", ",".join(map(str, prompt)), "-n", NEW_TOKENS, "--json",
             "--ignore-eos", check=True)
    got = json.loads(r.stdout)["tokens"]
    want = _transformers_tokens(ck, prompt)
    print(f"FP8 acceptance: seed {seed}, {NEW_TOKENS} tokens, match {got == want}")
    assert got == want, f"seed {seed} (replay with COLI_FP8_SEED={seed}): coli {got} != transformers {want}"
