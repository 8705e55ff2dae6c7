"""Text assembly for the gateway: incremental detokenisation with stop strings that may span tokens."""

from __future__ import annotations

import pytest

from coli.model_store import DEMO_DIR
from coli.serve.textstream import TextAssembler

pytestmark = pytest.mark.skipif(not (DEMO_DIR / "tokenizer.json").is_file(), reason="demo model not built")


@pytest.fixture(scope="module")
def tok():
    from coli.tokenizer import load_tokenizer
    return load_tokenizer(DEMO_DIR)


def feed(asm: TextAssembler, ids) -> tuple[list[str], str]:
    parts = []
    for i in ids:
        parts.append(asm.push(i))
        if asm.stopped:
            break
    parts.append(asm.finish())
    return parts, "".join(parts)


TEXT = "Return the number of items in a container. It is naïve: 東京!"


def test_without_stops_the_text_is_the_decoded_tokens_and_eos_is_not_text(tok):
    ids = tok.encode(TEXT)
    eos = tok.token_to_id("<|endoftext|>")
    _, text = feed(TextAssembler(tok, [eos]), ids + [eos])
    assert text == tok.decode(ids) == TEXT


@pytest.mark.parametrize("stop", ["number of", "s in a c", ".", "東京", "naïve:", "Return"])
def test_a_stop_string_ends_the_text_just_before_it_even_across_tokens(tok, stop):
    ids = tok.encode(TEXT)
    asm = TextAssembler(tok, [], ["never-there", stop])
    parts, text = feed(asm, ids)
    assert text == TEXT[:TEXT.index(stop)] and asm.stopped_by == stop
    assert all(stop not in "".join(parts[:k + 1]) for k in range(len(parts)))  # never sent, not even in part
    assert len(asm.token_ids) <= len(ids)


def test_the_earliest_of_several_stops_wins_and_held_back_text_is_released_at_the_end(tok):
    ids = tok.encode(TEXT)
    _, text = feed(TextAssembler(tok, [], ["container", "items"]), ids)
    assert text == TEXT[:TEXT.index("items")]
    asm = TextAssembler(tok, [], ["zzzzzzzz"])  # holds back 7 characters until the end
    parts, text = feed(asm, ids)
    assert text == TEXT and not asm.stopped and len(parts[-1]) <= 7
