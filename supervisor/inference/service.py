"""The inference service: one API that the Ollama and OpenAI handlers both translate into.

`generate` and `chat` validate, resolve the model, render the prompt, get a runner (loading or
evicting as needed) and send the request before they return, so every error up to the moment
the runner accepts the request is raised as a typed error (an HTTP status). What they return,
a `Completion`, yields `Delta`s as the runner streams and one `Final` last; a failure after
that is raised from the iteration and becomes an error line or event.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable

from mlxr.shared.config import Settings
from mlxr.shared.errors import InvalidRequest
from mlxr.shared.protocol import CompletionRequest, EmbedRequest, EmbedResponse, Options
from mlxr.supervisor.runners import memory
from mlxr.supervisor.metrics import Metrics
from mlxr.supervisor.inference.prompt import Renderer, renderer_for
from mlxr.supervisor.runners.manager import Lease, LoadSpec, RunnerManager
from mlxr.supervisor.inference.tool_calls import (ForcedCall, ForcedCallParser, OutputParser, ThinkingParser,
                                   forced_call_schema, tool_parser_for)

log = logging.getLogger("mlxr.service")

FOREVER_S = 2**63 / 1e9  # what Ollama shows for a negative keep_alive: the largest duration


@dataclass(slots=True)
class ChatRequest:
    model: str
    messages: list[dict[str, Any]]  # Ollama's shape: role, content, images, tool_calls, ...
    tools: list[dict[str, Any]] = field(default_factory=list)
    think: bool | str | None = None
    format: Any = None  # "json" or a JSON schema object; None or "" for free text
    options: dict[str, Any] = field(default_factory=dict)
    keep_alive_s: float | None = None  # None: the server default; negative: forever
    logprobs: bool = False
    top_logprobs: int = 0
    force_call: ForcedCall | None = None  # the reply must be a call to one of `tools`


@dataclass(slots=True)
class GenerateRequest:
    model: str
    prompt: str = ""
    suffix: str = ""
    system: str | None = None
    template: str | None = None
    raw: bool = False
    context: list[int] | None = None
    images: list[str] = field(default_factory=list)
    think: bool | str | None = None
    format: Any = None
    options: dict[str, Any] = field(default_factory=dict)
    keep_alive_s: float | None = None
    logprobs: bool = False
    top_logprobs: int = 0


@dataclass(slots=True)
class EmbedCall:
    model: str
    input: Any  # a string, a list of strings, or token arrays
    truncate: bool = True
    dimensions: int | None = None
    options: dict[str, Any] = field(default_factory=dict)
    keep_alive_s: float | None = None


@dataclass(slots=True)
class EmbedResult:
    embeddings: list[list[float]]
    prompt_eval_count: int
    load_duration: int = 0  # ns
    total_duration: int = 0


@dataclass(slots=True)
class Delta:
    content: str = ""
    thinking: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    logprobs: list[dict[str, Any]] | None = None

    def __bool__(self) -> bool:
        return bool(self.content or self.thinking or self.tool_calls or self.logprobs)


@dataclass(slots=True)
class Final:
    done_reason: str  # stop | length | load | unload
    prompt_eval_count: int = 0
    prompt_eval_cached_count: int = 0  # prompt tokens served from the runner's prefix cache
    prompt_eval_duration: int = 0  # ns, as on Ollama's wire
    eval_count: int = 0
    eval_duration: int = 0
    load_duration: int = 0
    total_duration: int = 0
    context: list[int] | None = None


class Completion:
    """An accepted request: iterate for `Delta`s, then one `Final`. Always `aclose()` it:
    that frees the runner slot even if the events were never read."""

    def __init__(self, model: str, events: AsyncIterator[Delta | Final],
                 cleanup: Callable[[], Awaitable[None]] | None = None):
        self.model = model
        self._events = events
        self._cleanup = cleanup

    def __aiter__(self) -> AsyncIterator[Delta | Final]:
        return self._events

    async def aclose(self) -> None:
        close = getattr(self._events, "aclose", None)
        if close is not None:
            await close()
        if self._cleanup is not None:
            await self._cleanup()


@dataclass(slots=True)
class RunningModel:
    name: str
    model: str
    size: int
    size_vram: int
    digest: str
    details: dict[str, Any]
    expires_at: dt.datetime
    context_length: int
    blas: dict[str, str]


async def _single(event: Final) -> AsyncIterator[Delta | Final]:
    yield event


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


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


def model_details(record: Any) -> dict[str, Any]:
    """Ollama's `details` object from a store record's config blob (as /api/tags shows it)."""
    c = getattr(record, "config", None) or {}
    return {"parent_model": "", "format": c.get("model_format") or "",
            "family": c.get("model_family") or "", "families": c.get("model_families"),
            "parameter_size": c.get("model_type") or "",
            "quantization_level": c.get("file_type") or ""}


@dataclass(slots=True)
class _Prepared:
    record: Any
    runner_dir: Path
    prompt: str
    options: Options
    parser: OutputParser
    add_special: bool = False
    context: list[int] = field(default_factory=list)
    want_context: bool = False
    format: Any = None


class Service:
    def __init__(self, settings: Settings, store: Any, manager: RunnerManager,
                 metrics: Metrics | None = None):
        self.settings = settings
        self.store = store
        self.manager = manager
        self.metrics = metrics or Metrics()
        self._estimates: dict[tuple[str, int], memory.MemoryEstimate] = {}

    # -- public API ----------------------------------------------------------------------

    async def chat(self, req: ChatRequest) -> Completion:
        started = time.monotonic()
        record = self.resolve(req.model)
        keep_alive = self._keep_alive(req.keep_alive_s)
        if not req.messages:
            return await self._load_or_unload(req.model, record, keep_alive, started, req.options)
        p = self._prepare_chat(req, record)
        return await self._start(req.model, p, keep_alive, started, logprobs=req.logprobs,
                                 top_logprobs=req.top_logprobs)

    async def generate(self, req: GenerateRequest) -> Completion:
        started = time.monotonic()
        record = self.resolve(req.model)
        keep_alive = self._keep_alive(req.keep_alive_s)
        if not req.prompt and keep_alive == 0:
            return await self._load_or_unload(req.model, record, keep_alive, started, req.options)
        p = self._prepare_generate(req, record)
        if p is None:
            return await self._load_or_unload(req.model, record, keep_alive, started, req.options)
        return await self._start(req.model, p, keep_alive, started, logprobs=req.logprobs,
                                 top_logprobs=req.top_logprobs)

    def render_chat(self, req: ChatRequest) -> str:
        """The prompt a chat request would send (Ollama's `_debug_render_only`)."""
        return self._prepare_chat(req, self.resolve(req.model)).prompt if req.messages else ""

    def render_generate(self, req: GenerateRequest) -> str:
        p = self._prepare_generate(req, self.resolve(req.model))
        return p.prompt if p is not None else ""

    def ps(self) -> list[RunningModel]:
        now_mono, now_wall = self.manager.now(), dt.datetime.now(dt.timezone.utc)
        vram = sys.platform == "darwin"  # unified memory: all of it is GPU memory on Metal
        out = []
        for slot in self.manager.slots():
            expires = slot.expires_at(now_mono)
            left = FOREVER_S if expires is None else max(0.0, expires - now_mono)
            size = slot.memory_bytes or slot.estimate_bytes
            out.append(RunningModel(
                name=slot.name, model=slot.name, size=size, size_vram=size if vram else 0,
                digest=slot.spec.digest, details=model_details(slot.spec.info),
                expires_at=now_wall + dt.timedelta(seconds=left),
                context_length=slot.context_length, blas=slot.blas))
        out.sort(key=lambda m: m.expires_at, reverse=True)
        return out

    async def embed(self, req: EmbedCall) -> EmbedResult:
        """Embeddings from an embedding model, or pooled from a language model (as Ollama
        gives for generative models)."""
        started = time.monotonic()
        record = self.resolve(req.model)
        caps = self._capabilities(record)
        if "embedding" not in caps and "completion" not in caps:
            raise InvalidRequest(f'"{req.model}" does not support embeddings')
        wire = EmbedRequest.from_dict({"input": req.input, "truncate": req.truncate,
                                       "dimensions": req.dimensions})
        runner_dir = self.store.runner_dir(record)
        spec = self._spec(record, runner_dir, self._options(record, req.options))
        if "completion" not in caps:  # an encoder keeps no KV cache
            spec.estimate_bytes = int(memory.weights_bytes(runner_dir) * memory.WEIGHT_OVERHEAD)
            spec.kv_cache_bytes = spec.min_kv_bytes = 0
        lease = await self.manager.acquire(spec, self._keep_alive(req.keep_alive_s))
        try:
            reply = await lease.runner.embed(wire) if wire.input else EmbedResponse([])
        finally:
            self.manager.release(lease)
        self.metrics.observe_prompt(req.model, reply.prompt_eval_count)
        return EmbedResult(reply.embeddings, reply.prompt_eval_count,
                           load_duration=_ns(lease.load_duration_s),
                           total_duration=_ns(time.monotonic() - started))

    def resolve(self, model: str) -> Any:
        if not model:
            raise InvalidRequest("model is required")
        return self.store.resolve(model)

    # -- preparing a request: validation and the prompt, before any runner is involved -----

    def _prepare_chat(self, req: ChatRequest, record: Any) -> _Prepared:
        caps = self._capabilities(record)
        self._check(req.model, caps, "chat", tools=bool(req.tools),
                    images=any(m.get("images") for m in req.messages))
        fmt = wire_format(req.format)
        if req.force_call is not None:
            # The reply is the call, not a message, so a response format has nothing to shape.
            fmt = forced_call_schema(req.tools, req.force_call)
        think = self._think(req.model, caps, req.think, constrained=fmt is not None)
        messages = list(record.messages or []) + list(req.messages)
        if record.system and req.messages[0].get("role") != "system":
            messages.insert(0, {"role": "system", "content": record.system})
        runner_dir = self.store.runner_dir(record)
        renderer = renderer_for(runner_dir, record.template, tools=bool(req.tools))
        prompt = renderer.chat(messages, req.tools or None, think)
        parser = self._parser(renderer, prompt, think, self._tool_parser(req, renderer, fmt))
        return _Prepared(record, runner_dir, prompt, self._options(record, req.options), parser,
                         format=fmt)

    def _prepare_generate(self, req: GenerateRequest, record: Any) -> _Prepared | None:
        """None for an empty prompt (a load request), after the same checks."""
        if req.raw and (req.template or req.system or req.context):
            raise InvalidRequest("raw mode does not support template, system, or context")
        caps = self._capabilities(record)
        self._check(req.model, caps, "generate", images=bool(req.images))
        fmt = wire_format(req.format)
        think = self._think(req.model, caps, req.think, constrained=fmt is not None)
        if not req.prompt:
            return None
        runner_dir = self.store.runner_dir(record)
        renderer = renderer_for(runner_dir, record.template, req.template)
        if req.raw:
            prompt, add_special = req.prompt, True
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
            messages.append({"role": "user", "content": req.prompt})
            prompt, add_special = renderer.chat(messages, None, think), renderer.add_special
        return _Prepared(record, runner_dir, prompt, self._options(record, req.options),
                         self._parser(renderer, prompt, think and not req.raw),
                         add_special=add_special, context=list(req.context or []),
                         want_context=not req.raw, format=fmt)

    # -- the request path ----------------------------------------------------------------

    async def _start(self, model: str, p: _Prepared, keep_alive: float, started: float, *,
                     logprobs: bool = False, top_logprobs: int = 0) -> Completion:
        spec = self._spec(p.record, p.runner_dir, p.options)
        lease = await self.manager.acquire(spec, keep_alive)
        try:
            request = CompletionRequest(options=p.options, logprobs=logprobs or top_logprobs > 0,
                                        top_logprobs=top_logprobs, format=p.format)
            tokens: list[int] | None = None
            if p.want_context or p.context:  # the ids are needed for `context` in the reply
                tokens = p.context + await lease.runner.tokenize(
                    p.prompt, add_special=p.add_special and not p.context)
                request.tokens = tokens
            else:
                request.prompt = p.prompt
            stream = await lease.runner.complete(request)
        except BaseException:
            self.manager.release(lease)
            raise

        async def cleanup() -> None:  # idempotent: the stream's close and release both are
            await stream.aclose()
            self.manager.release(lease)

        events = self._events(lease, stream, p.parser, started,
                              tokens if p.want_context else None)
        return Completion(model, events, cleanup)

    async def _events(self, lease: Lease, stream: Any, parser: OutputParser,
                      started: float, prompt_tokens: list[int] | None
                      ) -> AsyncIterator[Delta | Final]:
        out_tokens: list[int] = []
        last = None
        model = lease.slot.name  # metric labels use the canonical name, not what was typed
        try:
            async for chunk in stream:
                now = time.monotonic()
                if chunk.tokens:
                    self.metrics.observe_tokens(model, now - (last or started), len(chunk.tokens),
                                                first=last is None)
                    last = now
                out_tokens += chunk.tokens
                thinking, content, calls = parser.feed(chunk.content)
                delta = Delta(content, thinking, calls, chunk.logprobs)
                if not chunk.done:
                    if delta:
                        yield delta
                    continue
                thinking, content, calls = parser.finish()
                delta.content += content
                delta.thinking += thinking
                delta.tool_calls += calls
                # Released before the last line goes out, so a client that reads `done` and
                # then asks /api/ps sees the keep_alive this request set.
                self.manager.release(lease)
                self.metrics.observe_prompt(model, chunk.prompt_eval_count)
                if delta:
                    yield delta
                yield Final(
                    done_reason=chunk.done_reason or "stop",
                    prompt_eval_count=chunk.prompt_eval_count,
                    prompt_eval_cached_count=chunk.prompt_eval_cached_count,
                    prompt_eval_duration=chunk.prompt_eval_duration,
                    eval_count=chunk.eval_count, eval_duration=chunk.eval_duration,
                    load_duration=_ns(lease.load_duration_s),
                    total_duration=_ns(time.monotonic() - started),
                    context=(prompt_tokens + out_tokens) if prompt_tokens is not None else None)
                return
        finally:
            await stream.aclose()
            self.manager.release(lease)

    async def _load_or_unload(self, model: str, record: Any, keep_alive: float, started: float,
                              request_options: dict[str, Any]) -> Completion:
        if keep_alive == 0:
            await self.manager.unload(record.name)
            return Completion(model, _single(Final("unload")))
        options = self._options(record, request_options)
        spec = self._spec(record, self.store.runner_dir(record), options)
        lease = await self.manager.acquire(spec, keep_alive)
        self.manager.release(lease)
        return Completion(model, _single(Final(
            "load", load_duration=_ns(lease.load_duration_s),
            total_duration=_ns(time.monotonic() - started))))

    # -- helpers -------------------------------------------------------------------------

    def _keep_alive(self, value: float | None) -> float:
        if value is None:
            return self.settings.keep_alive_s
        return -1.0 if value < 0 else float(value)

    def _options(self, record: Any, request_options: dict[str, Any] | None) -> Options:
        if request_options is not None and not isinstance(request_options, dict):
            raise InvalidRequest("options must be an object")
        merged = {**(record.params or {}), **(request_options or {})}
        options = Options.from_dict(merged)
        if not options.num_ctx or options.num_ctx <= 0:
            options.num_ctx = self.settings.context_length
        return options

    def _spec(self, record: Any, runner_dir: Path, options: Options) -> LoadSpec:
        num_ctx = int(options.num_ctx or self.settings.context_length)
        key = (str(runner_dir), num_ctx)
        est = self._estimates.get(key)
        if est is None:
            est = self._estimates[key] = memory.estimate(runner_dir, num_ctx,
                                                         self.settings.num_parallel)
        return LoadSpec(name=record.name, model_dir=runner_dir, estimate_bytes=est.total_bytes,
                        context_length=num_ctx, kv_cache_bytes=est.kv_bytes,
                        min_kv_bytes=est.min_kv_bytes, digest=record.digest, info=record)

    @staticmethod
    def _capabilities(record: Any) -> list[str]:
        return list(getattr(record, "capabilities", None) or ["completion"])

    @staticmethod
    def _check(model: str, caps: list[str], verb: str, *, tools: bool = False,
               images: bool = False) -> None:
        if "completion" not in caps:
            raise InvalidRequest(f'"{model}" does not support {verb}')
        if tools and "tools" not in caps:
            raise InvalidRequest(f'"{model}" does not support tools')
        if images and "vision" not in caps:
            raise InvalidRequest(f'"{model}" does not support images')

    @staticmethod
    def _think(model: str, caps: list[str], think: bool | str | None,
               constrained: bool = False) -> bool | None:
        """Ollama's rule: thinking models think unless told not to; others refuse `think`.

        A constrained request (a `format`, a forced tool call) never thinks: the runner's
        grammar applies from the first generated token, so a thinking block could not be
        written before the document. The prompt is rendered with thinking off, and an explicit
        `think: true` with a format is served the same way rather than refused, so clients
        that always send `think` keep working; the reply then has no `thinking`."""
        if isinstance(think, str):
            think = think.lower() not in ("", "false", "none")
        if "thinking" in caps:
            return False if constrained else True if think is None else bool(think)
        if think:
            raise InvalidRequest(f'"{model}" does not support thinking')
        return think

    @staticmethod
    def _tool_parser(req: ChatRequest, renderer: Renderer, fmt: Any) -> Any:
        if req.force_call is not None:
            return ForcedCallParser()
        if req.tools and fmt is None:  # a format's output is the reply itself, never a call
            return tool_parser_for(renderer.source)
        return None

    @staticmethod
    def _parser(renderer: Renderer, prompt: str, think: bool | None,
                tools: Any = None) -> OutputParser:
        """`tools`: the tool-call parser for this request, if its output may hold calls."""
        thinking = None
        if think and renderer.thinking_tags:
            opened = prompt.rstrip().endswith(renderer.thinking_tags[0])
            thinking = ThinkingParser(renderer.thinking_tags, in_thinking=opened)
        return OutputParser(thinking, tools)
