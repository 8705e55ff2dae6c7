"""Bad input gets a 4xx with an OpenAI-style error object that names the culprit, and the gateway keeps
serving: malformed JSON, wrong types, unknown model, negative or huge max_tokens, a prompt longer than the
context, unknown or malformed sessions, unsupported parameters, oversized bodies, unknown routes."""

from __future__ import annotations

import json

import pytest

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSG = [{"role": "user", "content": "Hello"}]


def _cases(ctx: int):
    big_ids = [5] * ctx
    return [
        # (id, path, body or raw bytes, status, error code, param)
        ("malformed-json", CHAT, b'{"messages": [', 400, "invalid_json", None),
        ("empty-body", CHAT, b"", 400, "invalid_json", None),
        ("deeply-nested", COMP, b'{"prompt": ' + b"[" * 200_000 + b"]" * 200_000 + b"}", 400, "invalid_json", None),
        ("nan-literal", COMP, b'{"prompt": "x", "temperature": NaN}', 400, "invalid_json", None),
        ("body-not-object", CHAT, [1, 2], 400, "invalid_json", None),
        ("messages-missing", CHAT, {"max_tokens": 3}, 400, "invalid_type", "messages"),
        ("messages-not-list", CHAT, {"messages": "hi"}, 400, "invalid_type", "messages"),
        ("message-not-object", CHAT, {"messages": ["hi"]}, 400, "invalid_type", "messages[0]"),
        ("bad-role", CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "invalid_value", "messages[0].role"),
        ("image-part", CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
         400, "unsupported_content", "messages[0].content[0]"),
        ("max-tokens-string", CHAT, {"messages": MSG, "max_tokens": "10"}, 400, "invalid_type", "max_tokens"),
        ("max-tokens-bool", CHAT, {"messages": MSG, "max_tokens": True}, 400, "invalid_type", "max_tokens"),
        ("max-tokens-negative", CHAT, {"messages": MSG, "max_tokens": -5}, 400, "invalid_value", "max_tokens"),
        ("max-tokens-zero", COMP, {"prompt": "x", "max_tokens": 0}, 400, "invalid_value", "max_tokens"),
        ("max-tokens-huge", CHAT, {"messages": MSG, "max_tokens": 10 ** 12}, 400, "context_length_exceeded",
         "max_tokens"),
        ("temperature-string", CHAT, {"messages": MSG, "temperature": "hot"}, 400, "invalid_type", "temperature"),
        ("temperature-range", CHAT, {"messages": MSG, "temperature": 7}, 400, "invalid_value", "temperature"),
        ("top-p-range", COMP, {"prompt": "x", "top_p": 1.5}, 400, "invalid_value", "top_p"),
        ("top-k-negative", COMP, {"prompt": "x", "top_k": -3}, 400, "invalid_value", "top_k"),
        ("seed-negative", COMP, {"prompt": "x", "seed": -1}, 400, "invalid_value", "seed"),
        ("seed-float", COMP, {"prompt": "x", "seed": 1.5}, 400, "invalid_type", "seed"),
        ("stream-string", CHAT, {"messages": MSG, "stream": "yes"}, 400, "invalid_type", "stream"),
        ("stop-number", COMP, {"prompt": "x", "stop": 5}, 400, "invalid_type", "stop"),
        ("stop-too-many", COMP, {"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "invalid_value", "stop"),
        ("n-2", COMP, {"prompt": "x", "n": 2}, 400, "unsupported_parameter", "n"),
        ("logprobs", CHAT, {"messages": MSG, "logprobs": True}, 400, "unsupported_parameter", "logprobs"),
        ("penalty", CHAT, {"messages": MSG, "presence_penalty": 0.5}, 400, "unsupported_parameter",
         "presence_penalty"),
        ("unknown-model", CHAT, {"model": "gpt-17", "messages": MSG}, 404, "model_not_found", "model"),
        ("prompt-missing", COMP, {"max_tokens": 3}, 400, "invalid_type", "prompt"),
        ("prompt-dict", COMP, {"prompt": {"a": 1}}, 400, "invalid_type", "prompt"),
        ("prompt-batch", COMP, {"prompt": ["a", "b"]}, 400, "unsupported_parameter", "prompt"),
        ("prompt-negative-id", COMP, {"prompt": [1, -2]}, 400, "invalid_value", "prompt"),
        ("prompt-id-outside-vocab", COMP, {"prompt": [1, 10 ** 9]}, 400, None, "prompt"),
        ("prompt-empty", COMP, {"prompt": ""}, 400, "empty_prompt", "prompt"),
        ("prompt-longer-than-context", COMP, {"prompt": big_ids, "max_tokens": 1}, 400, "context_length_exceeded",
         "prompt"),
        ("text-longer-than-context", CHAT, {"messages": [{"role": "user", "content": "hello world " * ctx}]}, 400,
         "context_length_exceeded", "messages"),
        ("prompt-plus-max-tokens", COMP, {"prompt": big_ids[:ctx - 2], "max_tokens": 5}, 400,
         "context_length_exceeded", "max_tokens"),
        ("session-bad-name", CHAT, {"messages": MSG, "session": "a b/c"}, 400, "invalid_value", "session"),
        ("session-not-string", CHAT, {"messages": MSG, "session": 42}, 400, "invalid_type", "session"),
        ("session-too-long", CHAT, {"messages": MSG, "session": "x" * 129}, 400, "invalid_value", "session"),
        ("new-session-alone", CHAT, {"messages": MSG, "new_session": True}, 400, "invalid_value", "new_session"),
        ("top-k-2-to-63", COMP, {"prompt": "x", "top_k": 2 ** 63}, 400, "invalid_value", "top_k"),
        ("temperature-beyond-float", COMP, b'{"prompt": "x", "temperature": 1' + b"0" * 400 + b"}", 400,
         "invalid_value", "temperature"),
        ("lone-surrogate-prompt", COMP, b'{"prompt": "hi \\ud800 there"}', 400, "invalid_unicode", "prompt"),
        ("lone-surrogate-content", CHAT, b'{"messages": [{"role": "user", "content": "a\\udc00"}]}', 400,
         "invalid_unicode", "messages[0].content"),
        ("lone-surrogate-stop", COMP, b'{"prompt": "x", "stop": ["ok", "\\udfff"]}', 400, "invalid_unicode",
         "stop[1]"),
        ("lone-surrogate-key", COMP, b'{"prompt": "x", "\\ud83d": 1}', 400, "invalid_unicode", "<key>"),
        ("stream-options-without-stream", CHAT, {"messages": MSG, "stream_options": {"include_usage": True}}, 400,
         "invalid_value", "stream_options"),
    ]


@pytest.mark.timeout(120)
def test_bad_requests_get_4xx_openai_errors_and_the_server_keeps_serving(gateway, run_info):
    ctx = run_info["max_position_embeddings"]
    failures = []
    for name, path, body, status, code, param in _cases(ctx):
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        got, headers, data = gateway.request("POST", path, raw=raw)
        try:
            err = json.loads(data)["error"]
            ok = (got == status and err["type"] and err["message"] and err.get("code") == (code or err.get("code"))
                  and err.get("param") == param and headers.get("content-type", "").startswith("application/json"))
        except (ValueError, KeyError, TypeError):
            ok, err = False, data[:200]
        if not ok:
            failures.append(f"{name}: HTTP {got} {err}")
    assert not failures, "\n".join(failures)
    # still serving
    status, out = gateway.post(COMP, {"prompt": "Hello", "max_tokens": 3, "temperature": 0})
    assert status == 200 and out["usage"]["completion_tokens"] >= 1


@pytest.mark.timeout(60)
def test_routes_methods_and_body_limit(gateway):
    status, _, data = gateway.request("GET", "/v2/nothing")
    assert status == 404 and json.loads(data)["error"]["code"] == "not_found"
    status, _, data = gateway.request("GET", CHAT)
    assert status == 405 and json.loads(data)["error"]["code"] == "method_not_allowed"
    status, _, data = gateway.request("POST", COMP, raw=b'{"prompt": "' + b"a" * (5 << 20) + b'"}')
    assert status == 413 and json.loads(data)["error"]["code"] == "body_too_large"
    status, _, data = gateway.request("GET", "/v1/models/no-such-model")
    assert status == 404 and json.loads(data)["error"]["code"] == "model_not_found"


@pytest.mark.timeout(120)
def test_sessions_unknown_is_404_created_with_new_session_then_reused(gateway):
    body = {"messages": [{"role": "user", "content": "Hello! Who are you?"}], "max_tokens": 6, "temperature": 0}
    status, out = gateway.post(CHAT, {**body, "session": "gw-test-unknown"})
    assert status == 404 and out["error"]["code"] == "session_not_found" and out["error"]["param"] == "session"
    status, first = gateway.post(CHAT, {**body, "session": "gw-test-s1", "new_session": True})
    assert status == 200, first
    turn2 = {**body, "session": "gw-test-s1", "messages": body["messages"] + [
        {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
        {"role": "user", "content": "And what does os.path.join do?"}]}
    status, second = gateway.post(CHAT, turn2)
    assert status == 200 and second["usage"]["prompt_tokens"] > first["usage"]["prompt_tokens"]
    # the same conversation without the session gives the same tokens (the reused KV prefix is exact)
    status, plain = gateway.post(CHAT, {k: v for k, v in turn2.items() if k != "session"})
    assert status == 200 and plain["choices"][0]["message"]["content"] == second["choices"][0]["message"]["content"]


# every field, every wrong kind of value: never a 500, and a 400 names the field it is about
_SHARED = ["model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n", "stream", "stream_options",
           "user", "session", "new_session", "ignore_eos", "return_token_ids", "response_format", "logprobs",
           "presence_penalty"]
_FIELDS = {CHAT: _SHARED + ["messages", "max_completion_tokens", "tools", "tool_choice", "parallel_tool_calls",
                            "chat_template_kwargs"],
           COMP: ["prompt", "echo", "max_tokens", "top_k", "seed"]}
_VALUES = [2 ** 63, 2 ** 64, -(2 ** 63), 10 ** 30, 1e308, -1, "x", [], [1, "a"], {}, {"a": None}, True,
           [[[[]]]]]


@pytest.mark.timeout(300)
def test_every_field_with_every_wrong_value_is_a_4xx_naming_it(gateway):
    from concurrent.futures import ThreadPoolExecutor

    base = {CHAT: {"messages": MSG, "max_tokens": 1}, COMP: {"prompt": "Hi", "max_tokens": 1}}

    def one(case):
        path, field, v = case
        body = {**base[path], field: v}
        if field == "max_completion_tokens":
            body.pop("max_tokens")
        got, _, data = gateway.request("POST", path, body, timeout=60)
        if got == 200:
            return None
        try:
            err = json.loads(data)["error"]
        except (ValueError, KeyError, TypeError):
            return f"{path} {field}={v!r:.40}: HTTP {got} not an error object: {data[:120]!r}"
        if got >= 500 or (err.get("param") and not str(err["param"]).startswith(field)
                          and err["param"] not in ("messages", "prompt")):
            return f"{path} {field}={v!r:.40}: HTTP {got} {err}"
        return None

    cases = [(path, f, v) for path, fields in _FIELDS.items() for f in fields for v in _VALUES]
    with ThreadPoolExecutor(8) as pool:  # the 4xx never reach the executor; the few valid ones queue there
        failures = [f for f in pool.map(one, cases) if f]
    assert not failures, "\n".join(failures)
