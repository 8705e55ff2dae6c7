"""The official `openai` client against the gateway: chat and completions, streaming and not. The text is
the run's greedy tokens detokenised with the model's own tokenizer, and the tokens are exactly what the
run gives a direct client for the same chat-templated prompt."""

from __future__ import annotations

import pytest

from coli.serve.client import Client

MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What does os.path.join do?"}]


@pytest.fixture(scope="module")
def oa(gateway):
    from openai import OpenAI
    return OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model_id(oa):
    models = oa.models.list().data
    assert len(models) == 1
    return models[0].id


@pytest.mark.timeout(120)
def test_chat_nonstreaming_matches_the_run_and_the_tokenizer(oa, model_id, gw_run, tok, template, run_info):
    r = oa.chat.completions.create(model=model_id, messages=MSGS, max_tokens=24, temperature=0,
                                   extra_body={"return_token_ids": True})
    assert r.object == "chat.completion" and r.model == model_id and r.id.startswith("chatcmpl-")
    ch = r.choices[0]
    ids = ch.model_extra["token_ids"]
    prompt_ids = tok.encode(template.render(MSGS, add_generation_prompt=True))
    assert r.usage.prompt_tokens == len(prompt_ids)
    assert r.usage.completion_tokens == len(ids) and r.usage.total_tokens == len(prompt_ids) + len(ids)
    assert ch.finish_reason in ("stop", "length") and ch.message.role == "assistant"
    if ch.finish_reason == "length":
        assert len(ids) == 24
    eos = set(run_info["eos_token_ids"])
    assert ch.message.content == tok.decode([t for t in ids if t not in eos], skip_special_tokens=True)
    with Client(gw_run.name, base=gw_run.env["COLI_RUN_DIR"]) as c:  # the same request without the gateway
        direct = c.generate(prompt_ids, 24, greedy=True)
    assert direct.tokens == ids and direct.finish_reason == ch.finish_reason


@pytest.mark.timeout(120)
def test_chat_streaming_equals_nonstreaming(oa, model_id):
    full = oa.chat.completions.create(model=model_id, messages=MSGS, max_tokens=24, temperature=0)
    chunks = list(oa.chat.completions.create(model=model_id, messages=MSGS, max_tokens=24, temperature=0,
                                             stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1 and chunks[0].object == "chat.completion.chunk"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text == full.choices[0].message.content
    assert finishes == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


@pytest.mark.timeout(120)
def test_completions_streaming_sampling_seed_and_echo(oa, model_id):
    kw = dict(model=model_id, prompt="Hello world", max_tokens=12, temperature=0.9, top_p=0.95, seed=7,
              extra_body={"top_k": 50})
    a = oa.completions.create(**kw)
    b = oa.completions.create(**kw)
    assert a.object == "text_completion" and a.choices[0].text == b.choices[0].text  # same seed, same text
    s = list(oa.completions.create(**kw, stream=True))
    assert "".join(c.choices[0].text for c in s) == a.choices[0].text
    assert s[-1].choices[0].finish_reason == a.choices[0].finish_reason
    e = oa.completions.create(**kw, echo=True)
    assert e.choices[0].text == "Hello world" + a.choices[0].text
    ids = oa.completions.create(model=model_id, prompt=[3, 4, 5], max_tokens=4, temperature=0)
    assert ids.usage.prompt_tokens == 3 and ids.usage.completion_tokens >= 1


@pytest.mark.timeout(60)
def test_openai_errors_are_typed(oa, model_id):
    import openai

    with pytest.raises(openai.NotFoundError) as e:
        oa.chat.completions.create(model="no-such-model", messages=MSGS, max_tokens=4)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        oa.chat.completions.create(model=model_id, messages=MSGS, max_tokens=4, n=2)
    assert e.value.body["param"] == "n"
