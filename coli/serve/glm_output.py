"""GLM's assistant output -> reasoning, content and tool calls, incrementally (stream and not).

GLM-5 (like GLM-4.5/4.7) writes its reasoning before `</think>` (its chat template opens `<think>` at the end
of the generation prompt when thinking is on, `</think>` when it is off) and calls tools as

    <tool_call>NAME<arg_key>K1</arg_key><arg_value>V1</arg_value><arg_key>K2</arg_key><arg_value>V2</arg_value></tool_call>

(GLM-4.5 put newlines between the parts; whitespace between them is allowed). The template prints string
values as they are and everything else as JSON, so values are typed back from the tool's JSON schema: a
parameter declared as a string stays the text, any other type is parsed as JSON when it parses.

A call is released only once its `</tool_call>` has arrived and it parses (a known tool name, key/value
pairs and nothing else, no key twice): text that looks like a call but is not one stays content, as it was
written. Partial tags at the end of the text seen so far are held back until the next text decides them."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_PAIR = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)
_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,128}")


@dataclass
class ToolCall:
    index: int
    id: str
    name: str
    arguments: dict[str, Any]
    fragments: list[str] = field(default_factory=list)  # the arguments JSON in pieces, one per key, for streams

    @property
    def arguments_json(self) -> str:
        return "".join(self.fragments)


def new_call_id(prefix: str = "call_") -> str:
    return prefix + uuid.uuid4().hex[:24]


def _schema_types(schema: Any) -> set[str]:
    if not isinstance(schema, dict):
        return set()
    t = schema.get("type")
    types = set(t) if isinstance(t, list) else {t} if isinstance(t, str) else set()
    for alt in schema.get("anyOf") or schema.get("oneOf") or ():
        types |= _schema_types(alt)
    if not types and "enum" in schema and all(isinstance(e, str) for e in schema["enum"]):
        types.add("string")
    return types


def type_value(raw: str, schema: Any) -> Any:
    """A value as the template printed it -> the value, by the parameter's JSON schema."""
    types = _schema_types(schema)
    if not types or "string" in types:
        return raw  # a string parameter, or one we know nothing about: exactly the text the model wrote
    try:
        v = json.loads(raw)
    except ValueError:
        return raw
    ok = {"integer": lambda x: isinstance(x, int) and not isinstance(x, bool),
          "number": lambda x: isinstance(x, (int, float)) and not isinstance(x, bool),
          "boolean": lambda x: isinstance(x, bool), "object": lambda x: isinstance(x, dict),
          "array": lambda x: isinstance(x, list), "null": lambda x: x is None}
    return v if any(ok.get(t, lambda x: False)(v) for t in types) else raw


def parse_call(block: str, tools: dict[str, dict], index: int, id_prefix: str = "call_") -> ToolCall | None:
    """The text between <tool_call> and </tool_call> -> a ToolCall, or None if it is not a valid call."""
    head, sep, rest = block.partition("<arg_key>")
    name = head.strip()
    if not _NAME.fullmatch(name) or (tools and name not in tools):
        return None
    props = ((tools.get(name) or {}).get("properties") or {}) if tools else {}
    args: dict[str, Any] = {}
    pos, body = 0, sep + rest
    while pos < len(body):
        m = _PAIR.match(body, pos)
        if m is None:
            if body[pos:].strip():
                return None  # something other than key/value pairs inside the call
            break
        key, raw = m.group(1).strip(), m.group(2)
        if not key or key in args:
            return None
        args[key] = type_value(raw, props.get(key))
        pos = m.end()
    items = [f"{json.dumps(k, ensure_ascii=False)}: {json.dumps(v, ensure_ascii=False)}" for k, v in args.items()]
    frags = ["{" + items[0]] + [", " + it for it in items[1:]] + ["}"] if items else ["{}"]
    return ToolCall(index, new_call_id(id_prefix), name, args, frags)


def _held(text: str, tags: tuple[str, ...]) -> int:
    """How many characters at the end of `text` could be the start of one of `tags`."""
    for n in range(min(len(text), max(len(t) for t in tags) - 1), 0, -1):
        if any(t.startswith(text[-n:]) for t in tags):
            return n
    return 0


class OutputParser:
    """feed(text) / finish() -> events: ("reasoning", str), ("content", str), ("tool_call", ToolCall).

    `tools` maps each declared tool's name to its parameters schema (None: calls are not parsed, all text is
    content). `reasoning`: the prompt ended inside `<think>` (GLM with thinking on). `parallel=False` stops
    after the first call (`done` turns True: the caller stops generating)."""

    def __init__(self, tools: dict[str, dict] | None = None, reasoning: bool = False, parallel: bool = True,
                 id_prefix: str = "call_"):
        self.tools = tools
        self.state = "reasoning" if reasoning else "start"
        self.parallel = parallel
        self.id_prefix = id_prefix
        self.buf = ""
        self.calls: list[ToolCall] = []
        self.done = False
        self._ws = ""  # whitespace after a call, held until real content follows it
        self._strip = {"reasoning": True, "content": False}  # leading whitespace after <think> / </think>

    def feed(self, text: str) -> list[tuple[str, Any]]:
        self.buf += text
        return self._run(final=False)

    def finish(self) -> list[tuple[str, Any]]:
        return self._run(final=True)

    def _emit(self, out: list, kind: str, text: str) -> None:
        if self._strip[kind]:
            text = text.lstrip()
            if not text:
                return
            self._strip[kind] = False
        if out and out[-1][0] == kind:
            out[-1] = (kind, out[-1][1] + text)
        else:
            out.append((kind, text))

    def _content(self, out: list, text: str) -> None:
        if not text:
            return
        if self.calls and not (self._ws + text).strip():
            self._ws += text  # only whitespace after a call so far: not content (yet)
            return
        text, self._ws = self._ws + text, ""
        self._emit(out, "content", text)

    def _run(self, final: bool) -> list[tuple[str, Any]]:
        out: list[tuple[str, Any]] = []
        while not self.done:
            if self.state == "start":  # a model may open <think> itself
                stripped = self.buf.lstrip()
                if stripped.startswith(THINK_OPEN):
                    self.buf, self.state = stripped[len(THINK_OPEN):], "reasoning"
                elif not final and stripped and THINK_OPEN.startswith(stripped):
                    break
                elif not final and not stripped:
                    break
                else:
                    self.state = "content"
                continue
            if self.state == "reasoning":
                i = self.buf.find(THINK_CLOSE)
                if i >= 0:
                    text, self.buf, self.state = self.buf[:i], self.buf[i + len(THINK_CLOSE):], "content"
                    self._strip["content"] = True
                else:
                    # hold a possible start of </think>, and trailing whitespace (dropped if </think> follows)
                    keep = 0
                    if not final:
                        keep = _held(self.buf, (THINK_CLOSE,))
                        rest = self.buf[:len(self.buf) - keep]
                        keep += len(rest) - len(rest.rstrip())
                    text, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
                if text:
                    self._emit(out, "reasoning", text.rstrip() if i >= 0 else text)
                if i < 0:
                    break
                continue
            if self.state == "content":
                i = self.buf.find(CALL_OPEN) if self.tools is not None else -1
                if i >= 0:
                    self._content(out, self.buf[:i])
                    self.buf, self.state = self.buf[i + len(CALL_OPEN):], "call"
                    continue
                keep = 0 if final or self.tools is None else _held(self.buf, (CALL_OPEN,))
                self._content(out, self.buf[:len(self.buf) - keep])
                self.buf = self.buf[len(self.buf) - keep:]
                break
            # state "call": everything up to </tool_call> is the call
            i = self.buf.find(CALL_CLOSE)
            if i < 0:
                if final:  # the generation ended inside a call: it was not one
                    self._content(out, CALL_OPEN + self.buf)
                    self.buf = ""
                break
            block, self.buf, self.state = self.buf[:i], self.buf[i + len(CALL_CLOSE):], "content"
            call = parse_call(block, self.tools or {}, len(self.calls), self.id_prefix)
            if call is None:
                self._content(out, CALL_OPEN + block + CALL_CLOSE)
                continue
            self.calls.append(call)
            self._ws = ""
            out.append(("tool_call", call))
            if not self.parallel:
                self.done = True
        return out
