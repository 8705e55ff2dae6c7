"""A model with text for gateway tests: the built-in demo model once it ships (coli/demo/model), else a copy
of a tiny oracle model with a small byte-level BPE tokenizer and a GLM-style chat template built here (the
oracle's weights are random, so its text is noise, but every token decodes)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from coli.model_store import DEMO_DIR

SPECIALS = ["<|pad|>", "<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>"]
TEMPLATE = ("[gMASK]<sop>{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
_TEXT = [
    "The quick brown fox jumps over the lazy dog. Hello world, hello there!",
    "Return the number of items in a container. Join two or more path components.",
    "Streaming experts from disk to memory to the GPU; tokens per second; caches and hit rates.",
    "Ünïcödé text: naïve café, 東京, emoji 🙂 and more.",
]


def demo_available() -> bool:
    return (DEMO_DIR / "config.json").is_file() and (DEMO_DIR / "tokenizer.json").is_file()


def add_tokenizer(model_dir: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_TEXT * 20, trainer)
    assert tok.get_vocab_size() <= vocab_size and tok.token_to_id("<|endoftext|>") == 1
    tok.save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": TEMPLATE, "eos_token": "<|endoftext|>",
        "pad_token": "<|pad|>", "clean_up_tokenization_spaces": False, "model_max_length": 4096}, indent=1))


def text_model(root: Path) -> Path:
    """The directory to serve for text tests."""
    if demo_available():
        return DEMO_DIR
    out = root / "oracle-with-tokenizer"
    if not (out / "tokenizer.json").is_file():
        from oracles import oracle_dir

        src = oracle_dir(root, "default")
        tmp = root / "oracle-with-tokenizer.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(src, tmp)
        add_tokenizer(tmp, json.loads((tmp / "config.json").read_text())["vocab_size"])
        tmp.rename(out)
    return out
