"""GLM assistant output -> reasoning, content and tool calls. The byte layouts are the ones GLM-5 / GLM-4.7
write (no whitespace between the parts of a call) and GLM-4.5 wrote (a newline after the name and after each
part); every case is also fed one character at a time, which must give the same result as one piece."""

from __future__ import annotations

import json

import pytest

from coli.serve.glm_output import OutputParser, parse_call, type_value

WEATHER = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"},
                                                              "days": {"type": "integer"},
                                                              "metric": {"type": "boolean"},
                                                              "hours": {"type": "array"},
                                                              "where": {"type": "object"},
                                                              "zip": {"type": "string"}}},
           "get_time": {"type": "object", "properties": {"tz": {"type": "string"}}}}


def run(text: str, tools=WEATHER, reasoning=False, parallel=True, chunk: int | None = None):
    p = OutputParser(tools, reasoning, parallel)
    events = []
    pieces = [text] if chunk is None else [text[i:i + chunk] for i in range(0, len(text), chunk)]
    for piece in pieces:
        events += p.feed(piece)
        if p.done:
            break
    events += p.finish()
    reasoning_text = "".join(v for k, v in events if k == "reasoning")
    content = "".join(v for k, v in events if k == "content")
    calls = [(v.name, v.arguments, v.arguments_json) for k, v in events if k == "tool_call"]
    return reasoning_text, content, calls


def both(text, **kw):
    whole = run(text, **kw)
    for chunk in (1, 3, 7):
        assert run(text, chunk=chunk, **kw) == whole, f"chunk {chunk} differs"
    return whole


def test_glm5_layout_two_calls_typed_from_the_schema():
    text = ("I will look it up.<tool_call>get_weather<arg_key>city</arg_key><arg_value>Beijing</arg_value>"
            "<arg_key>days</arg_key><arg_value>3</arg_value><arg_key>metric</arg_key><arg_value>true</arg_value>"
            "<arg_key>zip</arg_key><arg_value>100000</arg_value></tool_call>"
            "<tool_call>get_time<arg_key>tz</arg_key><arg_value>Asia/Shanghai</arg_value></tool_call>")
    r, content, calls = both(text)
    assert r == "" and content == "I will look it up."
    assert calls[0][:2] == ("get_weather", {"city": "Beijing", "days": 3, "metric": True, "zip": "100000"})
    assert json.loads(calls[0][2]) == calls[0][1]  # the streamed fragments join into the arguments JSON
    assert calls[1][:2] == ("get_time", {"tz": "Asia/Shanghai"})


def test_glm45_layout_with_newlines_and_json_values():
    text = ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris, \"FR\"</arg_value>\n"
            "<arg_key>hours</arg_key>\n<arg_value>[9, 12]</arg_value>\n"
            "<arg_key>where</arg_key>\n<arg_value>{\"lat\": 48.8}</arg_value>\n</tool_call>\n")
    r, content, calls = both(text)
    assert content == ""  # the newline after the call is not content
    assert calls == [("get_weather", {"city": 'Paris, "FR"', "hours": [9, 12], "where": {"lat": 48.8}},
                      json.dumps({"city": 'Paris, "FR"', "hours": [9, 12], "where": {"lat": 48.8}},
                                 ensure_ascii=False))]


def test_reasoning_then_content_and_a_call():
    text = ("\nThe user wants weather.\n</think>\nSure."
            "<tool_call>get_time<arg_key>tz</arg_key><arg_value>UTC</arg_value></tool_call>")
    r, content, calls = both(text, reasoning=True)
    assert r == "The user wants weather." and content == "Sure." and calls[0][:2] == ("get_time", {"tz": "UTC"})
    # a model that opens <think> itself
    assert both("<think>hmm</think>Hello", tools=None) == ("hmm", "Hello", [])
    # thinking that never ends (max_tokens) is all reasoning
    assert both("still thinking <", reasoning=True, tools=None) == ("still thinking <", "", [])


@pytest.mark.parametrize("text", [
    "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Rome</arg_value>",          # never closed
    "<tool_call>no_such_tool<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>",   # unknown tool
    "<tool_call>get_weather<arg_key>city</arg_key>Rome</tool_call>",                      # no value tag
    "<tool_call>get_weather junk<arg_key>city</arg_key><arg_value>R</arg_value></tool_call>",  # bad name
    "<tool_call>get_weather<arg_key>city</arg_key><arg_value>R</arg_value>extra</tool_call>",  # text inside
    "<tool_call>get_weather<arg_key>city</arg_key><arg_value>R</arg_value>"
    "<arg_key>city</arg_key><arg_value>S</arg_value></tool_call>",                        # a key twice
    "<tool_call></tool_call>",
    "a < b and <tool_ca",
])
def test_text_that_looks_like_a_call_but_is_not_stays_content(text):
    assert both(text) == ("", text, [])


def test_without_tools_calls_are_content_and_parallel_false_stops_after_one():
    call = "<tool_call>get_time<arg_key>tz</arg_key><arg_value>UTC</arg_value></tool_call>"
    assert both(call, tools=None) == ("", call, [])
    p = OutputParser(WEATHER, parallel=False)
    events = p.feed(call + call)
    assert p.done and [k for k, _ in events] == ["tool_call"]


def test_value_typing():
    assert type_value("42", {"type": "integer"}) == 42
    assert type_value("42", {"type": "string"}) == "42"
    assert type_value("4.5", {"type": "integer"}) == "4.5"  # not an integer: kept as written
    assert type_value("null", {"type": ["string", "null"]}) == "null"  # a string is allowed: the text
    assert type_value("null", {"anyOf": [{"type": "integer"}, {"type": "null"}]}) is None
    assert type_value("not json", {"type": "object"}) == "not json"
    assert type_value("7", None) == "7"
    assert parse_call("get_time", WEATHER, 0).arguments == {}
    assert parse_call("get_time", WEATHER, 0).arguments_json == "{}"
