"""GLM-5's chat template (tests/gateway/fixtures/glm5) rendered by coli.chat_template must equal transformers'
`apply_chat_template` on conversations with tools, assistant tool calls, tool results and reasoning, with
thinking on and off — and so must what the gateway renders from an OpenAI or Anthropic request body."""

from __future__ import annotations

import pytest

from scripted_server import glm5_container

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city, 天气",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}, "days": {"type": "integer"}}}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                         "arguments": {"city": "Oslo", "days": 3}}}
CALL2 = {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": {}}}
CONVERSATIONS = [
    ("tools only", [{"role": "user", "content": "Weather?"}]),
    ("system, call, two results", [
        {"role": "system", "content": "You are terse."}, {"role": "user", "content": "Oslo weather and time?"},
        {"role": "assistant", "content": "", "tool_calls": [CALL, CALL2]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"c": -2}'},
        {"role": "tool", "tool_call_id": "call_2", "content": "10:00"}]),
    ("reasoning kept after the last user turn, dropped before it", [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!", "reasoning_content": "greet back"},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "need the tool", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "snow"},
        {"role": "assistant", "content": "<think>it snows</think>Snow."}]),
    ("a call with a nested value", [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome",
                                                                                    "days": [1, {"a": "ü"}]}}}]}]),
]


@pytest.fixture(scope="module")
def container(tmp_path_factory):
    return glm5_container(tmp_path_factory.mktemp("glm5t"))


@pytest.fixture(scope="module")
def hf(container):
    from transformers import PreTrainedTokenizerFast
    return PreTrainedTokenizerFast(tokenizer_file=str(container / "tokenizer.json"),
                                   chat_template=(container / "chat_template.jinja").read_text())


@pytest.fixture(scope="module")
def ours(container):
    from coli.chat_template import load_chat_template
    return load_chat_template(container)


@pytest.mark.parametrize("thinking", [None, True, False])
@pytest.mark.parametrize("name,msgs", CONVERSATIONS, ids=[c[0] for c in CONVERSATIONS])
def test_glm5_template_renders_like_transformers(hf, ours, name, msgs, thinking):
    kw = {} if thinking is None else {"enable_thinking": thinking}
    for tools in (TOOLS, None):
        want = hf.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=True, **kw)
        got = ours.render(msgs, add_generation_prompt=True, **({"tools": tools} if tools else {}), **kw)
        assert got == want
    assert ours.render(msgs, add_generation_prompt=True, tools=TOOLS, **kw).endswith(
        "<|assistant|></think>" if thinking is False else "<|assistant|><think>")


def test_request_bodies_render_like_transformers(hf, ours):
    """The OpenAI body (arguments as JSON strings, content null) and the Anthropic body (tool_use / tool_result
    blocks) of one conversation both become the messages transformers renders."""
    import json

    from coli.serve.anthropic_api import parse_messages
    from coli.serve.openai_api import parse_chat

    oa_body = {"messages": [
        {"role": "user", "content": "Oslo?"},
        {"role": "assistant", "content": None, "reasoning_content": "use the tool", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": json.dumps({"city": "Oslo", "days": 3})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "snow"}]}
    an_body = {"max_tokens": 10, "messages": [
        {"role": "user", "content": "Oslo?"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "use the tool", "signature": ""},
                                          {"type": "tool_use", "id": "call_1", "name": "get_weather",
                                           "input": {"city": "Oslo", "days": 3}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1", "content": "snow"}]}]}
    want_msgs = [{"role": "user", "content": "Oslo?"},
                 {"role": "assistant", "content": "", "reasoning_content": "use the tool", "tool_calls": [CALL]},
                 {"role": "tool", "tool_call_id": "call_1", "content": "snow"}]
    want = hf.apply_chat_template(want_msgs, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    oa_msgs, _ = parse_chat(oa_body)
    an_msgs, _, _, kw = parse_messages(an_body)
    assert ours.render(oa_msgs, add_generation_prompt=True, tools=TOOLS) == want
    an_want = hf.apply_chat_template(want_msgs, tools=TOOLS, tokenize=False, add_generation_prompt=True, **kw)
    assert ours.render(an_msgs, add_generation_prompt=True, tools=TOOLS, **kw) == an_want
    assert "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Oslo</arg_value><arg_key>days</arg_key>" \
           "<arg_value>3</arg_value></tool_call>" in want
