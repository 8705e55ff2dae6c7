"""Tool calls and reasoning on /v1/chat/completions with the official `openai` client. The demo model cannot
call tools, so the answers come from a scripted generation source at the gateway's seam (the model's own
tokenizer, the same streaming path), in front of GLM-5's chat template; the prompts the template rendered
are checked token for token. With the demo model through the real stages, tools are refused (its template
does not render them)."""

from __future__ import annotations

import json

import pytest

from scripted_server import ScriptedServer, glm5_container

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                                    "metric": {"type": "boolean"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"tz": {"type": "string"}}}}}]
CALL = ("<tool_call>get_weather<arg_key>city</arg_key><arg_value>Beijing</arg_value>"
        "<arg_key>days</arg_key><arg_value>2</arg_value></tool_call>")
CALL2 = "<tool_call>get_time<arg_key>tz</arg_key><arg_value>Asia/Shanghai</arg_value></tool_call>"
USER = [{"role": "user", "content": "Weather in Beijing for 2 days?"}]


@pytest.fixture(scope="module")
def container(tmp_path_factory):
    return glm5_container(tmp_path_factory.mktemp("glm5"))


@pytest.fixture(scope="module")
def template(container):
    from coli.chat_template import load_chat_template
    return load_chat_template(container)


def serve(container, replies, **kw):
    from openai import OpenAI

    s = ScriptedServer(container, replies, **kw)
    return s, OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_tools_round_trip_non_streaming(container, template):
    s, oa = serve(container, ["Let me check.</think>" + CALL, "It will be sunny.</think>Sunny, 25 C."])
    try:
        r = oa.chat.completions.create(model="glm5", messages=USER, tools=TOOLS)
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls" and ch.message.content is None
        assert ch.message.model_extra["reasoning_content"] == "Let me check."
        (tc,) = ch.message.tool_calls
        assert tc.type == "function" and tc.id.startswith("call_") and tc.function.name == "get_weather"
        assert json.loads(tc.function.arguments) == {"city": "Beijing", "days": 2}  # typed from the schema
        # the prompt: GLM-5's template with the tools, thinking on
        assert s.run.prompts[0] == s.tok.encode(template.render(USER, add_generation_prompt=True, tools=TOOLS))
        assert s.prompt_text(0).endswith("<|assistant|><think>")
        follow = USER + [ch.message.model_dump(exclude_none=True),
                         {"role": "tool", "tool_call_id": tc.id, "content": '{"sky": "sunny", "c": 25}'}]
        r2 = oa.chat.completions.create(model="glm5", messages=follow, tools=TOOLS)
        assert r2.choices[0].message.content == "Sunny, 25 C." and r2.choices[0].finish_reason == "stop"
        # the assistant's call and the tool result are rendered back as the template writes them
        text = s.prompt_text(1)
        assert CALL in text and '<|observation|><tool_response>{"sky": "sunny", "c": 25}</tool_response>' in text
        rendered = [USER[0], {"role": "assistant", "content": "", "reasoning_content": "Let me check.",
                              "tool_calls": [{"id": tc.id, "type": "function", "function": {
                                  "name": "get_weather", "arguments": {"city": "Beijing", "days": 2}}}]},
                    {"role": "tool", "tool_call_id": tc.id, "content": '{"sky": "sunny", "c": 25}'}]
        assert s.run.prompts[1] == s.tok.encode(template.render(rendered, add_generation_prompt=True, tools=TOOLS))
    finally:
        s.stop()


def test_tools_streamed_as_openai_streams_them_and_parallel_calls(container):
    s, oa = serve(container, ["</think>Checking both." + CALL + "\n" + CALL2, "</think>Snow, then 10:00.",
                              CALL + CALL2])
    try:
        chunks = list(oa.chat.completions.create(model="glm5", messages=USER, tools=TOOLS, stream=True,
                                                 stream_options={"include_usage": True}))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        content = "".join(d.content or "" for d in deltas)
        assert content == "Checking both."
        calls: dict[int, dict] = {}
        for d in deltas:
            for tc in d.tool_calls or []:
                if tc.index not in calls:  # the first delta of a call: its id and name, no arguments yet
                    assert tc.id and tc.function.name and tc.function.arguments == ""
                    calls[tc.index] = {"id": tc.id, "name": tc.function.name, "args": ""}
                else:
                    assert tc.id is None and tc.function.name is None
                    calls[tc.index]["args"] += tc.function.arguments
        assert [c["name"] for c in calls.values()] == ["get_weather", "get_time"]
        assert json.loads(calls[0]["args"]) == {"city": "Beijing", "days": 2}
        assert json.loads(calls[1]["args"]) == {"tz": "Asia/Shanghai"}
        assert len({c["id"] for c in calls.values()}) == 2
        assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
            ["tool_calls"]
        assert chunks[-1].usage.completion_tokens > 0
        # the round trip's second half, streamed too: the calls and their results go back, the answer streams
        follow = USER + [{"role": "assistant", "content": "Checking both.", "tool_calls": [
            {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["args"]}}
            for c in calls.values()]}] + [{"role": "tool", "tool_call_id": c["id"], "content": r}
                                          for c, r in zip(calls.values(), ("snow", "10:00"))]
        answer = list(oa.chat.completions.create(model="glm5", messages=follow, tools=TOOLS, stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in answer if c.choices) == "Snow, then 10:00."
        text = s.prompt_text(1)
        assert "Checking both." + CALL + CALL2 in text
        assert "<|observation|><tool_response>snow</tool_response><tool_response>10:00</tool_response>" in text
        # parallel_tool_calls false: the first call only, and generation stops there
        r = oa.chat.completions.create(model="glm5", messages=USER, tools=TOOLS, parallel_tool_calls=False,
                                       extra_body={"chat_template_kwargs":
                                                                             {"enable_thinking": False}})
        assert [t.function.name for t in r.choices[0].message.tool_calls] == ["get_weather"]
        assert r.usage.completion_tokens < len(s.tok.encode(CALL + CALL2))
    finally:
        s.stop()


def test_call_text_that_does_not_parse_stays_content(container):
    bad = ["</think>" + "<tool_call>get_weather<arg_key>city</arg_key>Beijing</tool_call> ok",
           "</think>" + "<tool_call>launch_rockets<arg_key>n</arg_key><arg_value>3</arg_value></tool_call>",
           "</think>" + "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Rome"]
    s, oa = serve(container, bad + bad)
    try:
        for text in bad:
            r = oa.chat.completions.create(model="glm5", messages=USER, tools=TOOLS)
            assert r.choices[0].message.content == text[len("</think>"):] and not r.choices[0].message.tool_calls
            assert r.choices[0].finish_reason == "stop"
        for text in bad:
            chunks = list(oa.chat.completions.create(model="glm5", messages=USER, tools=TOOLS, stream=True))
            assert "".join(c.choices[0].delta.content or "" for c in chunks) == text[len("</think>"):]
            assert not any(c.choices[0].delta.tool_calls for c in chunks)
    finally:
        s.stop()


def test_tool_choice_none_required_named(container, template):
    s, oa = serve(container, ["</think>" + CALL, "get_weather<arg_key>city</arg_key><arg_value>Oslo</arg_value>"
                                                "</tool_call>", "<arg_key>city</arg_key><arg_value>Rome</arg_value>"
                                                                "</tool_call>" + CALL2])
    try:
        r = oa.chat.completions.create(model="glm5", messages=USER, tools=TOOLS, tool_choice="none")
        assert r.choices[0].message.content == CALL and not r.choices[0].message.tool_calls  # not parsed
        assert "# Tools" not in s.prompt_text(0)  # and not offered
        r = oa.chat.completions.create(model="glm5", messages=USER, tools=TOOLS, tool_choice="required")
        assert s.prompt_text(1).endswith("<|assistant|></think><tool_call>")  # the model can only call
        assert json.loads(r.choices[0].message.tool_calls[0].function.arguments) == {"city": "Oslo"}
        r = oa.chat.completions.create(model="glm5", messages=USER, tools=TOOLS,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
        assert s.prompt_text(2).endswith("</think><tool_call>get_weather")
        assert [t.function.name for t in r.choices[0].message.tool_calls] == ["get_weather"]  # one call only
        assert r.choices[0].finish_reason == "tool_calls"
    finally:
        s.stop()


def test_reasoning_split_stream_and_not_and_enable_thinking(container):
    s, oa = serve(container, ["First, 2+2.\nThat is 4.</think>\n4", "First, 2+2.\nThat is 4.</think>\n4",
                              "4"])
    try:
        msgs = [{"role": "user", "content": "2+2?"}]
        r = oa.chat.completions.create(model="glm5", messages=msgs)
        m = r.choices[0].message
        assert m.content == "4" and m.model_extra["reasoning_content"] == "First, 2+2.\nThat is 4."
        chunks = list(oa.chat.completions.create(model="glm5", messages=msgs, stream=True))
        reasoning = "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content") or "" for c in chunks)
        assert reasoning == "First, 2+2.\nThat is 4."
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == "4"
        r = oa.chat.completions.create(model="glm5", messages=msgs,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        assert s.prompt_text(2).endswith("<|assistant|></think>")
        assert r.choices[0].message.content == "4" and "reasoning_content" not in r.choices[0].message.model_extra
    finally:
        s.stop()


@pytest.mark.parametrize("body,param", [
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
    ({"tools": "x"}, "tools"),
    ({"tools": TOOLS * 2}, "tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs.messages"),
    ({"chat_template_kwargs": [1]}, "chat_template_kwargs"),
    ({"messages": USER + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": "{not json"}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
    ({"messages": USER + [{"role": "tool", "tool_call_id": 5, "content": "x"}]}, "messages[1].tool_call_id"),
])
def test_bad_tool_requests_are_400_naming_the_field(container, body, param):
    from openai import BadRequestError, OpenAI

    s = ScriptedServer(container, [])
    try:
        oa = OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=30)
        with pytest.raises(BadRequestError) as e:
            known = {k: v for k, v in body.items() if k in ("messages", "tools", "tool_choice", "parallel_tool_calls")}
            oa.chat.completions.create(model="glm5", **{"messages": USER, **known},
                                       extra_body={k: v for k, v in body.items() if k not in known})
        assert e.value.body["param"] == param, e.value.body
        assert s.run.prompts == []  # nothing reached the model
    finally:
        s.stop()


@pytest.mark.timeout(60)
def test_the_demo_model_through_the_stages_refuses_tools(gateway):
    status, out = gateway.post("/v1/chat/completions", {"messages": USER, "tools": TOOLS, "max_tokens": 4})
    assert status == 400 and out["error"]["code"] == "tools_unsupported" and out["error"]["param"] == "tools"
    status, out = gateway.post("/v1/chat/completions", {"messages": USER, "tools": TOOLS, "tool_choice": "none",
                                                        "max_tokens": 2})
    assert status == 200  # tools it will not use are fine
