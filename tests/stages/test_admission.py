"""Request admission at the supervisor (pure): token ids against the vocabulary, prompt + max_tokens against
the context window; the same rule guards `coli run` and the generation loop."""

import pytest

from coli.generate import context_problem
from coli.protocol.messages import GenerateRequest
from coli.stages.supervisor.admission import Limits, refusal

LIM = Limits(vocab_size=1000, context=4096)


def req(ids, max_tokens):
    return GenerateRequest("r1", ids, max_tokens, 0.0, 1.0, 0, None, True, False)


def test_a_request_that_fits_is_admitted_up_to_the_last_position():
    assert refusal(req([1, 2, 3], 4093), LIM) is None
    assert refusal(req([7] * 4095, 1), LIM) is None


def test_max_tokens_beyond_the_context_is_refused_naming_the_numbers_and_the_setting():
    why = refusal(req([1, 2, 3], 100_000_000_000), LIM)
    assert why == ("the prompt (3 tokens) plus max_tokens (100000000000) is 100000000003 tokens, over the model's "
                   "context of 4096 tokens (ask for at most 4093: --max-tokens)")
    assert refusal(req([1, 2, 3], 4094), LIM) is not None


def test_a_prompt_as_long_as_the_context_is_refused():
    why = refusal(req([5] * 4500, 16), LIM)
    assert why.startswith("the prompt is 4500 tokens but the model's context is 4096 tokens")
    assert refusal(req([5] * 4096, 1), LIM).startswith("the prompt is 4096 tokens")


def test_token_ids_outside_the_vocabulary_are_refused():
    assert refusal(req([1, 1000, 2], 4), LIM) == "prompt token id 1000 is outside the vocabulary (0..999)"


@pytest.mark.parametrize("ctx", [0, -1])
def test_no_stated_context_means_no_context_limit(ctx):
    assert context_problem(10 ** 6, 10 ** 9, ctx) is None
    assert refusal(req([1], 10 ** 12), Limits(0, 0)) is None
