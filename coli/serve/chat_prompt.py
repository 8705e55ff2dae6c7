"""A chat request -> the prompt the model's own chat template renders, and the parser for its answer (pure).

tool_choice "required" / a named tool: the prompt is rendered without thinking and ends with `<tool_call>`
(and the name), so the model can only continue a call — a GLM model has no other way to be made to call,
short of constrained decoding. The answer starts in reasoning when the prompt ends inside `<think>`."""

from __future__ import annotations

from coli.chat_template import ChatTemplate
from coli.errors import ColiError
from coli.serve.glm_output import CALL_OPEN, THINK_OPEN, OutputParser
from coli.serve.openai_api import ApiError
from coli.serve.tools import ToolSpec


def renders_tools(template: ChatTemplate) -> bool:
    """Whether the template lists tools and asks for calls in GLM's format (the one the parser reads)."""
    return "tools" in template.source and CALL_OPEN in template.source


def render_chat(template: ChatTemplate, model_id: str, messages: list[dict], spec: ToolSpec, kwargs: dict,
                id_prefix: str) -> tuple[str, OutputParser]:
    extra = dict(kwargs)
    if spec.parse_calls:
        if not renders_tools(template):
            raise ApiError(400, f"model {model_id!r}: its chat template does not render tools in GLM's "
                                f"<tool_call> format, so this server cannot offer them", param="tools",
                           code="tools_unsupported")
        extra["tools"] = spec.tools
    forced = spec.parse_calls and spec.choice in ("required", "named")
    if forced:
        extra["enable_thinking"] = False
    try:
        text = template.render(messages, add_generation_prompt=True, **extra)
    except ColiError as e:
        raise ApiError(400, str(e), param="messages", code="template_error") from None
    parser = OutputParser(spec.schemas if spec.parse_calls else None, text.rstrip().endswith(THINK_OPEN),
                          spec.parallel, id_prefix)
    if forced:
        prefill = CALL_OPEN + (spec.name or "")
        parser.feed(prefill)
        text += prefill
    return text, parser
