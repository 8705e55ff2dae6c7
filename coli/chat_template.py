"""Chat templates from `tokenizer_config.json`, rendered with jinja2 the way transformers renders
them (`apply_chat_template`): a sandboxed environment with trim_blocks/lstrip_blocks, the loop
controls extension, a `tojson` filter, `raise_exception` and `strftime_now` globals, and the
tokenizer's special tokens as variables."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from coli.errors import ColiError


class ChatTemplate:
    def __init__(self, source: str, special: dict[str, Any] | None = None, origin: str = "chat template"):
        from jinja2 import TemplateError
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(source)
        except TemplateError as e:
            raise ColiError(f"{origin}: invalid jinja2 template: {e}") from None
        self.source = source
        self.special = dict(special or {})
        self.origin = origin

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any) -> str:
        from jinja2 import TemplateError

        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ColiError(f"message {i} must be an object with 'role' and 'content'")
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         **self.special, **extra)
        except TemplateError as e:
            raise ColiError(f"{self.origin}: rendering failed: {e}") from None


def _token_text(v: Any) -> Any:
    # tokenizer_config may store special tokens as plain strings or as AddedToken dicts
    return v.get("content") if isinstance(v, dict) else v


def load_chat_template(model_dir: str | Path) -> ChatTemplate | None:
    """The model directory's chat template (tokenizer_config.json `chat_template`, or a
    chat_template.jinja file), or None if it has none."""
    d = Path(model_dir)
    cfg_path = d / "tokenizer_config.json"
    cfg: dict[str, Any] = {}
    if cfg_path.is_file():
        try:
            cfg = json.loads(cfg_path.read_text())
        except (OSError, ValueError) as e:
            raise ColiError(f"{cfg_path}: cannot parse: {e}") from None
    source = cfg.get("chat_template")
    origin = str(cfg_path)
    if isinstance(source, list):  # named templates: take "default"
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if source is None and (d / "chat_template.jinja").is_file():
        source = (d / "chat_template.jinja").read_text()
        origin = str(d / "chat_template.jinja")
    if not source:
        return None
    special = {k: _token_text(cfg[k]) for k in ("bos_token", "eos_token", "pad_token", "unk_token") if k in cfg}
    return ChatTemplate(source, special, origin)
