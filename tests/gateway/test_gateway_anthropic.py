"""The Anthropic Messages API with the official `anthropic` client (whose current release no longer types
temperature / top_p / top_k, so they go in extra_body, as they reach the wire): messages.create and messages.stream against
the demo model through the real stages (the same tokens as /v1/chat/completions for the same conversation),
count_tokens, errors as Anthropic error objects, x-api-key auth; and, from the scripted source in front of
GLM-5's template, a tool_use / tool_result round trip (stream and not) and thinking blocks."""

from __future__ import annotations

import json

import pytest

from scripted_server import ScriptedServer, glm5_container

SYSTEM = "Be brief."
MSGS = [{"role": "user", "content": "What does os.path.join do?"}]
TOOLS = [{"name": "get_weather", "description": "Weather of a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                           "required": ["city"]}}]
GREEDY = {"temperature": 0}
CALL = ("<tool_call>get_weather<arg_key>city</arg_key><arg_value>Oslo</arg_value>"
        "<arg_key>days</arg_key><arg_value>3</arg_value></tool_call>")


@pytest.fixture(scope="module")
def an(gateway):
    from anthropic import Anthropic
    return Anthropic(base_url=gateway.url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model_id(gateway):
    _, out = gateway.post("/v1/chat/completions", {"messages": MSGS, "max_tokens": 1})
    return out["model"]


@pytest.mark.timeout(120)
def test_create_matches_chat_completions_through_the_stages(an, gateway, model_id):
    r = an.messages.create(model=model_id, max_tokens=24, system=SYSTEM, messages=MSGS, extra_body=GREEDY)
    assert r.type == "message" and r.role == "assistant" and r.id.startswith("msg_") and r.model == model_id
    status, oa = gateway.post("/v1/chat/completions", {"messages": [{"role": "system", "content": SYSTEM}, *MSGS],
                                                       "max_tokens": 24, "temperature": 0})
    assert status == 200
    text = oa["choices"][0]["message"]["content"]
    assert [b.type for b in r.content] == (["text"] if text else []) and (r.content[0].text if text else "") == text
    assert r.usage.input_tokens == oa["usage"]["prompt_tokens"]
    assert r.usage.output_tokens == oa["usage"]["completion_tokens"]
    assert r.stop_reason == ("max_tokens" if oa["choices"][0]["finish_reason"] == "length" else "end_turn")
    n = an.messages.count_tokens(model=model_id, system=SYSTEM, messages=MSGS)
    assert n.input_tokens == r.usage.input_tokens


@pytest.mark.timeout(120)
def test_stream_gives_the_full_event_sequence_and_the_same_text(an, model_id, gateway):
    kw = dict(model=model_id, max_tokens=24, system=SYSTEM, messages=MSGS, extra_body=GREEDY)
    full = an.messages.create(**kw)
    with an.messages.stream(**kw) as s:
        assert "".join(s.text_stream) == "".join(b.text for b in full.content)
        final = s.get_final_message()
    # the wire: every event named twice (the SSE event line and the data's type), ping included
    status, _, raw = gateway.request("POST", "/v1/messages", {"model": model_id, "max_tokens": 24, "system": SYSTEM,
                                                              "messages": MSGS, "temperature": 0, "stream": True})
    assert status == 200
    frames = [f for f in raw.decode().split("\n\n") if f.strip()]
    names = [f.split("\n")[0].removeprefix("event: ") for f in frames]
    assert all(json.loads(f.split("\n")[1].removeprefix("data: "))["type"] == n for f, n in zip(frames, names))
    blocks = ["content_block_start", "content_block_delta", "content_block_stop"]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]
    assert [n for n in dict.fromkeys(names[2:-2])] == (blocks if full.content else [])
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in full.content]
    assert final.stop_reason == full.stop_reason and final.usage.output_tokens == full.usage.output_tokens


@pytest.mark.timeout(120)
def test_stop_sequences_top_k_top_p_and_sampling(an, model_id, gateway):
    free = an.messages.create(model=model_id, max_tokens=40, messages=MSGS, extra_body=GREEDY)
    text = free.content[0].text if free.content else ""
    if len(text) < 6:
        pytest.skip(f"the demo model's greedy answer is too short to cut: {text!r}")
    stop = text[3:6]
    r = an.messages.create(model=model_id, max_tokens=40, messages=MSGS, extra_body=GREEDY, stop_sequences=[stop])
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == stop
    assert r.content[0].text == text[:text.index(stop)]
    kw = dict(model=model_id, max_tokens=8, messages=MSGS,
              extra_body={"temperature": 0.8, "top_p": 0.9, "top_k": 20, "metadata": {"user_id": "u1"}})
    a, b = an.messages.create(**kw), an.messages.create(**kw)
    assert a.usage.output_tokens >= 1 and b.usage.output_tokens >= 1


@pytest.mark.timeout(60)
def test_errors_are_anthropic_error_objects(an, model_id):
    import anthropic

    with pytest.raises(anthropic.NotFoundError) as e:
        an.messages.create(model="claude-nope", max_tokens=4, messages=MSGS)
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as e:
        an.messages.create(model=model_id, max_tokens=4, messages=MSGS, extra_body={"temperature": 1.5})
    err = e.value.body["error"]
    assert err["type"] == "invalid_request_error" and "temperature" in err["message"]
    with pytest.raises(anthropic.BadRequestError) as e:
        an.messages.create(model=model_id, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}])
    assert "messages[0].content[0]" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as e:  # the demo's template has no tools
        an.messages.create(model=model_id, max_tokens=4, messages=MSGS, tools=TOOLS)
    assert "tools" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError):
        an.messages.create(model=model_id, max_tokens=10 ** 9, messages=MSGS)  # beyond the context


@pytest.fixture(scope="module")
def container(tmp_path_factory):
    return glm5_container(tmp_path_factory.mktemp("glm5a"))


def test_tool_use_round_trip_stream_and_not_with_x_api_key(container):
    import anthropic

    s = ScriptedServer(container, ["I'll check.", CALL, "Cold, 3 days.", CALL], api_key="sekret")
    try:
        with pytest.raises(anthropic.AuthenticationError) as e:
            anthropic.Anthropic(base_url=s.url, api_key="wrong", max_retries=0).messages.create(
                model="glm5", max_tokens=50, messages=MSGS)
        assert e.value.body["error"]["type"] == "authentication_error"
        an = anthropic.Anthropic(base_url=s.url, api_key="sekret", max_retries=0, timeout=60)  # sends x-api-key
        q = [{"role": "user", "content": "Weather in Oslo?"}]
        r = an.messages.create(model="glm5", max_tokens=200, messages=q, tools=TOOLS)
        assert [b.type for b in r.content] == ["text"] and r.stop_reason == "end_turn"  # no thinking: no block
        assert s.prompt_text(0).endswith("<|assistant|></think>")
        r = an.messages.create(model="glm5", max_tokens=200, messages=q, tools=TOOLS)
        (use,) = r.content
        assert use.type == "tool_use" and use.id.startswith("toolu_") and use.name == "get_weather"
        assert use.input == {"city": "Oslo", "days": 3} and r.stop_reason == "tool_use"
        follow = q + [{"role": "assistant", "content": [b.model_dump() for b in r.content]},
                      {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                    "content": [{"type": "text", "text": "-2 C, snow"}]}]}]
        r2 = an.messages.create(model="glm5", max_tokens=200, messages=follow, tools=TOOLS)
        assert r2.content[0].text == "Cold, 3 days."
        text = s.prompt_text(2)
        assert CALL in text and "<|observation|><tool_response>-2 C, snow</tool_response><|assistant|>" in text
        with an.messages.stream(model="glm5", max_tokens=200, messages=q, tools=TOOLS) as st:
            kinds = [(e.type, getattr(getattr(e, "delta", None), "type", None)) for e in st]
            final = st.get_final_message()
        assert ("content_block_delta", "input_json_delta") in kinds
        assert final.content[0].type == "tool_use" and final.content[0].input == {"city": "Oslo", "days": 3}
        assert final.stop_reason == "tool_use"
    finally:
        s.stop()


def test_thinking_blocks_stream_and_not(container):
    import anthropic

    reply = "Snow is likely.\n</think>Bring a coat."
    s = ScriptedServer(container, [reply, reply])
    try:
        an = anthropic.Anthropic(base_url=s.url, api_key="x", max_retries=0, timeout=60)
        kw = dict(model="glm5", max_tokens=200, messages=[{"role": "user", "content": "Oslo?"}],
                  thinking={"type": "enabled", "budget_tokens": 1024})
        r = an.messages.create(**kw)
        assert [b.type for b in r.content] == ["thinking", "text"]
        assert r.content[0].thinking == "Snow is likely." and r.content[1].text == "Bring a coat."
        assert s.prompt_text(0).endswith("<|assistant|><think>")
        with an.messages.stream(**kw) as st:
            deltas = [e.delta.type for e in st if e.type == "content_block_delta"]
            final = st.get_final_message()
        assert "thinking_delta" in deltas and "text_delta" in deltas
        assert [b.model_dump() for b in final.content] == [b.model_dump() for b in r.content]
    finally:
        s.stop()


@pytest.mark.timeout(120)
def test_every_messages_field_with_every_wrong_value_is_a_4xx_naming_it(gateway, model_id):
    from concurrent.futures import ThreadPoolExecutor

    fields = ["model", "max_tokens", "temperature", "top_p", "top_k", "stop_sequences", "stream", "system",
              "metadata", "tools", "tool_choice", "thinking", "messages"]
    values = [2 ** 63, -(2 ** 63), 1e308, -1, "x", [], [1, "a"], {}, {"type": None}, True, [[[[]]]],
              [{"role": "user", "content": [{"type": "tool_result"}]}]]

    def one(case):
        field, v = case
        body = {"model": model_id, "max_tokens": 1, "messages": MSGS, field: v}
        got, _, data = gateway.request("POST", "/v1/messages", body, timeout=60)
        if got == 200:
            return None
        try:
            err = json.loads(data)
            ok = err["type"] == "error" and err["error"]["type"] and field in err["error"]["message"]
        except (ValueError, KeyError, TypeError):
            ok = False
        return None if ok and got < 500 else f"{field}={v!r:.40}: HTTP {got} {data[:200]!r}"

    with ThreadPoolExecutor(8) as pool:
        failures = [f for f in pool.map(one, [(f, v) for f in fields for v in values]) if f]
    assert not failures, "\n".join(failures)
