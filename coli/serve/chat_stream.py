"""What a chat answer looks like on the wire, for the two APIs: the parser's events (reasoning, content,
tool calls) as OpenAI chat chunks or Anthropic message events while streaming, and as the one response
object otherwise. `g` is the gateway's generation: it has `rid`, `p` (params), `n_prompt`, `n` (tokens
generated), `finish`, `asm` (text assembly; `stopped_by`) and `parser` (with `calls`)."""

from __future__ import annotations

import json
from typing import Any

from coli.serve.anthropic_api import BlockStream, error_body, event, message_response, stop_reason
from coli.serve.openai_api import ApiError, chat_chunk, usage, usage_chunk


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def openai_finish(g) -> str:
    return "tool_calls" if g.parser.calls and g.finish != "length" else g.finish


def _tool_call_obj(c) -> dict:
    return {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments_json}}


class OpenAIChatFormat:
    def __init__(self, g, model: str):
        self.g, self.model = g, model

    def _chunk(self, delta: dict, finish: str | None = None, ids: list[int] | None = None) -> str:
        g = self.g
        return _sse(chat_chunk(g.rid, self.model, g.p.created, delta, finish, ids))

    def start(self) -> list[str]:
        return [self._chunk({"role": "assistant", "content": ""})]

    def events(self, evs: list, ids: list[int] | None) -> list[str]:
        out = []
        for kind, v in evs:
            if kind == "reasoning":
                out.append(self._chunk({"reasoning_content": v}))
            elif kind == "content":
                out.append(self._chunk({"content": v}))
            else:  # as OpenAI streams a call: its id and name first, then the arguments in pieces
                out.append(self._chunk({"tool_calls": [{"index": v.index, "id": v.id, "type": "function",
                                                        "function": {"name": v.name, "arguments": ""}}]}))
                out.extend(self._chunk({"tool_calls": [{"index": v.index, "function": {"arguments": f}}]})
                           for f in v.fragments)
        if ids:
            out.append(self._chunk({}, ids=ids))
        return out

    def end(self) -> list[str]:
        g = self.g
        out = [self._chunk({}, openai_finish(g))]
        if g.p.include_usage:
            out.append(_sse(usage_chunk(g.rid, self.model, g.p.created, "chat.completion.chunk", g.n_prompt, g.n)))
        return out + ["data: [DONE]\n\n"]

    def error(self, e: ApiError) -> list[str]:
        return [_sse(e.body()), "data: [DONE]\n\n"]


def openai_chat_object(g, model: str, evs: list) -> dict:
    reasoning = "".join(v for k, v in evs if k == "reasoning")
    content = "".join(v for k, v in evs if k == "content")
    calls = [v for k, v in evs if k == "tool_call"]
    msg: dict[str, Any] = {"role": "assistant", "content": content if content or not calls else None}
    if reasoning:
        msg["reasoning_content"] = reasoning
    if calls:
        msg["tool_calls"] = [_tool_call_obj(c) for c in calls]
    choice: dict[str, Any] = {"index": 0, "message": msg, "logprobs": None, "finish_reason": openai_finish(g)}
    if g.p.return_token_ids:
        choice["token_ids"] = g.asm.token_ids
    return {"id": g.rid, "object": "chat.completion", "created": g.p.created, "model": model, "choices": [choice],
            "usage": usage(g.n_prompt, g.n)}


def _reason(g) -> str:
    return stop_reason(g.finish, g.asm.stopped_by, len(g.parser.calls))


class AnthropicFormat:
    def __init__(self, g, model: str):
        self.g, self.model = g, model
        self.blocks = BlockStream()

    def start(self) -> list[str]:
        g = self.g
        msg = message_response(g.rid, self.model, [], None, None, g.n_prompt, 0)
        return [event("message_start", {"message": msg}), event("ping", {})]

    def events(self, evs: list, ids: list[int] | None) -> list[str]:
        out: list[str] = []
        for kind, v in evs:
            out += self.blocks.push(kind, v)
        return out

    def end(self) -> list[str]:
        g = self.g
        return self.blocks.close() + [
            event("message_delta", {"delta": {"stop_reason": _reason(g), "stop_sequence": g.asm.stopped_by},
                                    "usage": {"output_tokens": g.n}}),
            event("message_stop", {})]

    def error(self, e: ApiError) -> list[str]:
        return [f"event: error\ndata: {json.dumps(error_body(e), ensure_ascii=False)}\n\n"]


def anthropic_message_object(g, model: str, evs: list) -> dict:
    blocks: list[dict] = []
    for kind, v in evs:
        if kind == "reasoning":
            if blocks and blocks[-1]["type"] == "thinking":
                blocks[-1]["thinking"] += v
            else:
                blocks.append({"type": "thinking", "thinking": v, "signature": ""})
        elif kind == "content":
            if blocks and blocks[-1]["type"] == "text":
                blocks[-1]["text"] += v
            else:
                blocks.append({"type": "text", "text": v})
        else:
            blocks.append({"type": "tool_use", "id": v.id, "name": v.name, "input": v.arguments})
    return message_response(g.rid, model, blocks, _reason(g), g.asm.stopped_by, g.n_prompt, g.n)
