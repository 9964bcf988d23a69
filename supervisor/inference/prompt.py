"""Prompt rendering: a model's own Jinja chat template (rendered the way transformers does), or
an Ollama Modelfile TEMPLATE in Go template syntax.

Which one: a TEMPLATE given with the request, else the Modelfile's TEMPLATE, else the chat
template shipped with the tokenizer, else `{{ .Prompt }}`.
"""

from __future__ import annotations

import datetime
import json
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from mlxr.shared.errors import InvalidRequest
from mlxr.supervisor.inference.go_template.render import GoTemplate
from mlxr.supervisor.inference.tool_calls import thinking_tags_for

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token",
                      "cls_token", "mask_token")


class TemplateRenderError(InvalidRequest):
    pass


def _raise(message: str) -> None:
    raise TemplateRenderError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


@lru_cache(maxsize=1)
def _jinja_env() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = _strftime_now
    return env


def to_hf_message(m: dict[str, Any]) -> dict[str, Any]:
    """An Ollama chat message in the shape Hugging Face chat templates expect."""
    out: dict[str, Any] = {"role": m.get("role", "user"), "content": m.get("content") or ""}
    if m.get("images"):  # images first, then the text, as Ollama places them
        out["content"] = [{"type": "image"} for _ in m["images"]] + \
            [{"type": "text", "text": out["content"]}]
    if m.get("thinking"):
        out["reasoning_content"] = out["thinking"] = m["thinking"]
    if m.get("tool_calls"):
        out["tool_calls"] = [{"type": "function", **tc} for tc in m["tool_calls"]]
    if m.get("tool_name"):
        out["name"] = out["tool_name"] = m["tool_name"]
    if m.get("tool_call_id"):
        out["tool_call_id"] = m["tool_call_id"]
    return out


class JinjaRenderer:
    """A Hugging Face chat template. Its text already holds the special tokens, so the
    tokenizer must not add them again (`add_special` False)."""

    add_special = False
    supports_insert = False

    def __init__(self, source: str, special_tokens: dict[str, Any]):
        self.source = source
        try:
            self._template = _jinja_env().from_string(source)
        except jinja2.TemplateError as exc:
            raise TemplateRenderError(f"invalid chat template: {exc}") from None
        self._special = special_tokens
        self.thinking_tags = thinking_tags_for(source)

    def chat(self, messages: list[dict[str, Any]], tools: list[dict] | None = None,
             think: bool | str | None = None) -> str:
        """A chat ending with a non-empty assistant message is continued: the prompt stops
        right after that message's text (transformers' `continue_final_message`)."""
        kwargs: dict[str, Any] = dict(self._special)
        if think is not None:
            kwargs["enable_thinking"] = bool(think)
        if isinstance(think, str):
            kwargs["reasoning_effort"] = think
        last = messages[-1] if messages else {}
        tail = last.get("content") or "" if last.get("role") == "assistant" else ""
        try:
            text = self._template.render(messages=[to_hf_message(m) for m in messages],
                                         tools=tools or None, add_generation_prompt=not tail,
                                         **kwargs)
        except TemplateRenderError:
            raise
        except jinja2.TemplateError as exc:
            raise TemplateRenderError(f"chat template error: {exc}") from None
        cut = text.rfind(tail.strip()) if tail.strip() else -1
        return text[:cut + len(tail.strip())] if cut >= 0 else text

    def insert(self, prompt: str, suffix: str) -> str:
        raise AssertionError("checked by supports_insert")


class GoRenderer:
    """An Ollama Modelfile TEMPLATE. Like Ollama's runners, the tokenizer adds BOS."""

    add_special = True

    def __init__(self, source: str):
        self.source = source
        self._template = GoTemplate(source)
        self.supports_insert = "suffix" in self._template.vars
        self.thinking_tags = thinking_tags_for(source)

    def chat(self, messages: list[dict[str, Any]], tools: list[dict] | None = None,
             think: bool | str | None = None) -> str:
        level = think if isinstance(think, str) else "medium" if think else ""
        return self._template.execute(messages, tools=tools, think=bool(think),
                                      think_set=think is not None, think_level=level)

    def insert(self, prompt: str, suffix: str) -> str:
        return self._template.execute([], prompt=prompt, suffix=suffix)


Renderer = JinjaRenderer | GoRenderer


def _special_tokens(config: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in SPECIAL_TOKEN_KEYS:
        value = config.get(key)
        if isinstance(value, dict):  # {"content": "<s>", "lstrip": false, ...}
            value = value.get("content")
        out[key] = value or ""
    out["additional_special_tokens"] = config.get("additional_special_tokens") or []
    return out


def read_chat_template(model_dir: Path, tools: bool = False) -> tuple[str, dict] | None:
    """The chat template and special tokens in a Hugging Face model directory, if any."""
    model_dir = Path(model_dir)
    try:
        config = json.loads((model_dir / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        config = {}
    source: Any = None
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.exists():
        source = jinja_file.read_text()
    elif (model_dir / "chat_template.json").exists():
        source = json.loads((model_dir / "chat_template.json").read_text()).get("chat_template")
    else:
        source = config.get("chat_template")
    if isinstance(source, list):  # named templates: "tool_use" when tools are given
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = (tools and named.get("tool_use")) or named.get("default") \
            or next(iter(named.values()), None)
    if not source:
        return None
    return source, _special_tokens(config)


_cache: dict[tuple, Renderer] = {}
_CACHE_SIZE = 32


def renderer_for(model_dir: Path, modelfile_template: str | None = None,
                 request_template: str | None = None, tools: bool = False) -> Renderer:
    """The renderer for a model, cached by what it is built from."""
    key = (str(model_dir), modelfile_template, request_template, tools)
    cached = _cache.get(key)
    if cached is not None:
        return cached
    if request_template or modelfile_template:
        renderer: Renderer = GoRenderer(request_template or modelfile_template or "")
    else:
        found = read_chat_template(model_dir, tools)
        renderer = JinjaRenderer(*found) if found else GoRenderer("{{ .Prompt }}")
    if len(_cache) >= _CACHE_SIZE:
        _cache.pop(next(iter(_cache)))
    _cache[key] = renderer
    return renderer
