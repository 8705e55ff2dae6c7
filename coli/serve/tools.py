"""Tool declarations and tool choice, validated, as both APIs give them (OpenAI `tools` / `tool_choice` /
`parallel_tool_calls`, Anthropic `tools` / `tool_choice`), in one shape for the chat template and the
output parser: `tools` as the template expects them ({"type": "function", "function": {name, description,
parameters}}), the parameters schema by name, the choice and whether several calls may come at once."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from coli.serve.openai_api import ApiError

MAX_TOOLS = 128
_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,128}")


def _bad(param: str, message: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


@dataclass
class ToolSpec:
    tools: list[dict] | None = None                        # for the template; None: no tools
    schemas: dict[str, dict] = field(default_factory=dict)  # name -> parameters schema
    choice: str = "auto"                                    # auto | none | required | named
    name: str | None = None                                 # the named tool, with choice "named"
    parallel: bool = True

    @property
    def parse_calls(self) -> bool:
        return bool(self.tools) and self.choice != "none"


def _tool(name: Any, description: Any, params: Any, where: str) -> dict:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise _bad(f"{where}.name", "a tool name must be 1..128 characters of A-Z a-z 0-9 _ . : -")
    if description is not None and not isinstance(description, str):
        raise _bad(f"{where}.description", "'description' must be a string", "invalid_type")
    if params is None:
        params = {"type": "object", "properties": {}}
    if not isinstance(params, dict):
        raise _bad(f"{where}.parameters", "the parameters must be a JSON schema object", "invalid_type")
    props = params.get("properties", {})
    if not isinstance(props, dict):
        raise _bad(f"{where}.parameters.properties", "'properties' must be an object", "invalid_type")
    fn = {"name": name, **({"description": description} if description is not None else {}), "parameters": params}
    return {"type": "function", "function": fn}


def _spec(tools: list[dict], where: str) -> ToolSpec:
    names = [t["function"]["name"] for t in tools]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise _bad(where, f"tool {dup!r} is declared twice")
    return ToolSpec(tools=tools or None, schemas={t["function"]["name"]: t["function"]["parameters"] for t in tools})


def _list(raw: Any, where: str) -> list:
    if not isinstance(raw, list):
        raise _bad(where, f"'{where}' must be an array of tools", "invalid_type")
    if len(raw) > MAX_TOOLS:
        raise _bad(where, f"at most {MAX_TOOLS} tools, got {len(raw)}")
    return raw


def openai_tools(body: dict) -> ToolSpec:
    raw = body.get("tools")
    tools = []
    for i, t in enumerate(_list(raw, "tools") if raw is not None else []):
        where = f"tools[{i}]"
        if (not isinstance(t, dict) or t.get("type", "function") != "function"
                or not isinstance(t.get("function"), dict)):
            raise _bad(where, "each tool must be {'type': 'function', 'function': {...}}", "invalid_type")
        f = t["function"]
        tools.append(_tool(f.get("name"), f.get("description"), f.get("parameters"), f"{where}.function"))
    spec = _spec(tools, "tools")
    choice = body.get("tool_choice")
    if choice is None or choice == "auto":
        spec.choice = "auto"
    elif choice in ("none", "required"):
        spec.choice = choice
    elif isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        spec.choice, spec.name = "named", choice["function"].get("name")
    else:
        raise _bad("tool_choice", "'tool_choice' must be 'auto', 'none', 'required' or "
                                  "{'type': 'function', 'function': {'name': ...}}")
    par = body.get("parallel_tool_calls")
    if par is not None and not isinstance(par, bool):
        raise _bad("parallel_tool_calls", "'parallel_tool_calls' must be a boolean", "invalid_type")
    spec.parallel = par is not False
    _check_choice(spec, "tool_choice")
    return spec


def anthropic_tools(body: dict) -> ToolSpec:
    raw = body.get("tools")
    tools = []
    for i, t in enumerate(_list(raw, "tools") if raw is not None else []):
        if not isinstance(t, dict):
            raise _bad(f"tools[{i}]", "each tool must be an object", "invalid_type")
        if t.get("type") not in (None, "custom"):
            raise _bad(f"tools[{i}].type", f"server tools ({t.get('type')!r}) are not supported; declare "
                                           f"client tools with name, description and input_schema",
                       "unsupported_parameter")
        tools.append(_tool(t.get("name"), t.get("description"), t.get("input_schema"), f"tools[{i}]"))
    spec = _spec(tools, "tools")
    choice = body.get("tool_choice")
    if choice is not None:
        if not isinstance(choice, dict) or choice.get("type") not in ("auto", "any", "tool", "none"):
            raise _bad("tool_choice", "'tool_choice' must be {'type': 'auto' | 'any' | 'tool' | 'none'}")
        spec.choice = {"auto": "auto", "any": "required", "tool": "named", "none": "none"}[choice["type"]]
        spec.name = choice.get("name") if choice["type"] == "tool" else None
        dis = choice.get("disable_parallel_tool_use")
        if dis is not None and not isinstance(dis, bool):
            raise _bad("tool_choice.disable_parallel_tool_use", "must be a boolean", "invalid_type")
        spec.parallel = not dis
    _check_choice(spec, "tool_choice")
    return spec


def _check_choice(spec: ToolSpec, where: str) -> None:
    if spec.choice in ("required", "named") and not spec.tools:
        raise _bad(where, f"tool_choice {spec.choice!r} needs 'tools'")
    if spec.choice == "named" and spec.name not in spec.schemas:
        raise _bad(where, f"tool_choice names {spec.name!r}, which is not among the declared tools")
    if spec.choice == "named":
        spec.parallel = False  # one call of the named tool


def arguments_object(raw: Any, where: str) -> dict:
    """An assistant message's tool call arguments (a JSON string, as OpenAI sends them, or an object)."""
    if isinstance(raw, str):
        try:
            raw = json.loads(raw) if raw.strip() else {}
        except ValueError as e:
            raise _bad(where, f"the arguments are not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise _bad(where, "the arguments must be a JSON object", "invalid_type")
    return raw
