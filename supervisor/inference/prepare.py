"""Preparing a request before any runner is involved: the model's capabilities and `think`
checked, the `format` checked, the Modelfile's defaults merged into the request's options, the
prompt rendered and the output parser chosen. Every error here is a typed error (a 4xx), so
bad input never reaches a runner."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlxr.shared.errors import InvalidRequest
from mlxr.shared.protocol import Options
from mlxr.shared.vision import placeholder, vision_family
from mlxr.supervisor.inference.harmony import (FINAL_MESSAGE, START, HarmonyParser, ToolNames,
                                                is_harmony)
from mlxr.supervisor.inference.options import check_options
from mlxr.supervisor.inference.prompt import GoRenderer, Renderer, renderer_for
from mlxr.supervisor.inference.truncate import fit_messages
from mlxr.supervisor.inference.tool_calls import (ForcedCallParser, OutputParser, ThinkingParser,
                                                  always_parses_thinking, forced_call_schema,
                                                  tool_parser_for)
from mlxr.supervisor.inference.types import ChatRequest, GenerateRequest


@dataclass(slots=True)
class Prepared:
    """A request ready for a runner: its prompt, merged options and output parser."""

    record: Any
    runner_dir: Path
    prompt: str
    options: Options
    parser: OutputParser
    add_special: bool = False
    context: list[int] = field(default_factory=list)
    want_context: bool = False
    format: Any = None
    # With thinking on, the text that ends the thinking section: the runner holds the output
    # to `format` only after it (Ollama: think first, then the constrained answer).
    format_after: str | None = None
    # With thinking on, the text that opens the thinking section where the prompt did not
    # open it: output that begins otherwise is not thinking, so a format holds from its start
    # (Ollama applies the format once the content begins) and a budget never ends it.
    think_open: str | None = None
    # With thinking on, that text whatever the format (a thinking budget's forced ending).
    think_end: str | None = None
    # The images the prompt's placeholders stand for, in order (as the request gave them;
    # supervisor/inference/images.py makes them ready for the runner).
    images: list[str] = field(default_factory=list)


def image_mark(runner_dir: Path) -> str:
    """The placeholder a vision model's prompt carries for each image."""
    try:
        config = json.loads((Path(runner_dir) / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    family = vision_family(config) if isinstance(config, dict) else None
    if family is None:
        raise InvalidRequest("this model has no image placeholder")
    return placeholder(family)


def with_image_marks(messages: list[dict[str, Any]], renderer: Any,
                     runner_dir: Path) -> list[dict[str, Any]]:
    """Messages for a Go TEMPLATE, which knows nothing of images: each image's placeholder
    goes before its message's text. A Jinja template places image parts itself."""
    if not isinstance(renderer, GoRenderer) or not any(m.get("images") for m in messages):
        return messages
    mark = image_mark(runner_dir)
    return [{**m, "content": mark * len(m["images"]) + (m.get("content") or "")}
            if m.get("images") else m for m in messages]


@dataclass(slots=True)
class ChatPlan:
    """A chat request checked, with what its prompt is made from: the part of preparing it
    that reads the store. `finish` does the rest."""

    req: ChatRequest
    record: Any
    runner_dir: Path
    renderer: Renderer
    messages: list[dict[str, Any]]
    options: Options
    fmt: Any
    think: bool | str | None
    context_length: int
    # A harmony model's tools under the names its prompt declares them by (None otherwise).
    names: ToolNames | None = None

    @property
    def text_chars(self) -> int:
        return sum(len(m.get("content") or "") for m in self.messages
                   if isinstance(m.get("content"), str))

    def render(self, messages: list[dict[str, Any]]) -> str:
        if self.names is not None:
            prompt = self.renderer.chat(self.names.messages(messages),
                                        self.names.tools(self.req.tools) or None, self.think)
            skip = self.think is False and (self.fmt is not None or not self.req.tools)
            return skip_analysis(prompt) if skip else prompt
        return self.renderer.chat(messages, self.req.tools or None, self.think)

    def finish(self) -> Prepared:
        """Truncation (which may encode the whole prompt) and the prompt itself: no store, so
        a long chat can be finished off the event loop."""
        messages, renderer = self.messages, self.renderer
        if self.req.truncate:
            messages = fit_messages(messages, self.render,
                                    self.options.num_ctx or self.context_length,
                                    self.runner_dir, renderer.add_special)
        prompt = self.render(with_image_marks(messages, renderer, self.runner_dir))
        parser = output_parser(renderer, prompt, self.think,
                               _tool_parser(self.req, renderer, self.fmt), self.names)
        return Prepared(self.record, self.runner_dir, prompt, self.options, parser,
                        format=self.fmt,
                        format_after=_format_after(renderer, prompt, self.think, self.fmt),
                        think_open=_think_open(renderer, prompt, self.think),
                        think_end=_format_after(renderer, prompt, self.think, True),
                        images=[x for m in messages for x in m.get("images") or []])


def plan_chat(req: ChatRequest, record: Any, store: Any, context_length: int) -> ChatPlan:
    caps = capabilities(record)
    check_capabilities(req.model, caps, "chat", tools=bool(req.tools),
                       images=any(m.get("images") for m in req.messages))
    fmt = wire_format(req.format)
    if req.force_call is not None:
        # The reply is the call, not a message, so a response format has nothing to shape.
        fmt = forced_call_schema(req.tools, req.force_call)
    think = resolve_think(req.model, caps, req.think)
    if req.force_call is not None and "thinking" in caps:
        # A forced call (mlxr's tool_choice; Ollama has none) must be the reply whatever the
        # model would think: it is constrained from the first token, with thinking off.
        think = False
    messages = list(record.messages or []) + list(req.messages)
    if record.system and req.messages[0].get("role") != "system":
        messages.insert(0, {"role": "system", "content": record.system})
    runner_dir = store.runner_dir(record)
    renderer = renderer_for(runner_dir, record.template, tools=bool(req.tools))
    names = None
    if is_harmony(renderer.source) and req.force_call is None:
        think = _harmony_level(think)
        names = ToolNames([t["function"]["name"] for t in req.tools or []
                           if isinstance(t.get("function"), dict)
                           and isinstance(t["function"].get("name"), str)])
    return ChatPlan(req, record, runner_dir, renderer, messages,
                    merge_options(record, req.options, context_length), fmt, think,
                    context_length, names)


def prepare_chat(req: ChatRequest, record: Any, store: Any, context_length: int) -> Prepared:
    return plan_chat(req, record, store, context_length).finish()


def prepare_generate(req: GenerateRequest, record: Any, store: Any,
                     context_length: int) -> Prepared | None:
    """None for an empty prompt (a load request), after the same checks."""
    if req.raw and (req.template or req.system or req.context):
        raise InvalidRequest("raw mode does not support template, system, or context")
    caps = capabilities(record)
    check_capabilities(req.model, caps, "generate", images=bool(req.images))
    fmt = wire_format(req.format)
    think = resolve_think(req.model, caps, req.think)
    if not req.prompt:
        return None
    runner_dir = store.runner_dir(record)
    renderer = renderer_for(runner_dir, record.template, req.template)
    if is_harmony(renderer.source):
        think = _harmony_level(think)
    if req.images and req.context:
        raise InvalidRequest("images cannot be sent with a context")
    if req.raw:
        prompt, add_special = req.prompt, True
        if req.images:
            mark = image_mark(runner_dir)
            if prompt.count(mark) != len(req.images):
                prompt = mark * len(req.images) + prompt
    elif req.suffix:
        if not renderer.supports_insert:
            raise InvalidRequest(f'"{req.model}" does not support insert')
        prompt, add_special = renderer.insert(req.prompt, req.suffix), renderer.add_special
    else:
        messages: list[dict[str, Any]] = []
        system = req.system or record.system
        if system:
            messages.append({"role": "system", "content": system})
        if req.context is None:
            messages += list(record.messages or [])
        user: dict[str, Any] = {"role": "user", "content": req.prompt}
        if req.images:
            user["images"] = list(req.images)
        messages.append(user)
        prompt = renderer.chat(with_image_marks(messages, renderer, runner_dir), None, think)
        if think is False and is_harmony(renderer.source):
            prompt = skip_analysis(prompt)
        add_special = renderer.add_special
    think = think and not req.raw
    return Prepared(record, runner_dir, prompt, merge_options(record, req.options, context_length),
                    output_parser(renderer, prompt, think,
                                  names=None if req.raw else ToolNames([])),
                    add_special=add_special, context=list(req.context or []),
                    want_context=not req.raw, format=fmt,
                    format_after=_format_after(renderer, prompt, think, fmt),
                    think_open=_think_open(renderer, prompt, think),
                    images=list(req.images))


def merge_options(record: Any, request_options: dict[str, Any] | None,
                  context_length: int) -> Options:
    """The Modelfile's parameters overridden by the request's options; `context_length`
    (the server's default) when neither sets num_ctx. A num_ctx past the model's own context
    length is that length, as in Ollama (a huge one would be refused for memory, a 507)."""
    merged = {**(record.params or {}), **(request_options or {})}
    options = Options.from_dict(check_options(merged))
    if not options.num_ctx or options.num_ctx <= 0:
        options.num_ctx = context_length
    config = getattr(record, "config", None)
    trained = config.get("context_length") if isinstance(config, dict) else None
    if isinstance(trained, int) and 0 < trained < options.num_ctx:
        options.num_ctx = trained
    return options


def wire_format(value: Any) -> Any:
    """A request's `format` as the runner takes it: "json", a JSON schema object (the runner
    also reads `{"type": "regex", "pattern": ...}` here), or None for free text. null and ""
    mean none, as in Ollama, and so does `{}` (the runner reads an empty format as none).
    Whether a schema compiles is the runner's to say (a 400)."""
    if value is None or value == "" or value == {}:
        return None
    if value == "json" or isinstance(value, dict):
        return value
    shown = json.dumps(value)
    shown = shown if len(shown) <= 40 else shown[:40] + "..."
    raise InvalidRequest(f'invalid format: {shown}; expected "json" or a JSON schema object')


def capabilities(record: Any) -> list[str]:
    return list(getattr(record, "capabilities", None) or ["completion"])


def check_capabilities(model: str, caps: list[str], verb: str, *, tools: bool = False,
                       images: bool = False) -> None:
    if "completion" not in caps:
        raise InvalidRequest(f'"{model}" does not support {verb}')
    if tools and "tools" not in caps:
        raise InvalidRequest(f'"{model}" does not support tools')
    if images and "vision" not in caps:
        raise InvalidRequest(f'"{model}" does not support images')


def resolve_think(model: str, caps: list[str], think: bool | str | None) -> bool | str | None:
    """Ollama's rule: thinking models think unless told not to (None becomes True); others
    refuse a `think` that turns thinking on. A level ("low" ... "max") is kept: it means on,
    and reaches the templates (.ThinkLevel, `reasoning_effort`).

    A constrained request (a `format`, a forced tool call) thinks too, as in Ollama: the
    runner starts the grammar only after the thinking section (`Prepared.format_after`)."""
    if "thinking" in caps:
        return True if think is None else think
    if think:
        raise InvalidRequest(f'"{model}" does not support thinking')
    return think


def skip_analysis(prompt: str) -> str:
    """A harmony prompt whose reply begins in the final channel: `think: false` (gpt-oss
    always reasons otherwise), so a `format` holds from the reply's first token. Not with
    tools: a call goes to the commentary channel."""
    return prompt + FINAL_MESSAGE if prompt.endswith(START + "assistant") else prompt


def _harmony_level(think: bool | str | None) -> bool | str | None:
    """harmony's reasoning effort is low, medium or high (Ollama sends "max" as "high")."""
    return "high" if think == "max" else think


def _format_after(renderer: Renderer, prompt: str, think: Any, fmt: Any) -> str | None:
    """The end-of-thinking tag when the output starts with a thinking section to leave free
    (a harmony model's: the final channel's header, after whatever it writes first)."""
    if fmt is not None and fmt is not True and think is not False \
            and is_harmony(renderer.source):
        return None if prompt.endswith(FINAL_MESSAGE) else FINAL_MESSAGE
    if fmt is None or not think or not renderer.thinking_tags:
        return None
    return renderer.thinking_tags[1]


def _think_open(renderer: Renderer, prompt: str, think: Any) -> str | None:
    """The thinking section's opening tag when thinking is on and the output may open the
    section itself (the prompt did not)."""
    if not think or not renderer.thinking_tags or _prompt_opens_thinking(renderer, prompt):
        return None
    return renderer.thinking_tags[0]


def _prompt_opens_thinking(renderer: Renderer, prompt: str) -> bool:
    """The template wrote the opening tag itself: the output starts inside the thinking."""
    return prompt.rstrip().endswith(renderer.thinking_tags[0])


def output_parser(renderer: Renderer, prompt: str, think: bool | None,
                  tools: Any = None, names: ToolNames | None = None) -> Any:
    """`tools`: the tool-call parser for this request, if its output may hold calls. A
    harmony model's output is read by its own parser (with `names`, unless the request's
    output is raw text or one forced call)."""
    if names is not None and is_harmony(renderer.source) \
            and not isinstance(tools, ForcedCallParser):
        return HarmonyParser(prompt, names)
    thinking = None
    if renderer.thinking_tags and (think or always_parses_thinking(renderer.thinking_tags)):
        thinking = ThinkingParser(renderer.thinking_tags, keep=bool(think),
                                  in_thinking=_prompt_opens_thinking(renderer, prompt))
    return OutputParser(thinking, tools)


def _tool_parser(req: ChatRequest, renderer: Renderer, fmt: Any) -> Any:
    if req.force_call is not None:
        return ForcedCallParser()
    if req.tools and fmt is None:  # a format's output is the reply itself, never a call
        return tool_parser_for(renderer.source)
    return None
