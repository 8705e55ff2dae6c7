"""`coli run`, `coli chat` and the gateway render prompts with coli.chat_template and tokenise with
coli.tokenizer. On the demo model's files both must agree with transformers: the rendering with
`apply_chat_template`, the ids with PreTrainedTokenizerFast, and the eos list with the special tokens."""

from __future__ import annotations

import json

import pytest

from coli.model_store import DEMO_DIR

pytestmark = pytest.mark.skipif(not (DEMO_DIR / "tokenizer_config.json").is_file(), reason="demo model not built")

CONVERSATIONS = [
    [{"role": "user", "content": "What does os.path.join do?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello!"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello. How can I help?"},
     {"role": "user", "content": "Explain generators.\nTwo lines, please."}],
    [{"role": "user", "content": "call it"}, {"role": "assistant", "content": None},
     {"role": "tool", "content": '{"result": 42}'}],
    [{"role": "user", "content": "Ünïcödé — naïve café, 東京 🙂, tabs\tand  spaces  "}],
    [{"role": "user", "content": ""}],
]
TEXTS = ["Hello world", "  leading and trailing  ", "def f(x):\n    return x ** 2\n", "naïve café 東京 🙂",
         "<|user|>\nspecial tokens inline<|assistant|>\n", "[gMASK]<sop>", "", "a" * 500, "1234567890 3.14159"]


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(DEMO_DIR))


@pytest.fixture(scope="module")
def ours():
    from coli.chat_template import load_chat_template
    from coli.tokenizer import load_tokenizer
    return load_tokenizer(DEMO_DIR), load_chat_template(DEMO_DIR)


def _ids(x):
    return list(x["input_ids"] if hasattr(x, "keys") else x)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("gen", [True, False])
@pytest.mark.parametrize("i", range(len(CONVERSATIONS)))
def test_chat_template_renders_like_transformers(hf, ours, i, gen):
    tok, template = ours
    msgs = CONVERSATIONS[i]
    want = hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
    got = template.render(msgs, add_generation_prompt=gen)
    assert got == want
    assert tok.encode(got) == _ids(hf.apply_chat_template(msgs, tokenize=True, add_generation_prompt=gen))


@pytest.mark.timeout(120)
def test_tokenizer_encodes_and_decodes_like_pretrained_tokenizer_fast(hf, ours):
    from transformers import PreTrainedTokenizerFast

    tok, _ = ours
    assert isinstance(hf, PreTrainedTokenizerFast)
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == hf.encode(text, add_special_tokens=False), text
        assert tok.decode(ids) == hf.decode(ids), text
        assert tok.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True), text
    assert tok.vocab_size == len(hf)


def test_eos_list_is_the_glm_stop_tokens(ours):
    tok, _ = ours
    cfg = json.loads((DEMO_DIR / "config.json").read_text())
    tcfg = json.loads((DEMO_DIR / "tokenizer_config.json").read_text())
    eos = cfg["eos_token_id"]
    assert sorted(eos) == sorted(tok.token_to_id(t) for t in tcfg["eos_tokens"])
    assert {"<|endoftext|>", "<|user|>", "<|observation|>"} == set(tcfg["eos_tokens"])  # GLM-5's stop set
