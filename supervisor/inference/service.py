"""The inference service: one API that the Ollama and OpenAI handlers both translate into.

`generate` and `chat` resolve the model, prepare the request (prepare.py: checks, options,
prompt), get a runner (loading or evicting as needed) and send the request before they
return, so every error up to the moment the runner accepts the request is raised as a typed
error (an HTTP status). What they return, a `Completion`, yields `Delta`s as the runner
streams and one `Final` last; a failure after that is raised from the iteration and becomes
an error line or event.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import sys
import time
from pathlib import Path
from typing import Any, AsyncIterator

from mlxr.shared.config import Settings
from mlxr.shared.errors import InvalidRequest
from mlxr.shared.protocol import CompletionRequest, EmbedRequest, EmbedResponse, Options
from mlxr.supervisor.inference.images import ready_images
from mlxr.supervisor.inference.prepare import (Prepared, capabilities, merge_options,
                                               plan_chat, prepare_generate)
from mlxr.supervisor.inference.tool_calls import OutputParser
from mlxr.supervisor.inference.types import (ChatRequest, Completion, Delta, EmbedCall,
                                             EmbedResult, Final, GenerateRequest, RunningModel)
from mlxr.supervisor.metrics import Metrics
from mlxr.supervisor.runners import memory
from mlxr.supervisor.runners.group import Host, hostfile_hosts
from mlxr.supervisor.runners.manager import Lease, LoadSpec, RunnerManager
from mlxr.supervisor.store.conversions import ensure_converted
from mlxr.supervisor.store.store import model_details

# A chat with more text than this is finished off the event loop (`Service._prepare_chat`).
OFF_LOOP_CHARS = 4096
FOREVER_S = 2**63 / 1e9  # what Ollama shows for a negative keep_alive: the largest duration


async def _single(event: Final) -> AsyncIterator[Delta | Final]:
    yield event


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


def _served_context(slot: Any) -> int:
    """The context the runner serves: its num_ctx, capped (as the runner caps it) by the
    model's own context length."""
    config = getattr(slot.spec.info, "config", None) or {}
    limit = config.get("context_length") if isinstance(config, dict) else None
    if isinstance(limit, int) and limit > 0 and slot.context_length:
        return min(slot.context_length, limit)
    return slot.context_length


def _load_ns(started: float, loaded: float) -> int:
    """Ollama's load_duration: the time from the request to holding its runner (resolving,
    preparing, loading if need be); never 0, so a client can tell it was measured."""
    return max(1, _ns(loaded - started))


def with_bytes(entries: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Logprob entries with Ollama's `bytes` (the token's UTF-8 bytes) on each token and
    alternative."""
    if not entries:
        return entries
    return [{**e, "bytes": list(e["token"].encode()),
             **({"top_logprobs": [{**t, "bytes": list(t["token"].encode())}
                                  for t in e["top_logprobs"]]} if e.get("top_logprobs") else {})}
            for e in entries]


def _context(prompt_tokens: list[int] | None, out_tokens: list[int]) -> list[int] | None:
    """A reply's `context`: none when the runner sent no prompt ids (an older runner)."""
    return None if prompt_tokens is None else prompt_tokens + out_tokens


class Service:
    def __init__(self, settings: Settings, store: Any, manager: RunnerManager,
                 metrics: Metrics | None = None):
        self.settings = settings
        self.store = store
        self.manager = manager
        self.metrics = metrics or Metrics()
        self._estimates: dict[tuple, memory.MemoryEstimate] = {}

    # -- public API ----------------------------------------------------------------------

    async def chat(self, req: ChatRequest) -> Completion:
        started = time.monotonic()
        record = await self.resolve(req.model)
        keep_alive = self._keep_alive(req.keep_alive_s)
        if not req.messages:
            return await self._load_or_unload(req.model, record, keep_alive, started, req.options)
        p = await self._prepare_chat(req, record)
        return await self._start(req.model, p, keep_alive, started, logprobs=req.logprobs,
                                 top_logprobs=req.top_logprobs, shift=req.shift,
                                 think_budget=req.think_budget)

    async def generate(self, req: GenerateRequest) -> Completion:
        started = time.monotonic()
        record = await self.resolve(req.model)
        keep_alive = self._keep_alive(req.keep_alive_s)
        if not req.prompt and keep_alive == 0:
            return await self._load_or_unload(req.model, record, keep_alive, started, req.options)
        p = prepare_generate(req, record, self.store, self.settings.context_length)
        if p is None:
            return await self._load_or_unload(req.model, record, keep_alive, started, req.options)
        return await self._start(req.model, p, keep_alive, started, logprobs=req.logprobs,
                                 top_logprobs=req.top_logprobs, shift=req.shift)

    async def render_chat(self, req: ChatRequest) -> str:
        """The prompt a chat request would send (Ollama's `_debug_render_only`)."""
        if not req.messages:
            return ""
        return (await self._prepare_chat(req, await self.resolve(req.model))).prompt

    async def _prepare_chat(self, req: ChatRequest, record: Any) -> Prepared:
        """A long chat's prompt is finished in a thread: its truncation check may encode the
        whole prompt (about 4 us a token; the tokenizer lets go of the interpreter lock),
        which on the event loop would hold up every stream the supervisor relays."""
        plan = plan_chat(req, record, self.store, self.settings.context_length)
        if plan.text_chars < OFF_LOOP_CHARS:
            return plan.finish()
        return await asyncio.to_thread(plan.finish)

    async def render_generate(self, req: GenerateRequest) -> str:
        p = prepare_generate(req, await self.resolve(req.model), self.store,
                             self.settings.context_length)
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
                context_length=_served_context(slot), blas=slot.blas, kv=slot.kv,
                active=slot.active, waiting=slot.waiting,
                ranks=slot.runner.ranks() if hasattr(slot.runner, "ranks") else [],
                sharding=slot.sharding, weights=slot.weights))
        out.sort(key=lambda m: m.expires_at, reverse=True)
        return out

    async def count_tokens(self, req: ChatRequest) -> int:
        """The tokens of the prompt a chat request renders to, by the model runner's own
        tokenizer: what `prompt_eval_count` reports when the same request runs."""
        p = await self._prepare_chat(req, await self.resolve(req.model))
        lease = await self.manager.acquire(self._spec(p.record, p.runner_dir, p.options),
                                           self._keep_alive(req.keep_alive_s))
        try:
            return len(await lease.runner.tokenize(p.prompt, p.add_special))
        finally:
            self.manager.release(lease)

    async def embed(self, req: EmbedCall) -> EmbedResult:
        """Embeddings from an embedding model, or pooled from a language model (as Ollama
        gives for generative models)."""
        started = time.monotonic()
        record = await self.resolve(req.model)
        caps = capabilities(record)
        if "embedding" not in caps and "completion" not in caps:
            raise InvalidRequest(f'"{req.model}" does not support embeddings')
        wire = EmbedRequest.from_dict({"input": req.input, "truncate": req.truncate,
                                       "dimensions": req.dimensions})
        runner_dir = self.store.runner_dir(record)
        options = merge_options(record, req.options, self.settings.context_length)
        spec = self._spec(record, runner_dir, options)
        if "completion" not in caps:  # an encoder keeps no KV cache
            spec.estimate_bytes = int(memory.weights_bytes(runner_dir) * memory.WEIGHT_OVERHEAD)
            spec.kv_cache_bytes = spec.min_kv_bytes = 0
        lease = await self.manager.acquire(spec, self._keep_alive(req.keep_alive_s))
        loaded = time.monotonic()
        try:
            reply = await lease.runner.embed(wire) if wire.input else EmbedResponse([])
        finally:
            self.manager.release(lease)
        self.metrics.observe_prompt(req.model, reply.prompt_eval_count)
        return EmbedResult(reply.embeddings, reply.prompt_eval_count,
                           load_duration=_load_ns(started, loaded),
                           total_duration=_ns(time.monotonic() - started))

    async def resolve(self, model: str) -> Any:
        """The model's record, its GGUF weights converted to MLX first (once) if need be."""
        if not model:
            raise InvalidRequest("model is required")
        record = self.store.resolve(model)
        source = self.store.gguf_source(record)
        if source is not None:
            await ensure_converted(self.store, source)
        return record

    # -- the request path ----------------------------------------------------------------

    async def _start(self, model: str, p: Prepared, keep_alive: float, started: float, *,
                     logprobs: bool = False, top_logprobs: int = 0,
                     shift: bool = True, think_budget: int | None = None) -> Completion:
        images = await ready_images(p.images, self.settings.allow_image_urls) \
            if p.images else []
        spec = self._spec(p.record, p.runner_dir, p.options)
        lease = await self.manager.acquire(spec, keep_alive)
        loaded = time.monotonic()  # Ollama's load_duration: from the request to its runner
        try:
            request = CompletionRequest(prompt=p.prompt, options=p.options,
                                        logprobs=logprobs or top_logprobs > 0,
                                        top_logprobs=top_logprobs, format=p.format,
                                        format_after=p.format_after,
                                        think_open=p.think_open, shift=shift,
                                        images=images)
            if think_budget is not None and p.think_end:
                request.think_budget, request.think_end = think_budget, p.think_end
            if p.want_context or p.context:
                # The reply's `context` is the prompt's ids and the output's; the runner
                # returns the prompt's on its final chunk. The given context's ids go as
                # `tokens` (used as they are) and the prompt as text, tokenized by the runner
                # after them with the specials only when there is no context: the very ids
                # that tokenizing here and sending `context + ids` gave, in one round trip.
                request.tokens = p.context or None
                request.add_special = p.add_special and not p.context
                request.return_prompt_tokens = p.want_context
            stream = await lease.runner.complete(request)
        except BaseException:
            self.manager.release(lease)
            raise

        async def cleanup() -> None:  # idempotent: the stream's close and release both are
            await stream.aclose()
            self.manager.release(lease)

        events = self._events(lease, stream, p.parser, started, p.want_context,
                              _load_ns(started, loaded))
        async def count_prompt() -> int:
            ids = await lease.runner.tokenize(p.prompt, p.add_special and not p.context)
            return len(p.context) + len(ids)

        return Completion(model, events, cleanup, count_prompt)

    async def _events(self, lease: Lease, stream: Any, parser: OutputParser,
                      started: float, want_context: bool,
                      load_duration: int) -> AsyncIterator[Delta | Final]:
        out_tokens: list[int] = []
        reasoning = 0
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
                if thinking and not (content or calls):
                    reasoning += len(chunk.tokens)
                delta = Delta(content, thinking, calls, with_bytes(chunk.logprobs))
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
                    load_duration=load_duration,
                    total_duration=_ns(time.monotonic() - started),
                    context=_context(chunk.prompt_tokens, out_tokens) if want_context else None,
                    reasoning_count=reasoning)
                return
        finally:
            await stream.aclose()
            self.manager.release(lease)

    async def _load_or_unload(self, model: str, record: Any, keep_alive: float, started: float,
                              request_options: dict[str, Any]) -> Completion:
        if keep_alive == 0:
            await self.manager.unload(record.name)
            return Completion(model, _single(Final("unload")))
        options = merge_options(record, request_options, self.settings.context_length)
        spec = self._spec(record, self.store.runner_dir(record), options)
        lease = await self.manager.acquire(spec, keep_alive)
        self.manager.release(lease)
        return Completion(model, _single(Final(
            "load", load_duration=_load_ns(started, time.monotonic()),
            total_duration=_ns(time.monotonic() - started))))

    # -- helpers -------------------------------------------------------------------------

    def _keep_alive(self, value: float | None) -> float:
        if value is None:
            return self.settings.keep_alive_s
        return -1.0 if value < 0 else float(value)

    def _spec(self, record: Any, runner_dir: Path, options: Options) -> LoadSpec:
        num_ctx = int(options.num_ctx or self.settings.context_length)
        hosts = self._hosts(record)
        ranks = len(hosts) if hosts else 1
        local = sum(h.local for h in hosts) if hosts else 1
        key = (str(runner_dir), num_ctx, ranks, local)
        est = self._estimates.get(key)
        if est is None:
            est = self._estimates[key] = memory.estimate(
                runner_dir, num_ctx, self.settings.num_parallel, ranks=ranks, local_ranks=local)
        params = record.params or {}
        return LoadSpec(name=record.name, model_dir=runner_dir, estimate_bytes=est.total_bytes,
                        context_length=num_ctx, kv_cache_bytes=est.kv_bytes,
                        min_kv_bytes=est.min_kv_bytes, digest=record.digest, info=record,
                        hosts=hosts, local_ranks=est.local_ranks,
                        sharding=str(params.get("sharding") or self.settings.sharding))

    def _hosts(self, record: Any) -> tuple[Host, ...] | None:
        """The ranks to shard a model over: the server's hostfile for a language model, unless
        its Modelfile says `PARAMETER distributed false`; `distributed true` without a
        hostfile is an error. Vision and embedding models run in one process."""
        wanted = (record.params or {}).get("distributed")
        hostfile = self.settings.hostfile
        if wanted is False:
            return None
        if hostfile is None:
            if wanted:
                raise InvalidRequest(f'"{record.name}" is marked distributed (PARAMETER '
                                     f'distributed true) but the server has no hostfile: set '
                                     f'MLXR_HOSTFILE')
            return None
        caps = capabilities(record)
        if not wanted and ("completion" not in caps or "vision" in caps):
            return None
        return hostfile_hosts(hostfile)