"""The Anthropic Messages API shapes (`POST /v1/messages`, `/v1/messages/count_tokens`): requests parsed into
the same messages / params / tools the OpenAI chat path uses (so both go through the model's own chat
template), and the response objects, stream events and error objects Anthropic clients expect.

Content blocks: `text`, `tool_use` and `tool_result` (rendered as assistant tool calls and `tool` messages),
`thinking` (rendered back as the assistant's reasoning). `thinking: {"type": "enabled"}` turns the template's
`enable_thinking` on; without it the model answers without thinking, as Anthropic's API does."""

from __future__ import annotations

import uuid
from typing import Any

from coli.serve.openai_api import (MAX_STOP, MAX_STOP_CHARS, ApiError, Params, _bad, _typename, get_bool, get_float,
                                   get_int, get_str, parse_params)
from coli.serve.tools import ToolSpec, anthropic_tools

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                503: "overloaded_error", 504: "api_error"}


def error_body(e: ApiError) -> dict:
    msg = e.message if not e.param or e.param in e.message else f"{e.param}: {e.message}"
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(e.status, "api_error"), "message": msg}}


def new_message_id() -> str:
    return "msg_" + uuid.uuid4().hex[:24]


def _text_of(blocks: Any, where: str, allow_str: bool = True) -> str:
    if isinstance(blocks, str) and allow_str:
        return blocks
    if not isinstance(blocks, list):
        raise _bad(where, f"'{where}' must be a string or an array of text blocks", "invalid_type")
    out = []
    for j, b in enumerate(blocks):
        if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
            raise _bad(f"{where}[{j}]", "only text blocks ({'type': 'text', 'text': ...}) are supported here",
                       "unsupported_content")
        out.append(b["text"])
    return "".join(out)


def _user(m: dict, i: int) -> list[dict]:
    content = m.get("content")
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    if not isinstance(content, list):
        raise _bad(f"messages[{i}].content", f"content must be a string or an array of blocks, got "
                                              f"{_typename(content)}", "invalid_type")
    results, texts = [], []
    for j, b in enumerate(content):
        where = f"messages[{i}].content[{j}]"
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text" and isinstance(b.get("text"), str):
            texts.append(b["text"])
        elif kind == "tool_result":
            tid = b.get("tool_use_id")
            if not isinstance(tid, str) or not tid:
                raise _bad(f"{where}.tool_use_id", "a tool_result needs its tool_use_id", "invalid_type")
            c = b.get("content", "")
            text = _text_of(c, f"{where}.content") if c is not None else ""
            results.append({"role": "tool", "tool_call_id": tid, "content": text})
        else:
            raise _bad(where, f"content blocks of type {kind!r} are not supported in user messages (text and "
                              f"tool_result are)", "unsupported_content")
    return results + ([{"role": "user", "content": "".join(texts)}] if texts or not results else [])


def _assistant(m: dict, i: int) -> dict:
    content = m.get("content")
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    if not isinstance(content, list):
        raise _bad(f"messages[{i}].content", "content must be a string or an array of blocks", "invalid_type")
    texts, thinking, calls = [], [], []
    for j, b in enumerate(content):
        where = f"messages[{i}].content[{j}]"
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text" and isinstance(b.get("text"), str):
            texts.append(b["text"])
        elif kind == "thinking" and isinstance(b.get("thinking"), str):
            thinking.append(b["thinking"])
        elif kind == "redacted_thinking":
            continue
        elif kind == "tool_use":
            if not isinstance(b.get("id"), str) or not isinstance(b.get("name"), str):
                raise _bad(where, "a tool_use block needs 'id' and 'name'", "invalid_type")
            inp = b.get("input", {})
            if not isinstance(inp, dict):
                raise _bad(f"{where}.input", "'input' must be an object", "invalid_type")
            calls.append({"id": b["id"], "type": "function", "function": {"name": b["name"], "arguments": inp}})
        else:
            raise _bad(where, f"content blocks of type {kind!r} are not supported in assistant messages",
                       "unsupported_content")
    out: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if thinking:
        out["reasoning_content"] = "".join(thinking)
    if calls:
        out["tool_calls"] = calls
    return out


def parse_messages(body: Any, count_only: bool = False) -> tuple[list[dict], Params, ToolSpec, dict]:
    """-> (messages for the template, params, tools, template kwargs)."""
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {_typename(body)}", code="invalid_json")
    if not count_only and body.get("max_tokens") is None:
        raise _bad("max_tokens", "'max_tokens' is required", "invalid_type")
    get_float(body, "temperature", 1.0, 0.0, 1.0)  # Anthropic's range
    stops = body.get("stop_sequences")
    if stops is not None and not (isinstance(stops, list) and all(isinstance(s, str) for s in stops)):
        raise _bad("stop_sequences", "'stop_sequences' must be an array of strings", "invalid_type")
    if stops and (len(stops) > MAX_STOP or any(not s or len(s) > MAX_STOP_CHARS for s in stops)):
        raise _bad("stop_sequences", f"at most {MAX_STOP} stop sequences of 1..{MAX_STOP_CHARS} characters")
    meta = body.get("metadata")
    if meta is not None and not isinstance(meta, dict):
        raise _bad("metadata", "'metadata' must be an object", "invalid_type")
    user = get_str(meta or {}, "user_id", None)
    p = parse_params({"model": body.get("model"), "max_tokens": body.get("max_tokens") if not count_only else None,
                      "temperature": body.get("temperature"), "top_p": body.get("top_p"),
                      "top_k": body.get("top_k"), "stop": stops or None, "stream": body.get("stream"),
                      "user": user, "mtp": body.get("mtp")})
    get_int(body, "max_tokens", None, lo=1)
    thinking = body.get("thinking")
    enable = False
    if thinking is not None:
        if not isinstance(thinking, dict) or thinking.get("type") not in ("enabled", "disabled", "adaptive"):
            raise _bad("thinking", "'thinking' must be {'type': 'enabled' | 'disabled'}")
        enable = thinking["type"] != "disabled"
    get_bool(body, "stream", False)

    out: list[dict] = []
    system = body.get("system")
    if system is not None:
        text = _text_of(system, "system")
        if text:
            out.append({"role": "system", "content": text})
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise _bad("messages", "'messages' must be a non-empty array", "invalid_type")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise _bad(f"messages[{i}]", "each message must be an object", "invalid_type")
        role = m.get("role")
        if role == "user":
            out.extend(_user(m, i))
        elif role == "assistant":
            out.append(_assistant(m, i))
        else:
            raise _bad(f"messages[{i}].role", f"role must be 'user' or 'assistant', got {role!r}")
    return out, p, anthropic_tools(body), {"enable_thinking": enable}


# ---- responses ------------------------------------------------------------------------------------------
def stop_reason(finish: str, stopped_by: str | None, n_calls: int) -> str:
    if n_calls:
        return "tool_use"
    if stopped_by is not None:
        return "stop_sequence"
    return "max_tokens" if finish == "length" else "end_turn"


def message_response(mid: str, model: str, blocks: list[dict], reason: str, stop_seq: str | None, n_in: int,
                     n_out: int) -> dict:
    return {"id": mid, "type": "message", "role": "assistant", "model": model, "content": blocks,
            "stop_reason": reason, "stop_sequence": stop_seq,
            "usage": {"input_tokens": n_in, "output_tokens": n_out}}


def event(name: str, data: dict) -> str:
    import json
    return f"event: {name}\ndata: {json.dumps({'type': name, **data}, ensure_ascii=False, separators=(',', ':'))}\n\n"


class BlockStream:
    """Turns parser events into content_block_start / delta / stop events, one block per kind change."""

    def __init__(self):
        self.index = -1
        self.open: str | None = None

    def _start(self, kind: str, block: dict) -> list[str]:
        out = self.close()
        self.index += 1
        self.open = kind
        return out + [event("content_block_start", {"index": self.index, "content_block": block})]

    def close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [event("content_block_stop", {"index": self.index})]

    def push(self, kind: str, value: Any) -> list[str]:
        out: list[str] = []
        if kind == "reasoning":
            if self.open != "thinking":
                out += self._start("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            out.append(event("content_block_delta", {"index": self.index,
                                                     "delta": {"type": "thinking_delta", "thinking": value}}))
        elif kind == "content":
            if self.open != "text":
                out += self._start("text", {"type": "text", "text": ""})
            out.append(event("content_block_delta", {"index": self.index,
                                                     "delta": {"type": "text_delta", "text": value}}))
        else:  # a tool call: its own block, the input JSON in pieces
            out += self._start("tool_use", {"type": "tool_use", "id": value.id, "name": value.name, "input": {}})
            for frag in value.fragments:
                out.append(event("content_block_delta", {"index": self.index,
                                                         "delta": {"type": "input_json_delta", "partial_json": frag}}))
            out += self.close()
        return out
