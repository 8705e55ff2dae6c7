"""The demo model's trained MTP head (scripts/train_demo_model.py --mtp-head): it ships beside the unchanged main
weights, drafts tokens the main model accepts (so both the accept and the reject path run), and decoding with it
gives exactly the tokens of decoding without it, from the checkpoint and from its f32 container."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from coli.chat_template import load_chat_template
from coli.generate import Generation
from coli.loader import load_model
from coli.model.mtp import load_mtp_head
from coli.tokenizer import load_tokenizer

DEMO = Path(__file__).resolve().parents[2] / "coli" / "demo" / "model"
# model.safetensors as shipped before the MTP head was trained: training the head must not touch it
MAIN_SHA256 = "f9d0dedcf3dabab6e49569ae37a2df81c47df78beb23542c7d30cf0076e5a592"


@pytest.fixture(scope="module")
def demo():
    model, _ = load_model(DEMO)
    tok, tpl = load_tokenizer(DEMO), load_chat_template(DEMO)
    return model, load_mtp_head(model), tok, tpl


def test_the_head_ships_beside_unchanged_main_weights():
    index = json.loads((DEMO / "model.safetensors.index.json").read_text())["weight_map"]
    assert {f for n, f in index.items() if n.startswith("model.layers.4.")} == {"model-mtp.safetensors"}
    assert {f for n, f in index.items() if not n.startswith("model.layers.4.")} == {"model.safetensors"}
    rec = json.loads((DEMO / "training-mtp.json").read_text())
    # distilled head: 0.838 teacher-forced when trained (docs/mtp.md); the floor keeps a margin below it
    assert rec["heldout_first_draft_acceptance"] >= 0.75 and rec["mtp_layer"] == 4
    # the main model is the one the rest of the suite and the README quote (trained by the first run of the script)
    main = json.loads((DEMO / "training.json").read_text())
    assert main["command"] == "python scripts/train_demo_model.py --seed 0"
    assert hashlib.sha256((DEMO / "model.safetensors").read_bytes()).hexdigest() == MAIN_SHA256


@pytest.mark.parametrize("drafts", [1, 3])
def test_demo_greedy_tokens_with_mtp_equal_without_and_drafts_are_accepted(demo, drafts):
    model, head, tok, tpl = demo
    ids = tok.encode(tpl.render([{"role": "user", "content": "What does mimetypes.guess_type do?"}]))  # held out
    want = list(Generation(model, ids, 40, ignore_eos=True))
    gen = Generation(model, ids, 40, ignore_eos=True, mtp=(head, drafts))
    assert list(gen) == want
    s = gen.stats.mtp
    assert 0 < s["accepted"][0] < s["drafted"][0]      # some drafts kept, some rejected (and rolled back)
    assert s["tokens_per_step"] > {1: 1.5, 3: 2.5}[drafts]      # measured 1.86 / 3.25 with the distilled head


def test_demo_f32_container_keeps_the_head(demo, tmp_path):
    from coli.container.reader import ContainerReader
    from coli.container.writer import ConvertOptions, convert

    model, head, tok, tpl = demo
    c = tmp_path / "demo-f32"
    convert(DEMO, c, ConvertOptions(experts="f32", dense="f32"))
    assert ContainerReader(c).mtp_layer == 4
    cm, _ = load_model(c)
    ids = tok.encode(tpl.render([{"role": "user", "content": "What does os.path.join do?"}]))
    want = list(Generation(model, ids, 24, ignore_eos=True))
    assert list(Generation(cm, ids, 24, ignore_eos=True, mtp=(load_mtp_head(cm), 2))) == want
