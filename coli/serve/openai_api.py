"""The OpenAI-compatible request and response shapes the gateway speaks: strict parsing of request
bodies (every wrong type or value is an `ApiError` that names the parameter, answered as a 4xx with an
OpenAI-style error object) and builders for the response objects and stream chunks.

Supported: `/v1/chat/completions` and `/v1/completions` with `model`, `max_tokens` (chat also
`max_completion_tokens`), `temperature`, `top_p`, `top_k`, `seed`, `stop`, `n` (1 only), `stream`,
`stream_options.include_usage`, `user`; `echo` for completions. ColiStream extensions: `session`
(a conversation whose KV cache the run keeps between turns) with `new_session`, `ignore_eos`, and
`return_token_ids` (the generated ids beside the text). Chat takes tools (coli/serve/tools.py) and
`chat_template_kwargs`; assistant `tool_calls` / `reasoning_content` and `tool` messages are kept for the
template. Parameters OpenAI has but ColiStream does not implement (penalties, logit bias, logprobs,
`functions`, n > 1) are refused with a 400 rather than silently ignored."""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass, field
from typing import Any

MAX_STOP = 4
MAX_STOP_CHARS = 256
SESSION_RE = re.compile(r"[A-Za-z0-9._-]{1,128}")
ROLES = ("system", "developer", "user", "assistant", "tool")
_U64 = 1 << 64
MAX_TOP_K = (1 << 31) - 1  # far above any vocabulary; a bigger number is a client bug, not a filter


class ApiError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _bad(param: str, message: str, code: str | None = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


def _typename(v: Any) -> str:
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object",
            type(None): "null"}.get(type(v), type(v).__name__)


def get_int(body: dict, name: str, default: int | None, lo: int | None = None, hi: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, float) and v.is_integer() and abs(v) <= 2 ** 53:  # 3.0 is 3; 1e308 is no count of anything
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise _bad(name, f"'{name}' must be an integer, got {_typename(v)}", "invalid_type")
    if lo is not None and v < lo:
        raise _bad(name, f"'{name}' must be >= {lo}, got {v}")
    if hi is not None and v > hi:
        raise _bad(name, f"'{name}' must be <= {hi}, got {v}")
    return v


def get_float(body: dict, name: str, default: float, lo: float, hi: float) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _bad(name, f"'{name}' must be a number, got {_typename(v)}", "invalid_type")
    try:
        f = float(v)
    except OverflowError:  # an integer literal beyond any float (1e400 written out in digits)
        f = math.inf
    if not math.isfinite(f) or not lo <= f <= hi:
        shown = f"{f:g}" if math.isfinite(f) else "a number beyond any float"
        raise _bad(name, f"'{name}' must be between {lo:g} and {hi:g}, got {shown}")
    return f


def get_bool(body: dict, name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _bad(name, f"'{name}' must be a boolean, got {_typename(v)}", "invalid_type")
    return v


def get_str(body: dict, name: str, default: str | None, max_chars: int = 256) -> str | None:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, str):
        raise _bad(name, f"'{name}' must be a string, got {_typename(v)}", "invalid_type")
    if len(v) > max_chars:
        raise _bad(name, f"'{name}' must be at most {max_chars} characters, got {len(v)}")
    return v


@dataclass
class Params:
    """What both endpoints share, validated."""

    model: str | None
    max_tokens: int | None  # None: up to the context limit (or the gateway's default)
    greedy: bool
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: list[str]
    stream: bool
    include_usage: bool
    user: str | None
    session: str | None
    new_session: bool
    ignore_eos: bool
    return_token_ids: bool
    mtp: str | None = None  # MTP speculative decoding for this request (docs/mtp.md); None = the run's --mtp
    max_tokens_param: str = "max_tokens"  # the name the client used (chat also takes max_completion_tokens)
    created: int = field(default_factory=lambda: int(time.time()))


def _unsupported(body: dict) -> None:
    for name, ok in (("presence_penalty", lambda v: v in (None, 0, 0.0)),
                     ("frequency_penalty", lambda v: v in (None, 0, 0.0)),
                     ("repetition_penalty", lambda v: v in (None, 1, 1.0)),
                     ("logit_bias", lambda v: not v),
                     ("logprobs", lambda v: v in (None, False, 0)),
                     ("top_logprobs", lambda v: v in (None, 0)),
                     ("functions", lambda v: not v),
                     ("best_of", lambda v: v in (None, 1)),
                     ("suffix", lambda v: v in (None, ""))):
        if not ok(body.get(name)):
            raise _bad(name, f"'{name}' is not supported by this server", "unsupported_parameter")
    rf = body.get("response_format")
    if rf is not None and not (isinstance(rf, dict) and rf.get("type") in (None, "text")):
        raise _bad("response_format", "only response_format {'type': 'text'} is supported", "unsupported_parameter")


def parse_params(body: Any, max_tokens_names: tuple[str, ...] = ("max_tokens",)) -> Params:
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {_typename(body)}", code="invalid_json")
    _unsupported(body)
    model = get_str(body, "model", None)
    n = get_int(body, "n", 1)
    if n != 1:
        raise _bad("n", f"only n=1 is supported, got {n}", "unsupported_parameter")
    max_tokens, max_tokens_param = None, max_tokens_names[0]
    for name in max_tokens_names:
        v = get_int(body, name, None, lo=1)
        if v is not None:
            max_tokens, max_tokens_param = v, name
    temperature = get_float(body, "temperature", 1.0, 0.0, 2.0)
    top_p = get_float(body, "top_p", 1.0, 0.0, 1.0)
    top_k = get_int(body, "top_k", 0, lo=-1, hi=MAX_TOP_K)
    top_k = 0 if top_k == -1 else top_k  # -1 means "off", as vLLM spells it
    seed = get_int(body, "seed", None, lo=0, hi=_U64 - 1)
    stop_raw = body.get("stop")
    if stop_raw is None:
        stop: list[str] = []
    elif isinstance(stop_raw, str):
        stop = [stop_raw]
    elif isinstance(stop_raw, list) and all(isinstance(s, str) for s in stop_raw):
        stop = list(stop_raw)
    else:
        raise _bad("stop", "'stop' must be a string or an array of strings", "invalid_type")
    if len(stop) > MAX_STOP:
        raise _bad("stop", f"'stop' may hold at most {MAX_STOP} strings, got {len(stop)}")
    if any(len(s) > MAX_STOP_CHARS or not s for s in stop):
        raise _bad("stop", f"each stop string must be 1..{MAX_STOP_CHARS} characters")
    stream = get_bool(body, "stream", False)
    so = body.get("stream_options")
    if so is not None and not isinstance(so, dict):
        raise _bad("stream_options", "'stream_options' must be an object", "invalid_type")
    include_usage = get_bool(so or {}, "include_usage", False)
    if so is not None and not stream:
        raise _bad("stream_options", "'stream_options' is only allowed with stream: true")
    session = get_str(body, "session", None, max_chars=128)
    if session is not None and not SESSION_RE.fullmatch(session):
        raise _bad("session", "'session' must be 1..128 characters of A-Z a-z 0-9 . _ -")
    new_session = get_bool(body, "new_session", False)
    if new_session and session is None:
        raise _bad("new_session", "'new_session' needs a 'session' to create")
    return Params(model=model, max_tokens=max_tokens, greedy=temperature == 0.0 or top_p == 0.0,
                  temperature=temperature, top_p=top_p if top_p > 0 else 1.0, top_k=top_k, seed=seed, stop=stop,
                  stream=stream, include_usage=include_usage, user=get_str(body, "user", None),
                  session=session, new_session=new_session, ignore_eos=get_bool(body, "ignore_eos", False),
                  return_token_ids=get_bool(body, "return_token_ids", False), mtp=_mtp(body),
                  max_tokens_param=max_tokens_param)


def _mtp(body: dict) -> str | None:
    """`"mtp"`: "off" | "on" | "auto" | 1..3 (a number or its string), or absent (the run's --mtp)."""
    from coli.protocol.messages import MTP_MODES
    v = body.get("mtp")
    if v is None:
        return None
    if isinstance(v, bool):
        v = "on" if v else "off"
    elif isinstance(v, int):
        v = "off" if v == 0 else str(v)
    if not isinstance(v, str) or v.strip().lower() not in MTP_MODES:
        raise _bad("mtp", f"'mtp' must be one of off, on, auto, 1, 2, 3, got {v!r}")
    return v.strip().lower()


def _content_text(content: Any, i: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, p in enumerate(content):
            if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise _bad(f"messages[{i}].content[{j}]", "only text content parts ({'type': 'text', 'text': ...}) "
                           "are supported", "unsupported_content")
            parts.append(p["text"])
        return "".join(parts)
    raise _bad(f"messages[{i}].content", f"content must be a string or an array of text parts, got {_typename(content)}",
               "invalid_type")


_RESERVED_KWARGS = ("messages", "tools", "add_generation_prompt")


def template_kwargs(raw: Any, where: str = "chat_template_kwargs") -> dict:
    """Extra variables for the chat template (e.g. GLM's `enable_thinking`), as vLLM and SGLang take them."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise _bad(where, f"'{where}' must be an object", "invalid_type")
    for k in raw:
        if k in _RESERVED_KWARGS or not k.isidentifier():
            raise _bad(f"{where}.{k}", f"'{k}' cannot be set through {where}")
    return dict(raw)


def _assistant_extras(m: dict, i: int, out: dict) -> None:
    from coli.serve.tools import arguments_object

    rc = m.get("reasoning_content")
    if rc is not None:
        if not isinstance(rc, str):
            raise _bad(f"messages[{i}].reasoning_content", "'reasoning_content' must be a string", "invalid_type")
        out["reasoning_content"] = rc
    calls = m.get("tool_calls")
    if calls is None:
        return
    if not isinstance(calls, list):
        raise _bad(f"messages[{i}].tool_calls", "'tool_calls' must be an array", "invalid_type")
    norm = []
    for j, c in enumerate(calls):
        where = f"messages[{i}].tool_calls[{j}]"
        if not isinstance(c, dict) or not isinstance(c.get("function"), dict):
            raise _bad(where, "each tool call must be {'id', 'type': 'function', 'function': {name, arguments}}",
                       "invalid_type")
        name = c["function"].get("name")
        if not isinstance(name, str) or not name:
            raise _bad(f"{where}.function.name", "a tool call needs a function name", "invalid_type")
        cid = c.get("id")
        if cid is not None and not isinstance(cid, str):
            raise _bad(f"{where}.id", "'id' must be a string", "invalid_type")
        norm.append({"id": cid, "type": "function",
                     "function": {"name": name, "arguments": arguments_object(c["function"].get("arguments"),
                                                                              f"{where}.function.arguments")}})
    if norm:
        out["tool_calls"] = norm


def parse_chat(body: Any) -> tuple[list[dict], Params]:
    """-> (messages for the template, params); `parse_chat_tools` reads the tools of the same body."""
    p = parse_params(body, ("max_tokens", "max_completion_tokens"))
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise _bad("messages", "'messages' must be a non-empty array of message objects",
                   "invalid_type" if not isinstance(msgs, list) else "invalid_value")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise _bad(f"messages[{i}]", f"each message must be an object, got {_typename(m)}", "invalid_type")
        role = m.get("role")
        if role not in ROLES:
            raise _bad(f"messages[{i}].role", f"role must be one of {', '.join(ROLES)}, got {role!r}")
        msg = {"role": "system" if role == "developer" else role, "content": _content_text(m.get("content"), i)}
        if role == "assistant":
            _assistant_extras(m, i, msg)
        elif role == "tool":
            tid = m.get("tool_call_id")
            if tid is not None and not isinstance(tid, str):
                raise _bad(f"messages[{i}].tool_call_id", "'tool_call_id' must be a string", "invalid_type")
            msg["tool_call_id"] = tid
        out.append(msg)
    return out, p


def parse_completion(body: Any) -> tuple[str | list[int], bool, Params]:
    p = parse_params(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        pass
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if min(prompt) < 0:
            raise _bad("prompt", "token ids must be >= 0")
    elif isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(x, (str, list)) for x in prompt):
        raise _bad("prompt", "batched prompts are not supported: send one prompt per request", "unsupported_parameter")
    else:
        raise _bad("prompt", "'prompt' must be a string or an array of token ids", "invalid_type")
    return prompt, get_bool(body, "echo", False), p


# ---- responses ------------------------------------------------------------------------------------------
def usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def chat_chunk(rid: str, model: str, created: int, delta: dict, finish: str | None = None,
               token_ids: list[int] | None = None) -> dict:
    choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [choice]}


def completion_response(rid: str, model: str, created: int, text: str, finish: str, n_prompt: int,
                        n_completion: int, token_ids: list[int] | None = None) -> dict:
    choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [choice],
            "usage": usage(n_prompt, n_completion)}


def completion_chunk(rid: str, model: str, created: int, text: str, finish: str | None = None,
                     token_ids: list[int] | None = None) -> dict:
    choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [choice]}


def usage_chunk(rid: str, model: str, created: int, obj: str, n_prompt: int, n_completion: int) -> dict:
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
            "usage": usage(n_prompt, n_completion)}
