"""The built-in demo model ships as package data and is loadable without torch: config, tokenizer, chat
template, end-of-sequence ids and the on-disk (per-expert) tensor names of model.safetensors."""

from __future__ import annotations

import json
import struct
from importlib import resources
from pathlib import Path

import jinja2
import pytest

MODEL_DIR = Path(str(resources.files("coli.demo"))) / "model"
FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
         "tokenizer_config.json", "training.json")
SPECIALS = ["<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>",
            "<|pad|>"]


@pytest.fixture(scope="module")
def config() -> dict:
    return json.loads((MODEL_DIR / "config.json").read_text())


@pytest.fixture(scope="module")
def tok_config() -> dict:
    return json.loads((MODEL_DIR / "tokenizer_config.json").read_text())


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))


@pytest.fixture(scope="module")
def header() -> dict:
    with open(MODEL_DIR / "model.safetensors", "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))


def test_package_data_present_and_small():
    for name in FILES:
        assert (MODEL_DIR / name).is_file(), f"missing package data {name}"
    assert (MODEL_DIR.parent / "README.md").is_file()
    total = sum((MODEL_DIR / name).stat().st_size for name in FILES)
    assert total < 20 * 2**20, f"demo model is {total / 2**20:.1f} MiB"


def test_config_is_a_real_glm_moe_dsa(config, tokenizer):
    assert config["model_type"] == "glm_moe_dsa"
    assert config["architectures"] == ["GlmMoeDsaForCausalLM"]
    assert config["vocab_size"] == tokenizer.get_vocab_size()
    assert config["first_k_dense_replace"] == 1 and config["num_hidden_layers"] >= 4
    assert config["n_routed_experts"] == 16 and config["num_experts_per_tok"] == 4
    assert config["n_shared_experts"] == 1 and config["n_group"] == 1
    assert config["index_topk"] == 256 and config["tie_word_embeddings"] is False
    assert config["rope_parameters"]["rope_theta"] == 1e6
    assert config["mlp_layer_types"] == ["dense"] + ["sparse"] * (config["num_hidden_layers"] - 1)


def test_tokenizer_round_trips(tokenizer):
    for text in ["Return the number of items in a container.",
                 "Join two or more pathname components, inserting '/' as needed.\n\n  Tabs\tand ünïcödé 🙂 too."]:
        ids = tokenizer.encode(text).ids
        assert tokenizer.decode(ids, skip_special_tokens=False) == text
    for i, tok in enumerate(SPECIALS):                       # one id each, after the learned vocabulary
        assert tokenizer.encode(tok).ids == [tokenizer.get_vocab_size() - len(SPECIALS) + i]


def test_chat_template_renders_glm_style(tok_config, tokenizer):
    template = jinja2.Environment().from_string(tok_config["chat_template"])
    messages = [{"role": "system", "content": "Answer briefly."},
                {"role": "user", "content": "What does os.path.join do?"}]
    text = template.render(messages=messages, add_generation_prompt=True)
    assert text == ("[gMASK]<sop><|system|>\nAnswer briefly.<|user|>\nWhat does os.path.join do?"
                    "<|assistant|>\n")
    assert not template.render(messages=messages, add_generation_prompt=False).endswith("<|assistant|>\n")
    ids = tokenizer.encode(text).ids
    vocab = tokenizer.get_vocab()
    assert ids[:3] == [vocab["[gMASK]"], vocab["<sop>"], vocab["<|system|>"]]
    assert vocab["<|user|>"] in ids and ids[-2] == vocab["<|assistant|>"]
    assert tok_config["bos_token"] == "[gMASK]" and tok_config["eos_token"] == "<|endoftext|>"
    assert tok_config["pad_token"] == "<|pad|>"


def test_eos_ids_exist_in_the_vocab(config, tokenizer):
    vocab = tokenizer.get_vocab()
    eos = config["eos_token_id"]
    assert vocab["<|endoftext|>"] in eos and vocab["<|user|>"] in eos
    assert all(0 <= i < config["vocab_size"] for i in eos)
    assert config["pad_token_id"] == vocab["<|pad|>"] and config["bos_token_id"] == vocab["[gMASK]"]
    generation = json.loads((MODEL_DIR / "generation_config.json").read_text())
    assert sorted(generation["eos_token_id"]) == sorted(eos)


def test_safetensors_lists_per_expert_tensors(config, header):
    h, im, e = config["hidden_size"], config["moe_intermediate_size"], config["n_routed_experts"]
    names = set(header) - {"__metadata__"}
    assert {v["dtype"] for k, v in header.items() if k != "__metadata__"} == {"F32"}
    assert header["model.embed_tokens.weight"]["shape"] == [config["vocab_size"], h]
    assert header["lm_head.weight"]["shape"] == [config["vocab_size"], h]
    assert "model.layers.0.mlp.gate_proj.weight" in names                    # layer 0 is dense
    assert not any(n.startswith("model.layers.0.mlp.experts.") for n in names)
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}.self_attn."
        for t in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj",
                  "indexer.wq_b", "indexer.wk", "indexer.weights_proj"):
            assert p + t + ".weight" in names
        assert p + "indexer.k_norm.bias" in names
        if layer < config["first_k_dense_replace"]:
            continue
        p = f"model.layers.{layer}.mlp."
        assert header[p + "gate.weight"]["shape"] == [e, h]
        assert header[p + "gate.e_score_correction_bias"]["shape"] == [e]
        assert header[p + "shared_experts.down_proj.weight"]["shape"] == [h, im * config["n_shared_experts"]]
        for x in range(e):
            assert header[f"{p}experts.{x}.gate_proj.weight"]["shape"] == [im, h]
            assert header[f"{p}experts.{x}.up_proj.weight"]["shape"] == [im, h]
            assert header[f"{p}experts.{x}.down_proj.weight"]["shape"] == [h, im]
        assert f"{p}experts.gate_up_proj" not in names       # fused layout is in-memory only
    assert len([n for n in names if ".experts." in n]) == 3 * e * (config["num_hidden_layers"] - 1)


def test_training_record(tokenizer):
    record = json.loads((MODEL_DIR / "training.json").read_text())
    assert record["steps"] > 0 and record["heldout_loss"] < record["initial_heldout_loss"]
    assert record["special_token_ids"] == {t: tokenizer.token_to_id(t) for t in SPECIALS}
    sample = record["samples"][0]
    assert sample["messages"][-1]["content"] == "What does os.path.join do?"
    assert sample["reply"].strip()
