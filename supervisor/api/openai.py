"""OpenAI's /v1 routes: a second thin skin over the same service as the Ollama routes.

Streams are server-sent events ending with `data: [DONE]`; an error after the stream began is
sent as an event carrying OpenAI's error object (the official client raises it)."""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

from aiohttp import web

from mlxr.shared.errors import MlxrError, ModelNotFound
from mlxr.shared.ndjson import dumps_line
from mlxr.supervisor.api import openai_compat as oa
from mlxr.supervisor.api.ollama import SERVICE
from mlxr.supervisor.api.middleware import error_body, read_json
from mlxr.supervisor.inference.service import Completion, Delta, Final


async def _start(starts) -> list[Completion]:
    """Start every choice's completion; if one fails, close those already started."""
    started: list[Completion] = []
    try:
        for start in starts:
            started.append(await start())
    except BaseException:
        for c in started:
            await c.aclose()
        raise
    return started


async def _merged(completions: list[Completion]) -> AsyncIterator[tuple[int, Delta | Final]]:
    """Events of several completions as they come, tagged with the choice index."""
    if len(completions) == 1:
        async for event in completions[0]:
            yield 0, event
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, completion: Completion) -> None:
        try:
            async for event in completion:
                await queue.put((index, event))
        except BaseException as exc:
            await queue.put((index, exc))
        finally:
            await queue.put((index, None))

    tasks = [asyncio.create_task(pump(i, c)) for i, c in enumerate(completions)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for t in tasks:
            t.cancel()


class _SSE:
    def __init__(self, request: web.Request):
        self.request = request
        self.response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                                    "Cache-Control": "no-cache"})

    async def open(self) -> None:
        await self.response.prepare(self.request)

    async def send(self, obj: Any) -> None:
        await self.response.write(b"data: " + dumps_line(obj)[:-1] + b"\n\n")

    async def close(self, error: MlxrError | None = None) -> web.StreamResponse:
        if error is not None:
            await self.send(error_body(error, openai=True))
        else:
            await self.response.write(b"data: [DONE]\n\n")
        await self.response.write_eof()
        return self.response


async def chat_completions(request: web.Request) -> web.StreamResponse:
    common, messages, tools = oa.parse_chat(await read_json(request))
    service = request.app[SERVICE]
    completions = await _start(
        [lambda i=i: service.chat(oa.chat_request(common, messages, tools, i))
         for i in range(common.n)])
    try:
        if common.stream:
            return await _stream_chat(request, common, completions)
        return web.json_response(await _collect_chat(common, completions))
    finally:
        for c in completions:
            await c.aclose()


async def _collect_chat(common: oa.Common, completions: list[Completion]) -> dict[str, Any]:
    n = len(completions)
    text, thinking = [[] for _ in range(n)], [[] for _ in range(n)]
    calls, logprobs = [[] for _ in range(n)], [[] for _ in range(n)]
    finals: list[Final | None] = [None] * n
    async for i, event in _merged(completions):
        if isinstance(event, Final):
            finals[i] = event
            continue
        text[i].append(event.content)
        thinking[i].append(event.thinking)
        calls[i] += event.tool_calls
        logprobs[i] += event.logprobs or []
    choices = []
    for i in range(n):
        message: dict[str, Any] = {"role": "assistant", "content": "".join(text[i])}
        if any(thinking[i]):
            message["reasoning"] = "".join(thinking[i])
        if calls[i]:
            message["tool_calls"] = oa.tool_calls_to_openai(calls[i])
        choices.append({"index": i, "message": message,
                        "logprobs": {"content": oa.logprobs_to_openai(logprobs[i])}
                        if common.logprobs else None,
                        "finish_reason": oa.finish_reason(finals[i], bool(calls[i]))})
    return oa.envelope("chat.completion", oa.new_id("chatcmpl"), common.model, choices=choices,
                       usage=oa.usage([f for f in finals if f is not None]))


async def _stream_chat(request: web.Request, common: oa.Common,
                       completions: list[Completion]) -> web.StreamResponse:
    sse = _SSE(request)
    await sse.open()
    ident, n = oa.new_id("chatcmpl"), len(completions)
    tool_counts, finals = [0] * n, []

    def chunk(index: int, delta: dict[str, Any], finish: str | None = None, lp=None):
        choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}
        return oa.envelope("chat.completion.chunk", ident, common.model, choices=[choice])

    for i in range(n):
        await sse.send(chunk(i, {"role": "assistant", "content": ""}))
    try:
        async for i, event in _merged(completions):
            if isinstance(event, Final):
                finals.append(event)
                await sse.send(chunk(i, {}, oa.finish_reason(event, tool_counts[i] > 0)))
                continue
            delta = oa.chat_delta(event, tool_counts[i])
            tool_counts[i] += len(event.tool_calls)
            lp = {"content": oa.logprobs_to_openai(event.logprobs)} if common.logprobs else None
            if delta or lp:
                await sse.send(chunk(i, delta, None, lp))
    except MlxrError as err:
        return await sse.close(err)
    if common.include_usage:
        await sse.send(oa.envelope("chat.completion.chunk", ident, common.model, choices=[],
                                   usage=oa.usage(finals)))
    return await sse.close()


async def completions(request: web.Request) -> web.StreamResponse:
    common, prompts, suffix = oa.parse_completion(await read_json(request))
    service = request.app[SERVICE]
    plan = [(p, j) for p in prompts for j in range(common.n)]
    started = await _start([lambda p=p, j=j: service.generate(
        oa.generate_request(common, p, suffix, j)) for p, j in plan])
    try:
        if common.stream:
            return await _stream_completions(request, common, started)
        return web.json_response(await _collect_completions(common, started))
    finally:
        for c in started:
            await c.aclose()


async def _collect_completions(common: oa.Common, started: list[Completion]) -> dict[str, Any]:
    n = len(started)
    text, logprobs = [[] for _ in range(n)], [[] for _ in range(n)]
    finals: list[Final | None] = [None] * n
    async for i, event in _merged(started):
        if isinstance(event, Final):
            finals[i] = event
        else:
            text[i].append(event.content)
            logprobs[i] += event.logprobs or []
    choices = [{"index": i, "text": "".join(text[i]),
                "logprobs": oa.completion_logprobs(logprobs[i]) if common.logprobs else None,
                "finish_reason": oa.finish_reason(finals[i], False)} for i in range(n)]
    # Each prompt is counted once in the usage, however many choices it has.
    per_prompt = [f for i, f in enumerate(finals) if f is not None and i % common.n == 0]
    usage = oa.usage([f for f in finals if f is not None])
    usage["prompt_tokens"] = sum(f.prompt_eval_count for f in per_prompt)
    usage["prompt_tokens_details"]["cached_tokens"] = sum(f.prompt_eval_cached_count
                                                          for f in per_prompt)
    usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
    return oa.envelope("text_completion", oa.new_id("cmpl"), common.model, choices=choices,
                       usage=usage)


async def _stream_completions(request: web.Request, common: oa.Common,
                              started: list[Completion]) -> web.StreamResponse:
    sse = _SSE(request)
    await sse.open()
    ident, finals = oa.new_id("cmpl"), []
    try:
        async for i, event in _merged(started):
            if isinstance(event, Final):
                finals.append((i, event))
                choice = {"index": i, "text": "", "logprobs": None,
                          "finish_reason": oa.finish_reason(event, False)}
            elif event.content or event.logprobs:
                choice = {"index": i, "text": event.content, "finish_reason": None,
                          "logprobs": oa.completion_logprobs(event.logprobs or [])
                          if common.logprobs else None}
            else:
                continue
            await sse.send(oa.envelope("text_completion", ident, common.model, choices=[choice]))
    except MlxrError as err:
        return await sse.close(err)
    if common.include_usage:
        per_prompt = [f for i, f in finals if i % common.n == 0]
        usage = oa.usage([f for _, f in finals])
        usage["prompt_tokens"] = sum(f.prompt_eval_count for f in per_prompt)
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        await sse.send(oa.envelope("text_completion", ident, common.model, choices=[],
                                   usage=usage))
    return await sse.close()


async def embeddings(request: web.Request) -> web.Response:
    body = await read_json(request)
    call, encoding = oa.parse_embeddings(body)
    result = await request.app[SERVICE].embed(call)
    data = [{"object": "embedding", "index": i, "embedding": oa.encode_embedding(v, encoding)}
            for i, v in enumerate(result.embeddings)]
    return web.json_response({"object": "list", "data": data, "model": call.model,
                              "usage": {"prompt_tokens": result.prompt_eval_count,
                                        "total_tokens": result.prompt_eval_count}})


def _model_json(record: Any) -> dict[str, Any]:
    owner = record.name.split("/")[-2] if record.name.count("/") >= 1 else "library"
    return {"id": record.name, "object": "model",
            "created": int(record.modified_at.timestamp()), "owned_by": owner}


async def list_models(request: web.Request) -> web.Response:
    records = request.app[SERVICE].store.list()
    return web.json_response({"object": "list", "data": [_model_json(r) for r in records]})


async def get_model(request: web.Request) -> web.Response:
    name = request.match_info["model"]
    try:
        record = request.app[SERVICE].store.resolve(name)
    except ModelNotFound:
        raise ModelNotFound(f"The model '{name}' does not exist", param="model") from None
    return web.json_response(_model_json(record))


def add_openai_routes(app: web.Application) -> None:
    r = app.router
    r.add_post("/v1/chat/completions", chat_completions)
    r.add_post("/v1/completions", completions)
    r.add_post("/v1/embeddings", embeddings)
    r.add_get("/v1/models", list_models)
    r.add_get("/v1/models/{model:.+}", get_model)
