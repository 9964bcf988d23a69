"""OpenAI's /v1 routes: a second thin skin over the same service as the Ollama routes.

Requests are parsed in openai_body.py; `n` choices run concurrently in the runner's batch (a given
`seed` becomes seed + choice index, so choices differ but stay reproducible). Streams are
server-sent events ending with `data: [DONE]`; an error after the stream began is sent as an
event carrying OpenAI's error object (the official client raises it). Without `stream`, each
choice's events are folded (`inference.types.fold`) into one reply.
"""

from __future__ import annotations

import asyncio
import base64
import json
import secrets
import sys
import time
from array import array
from typing import Any, AsyncIterator

from aiohttp import web

from mlxr.shared.errors import MlxrError, ModelNotFound
from mlxr.shared.ndjson import dumps_line
from mlxr.supervisor.api.body import read_json
from mlxr.supervisor.api.keys import SERVICE, STORE
from mlxr.supervisor.api.middleware import error_body
from mlxr.supervisor.api.openai_body import (OpenAICommon, parse_openai_chat,
                                             parse_openai_completion, parse_openai_embeddings)
from mlxr.supervisor.inference.types import (ChatRequest, Completion, Delta, Final,
                                             GenerateRequest, Reply, fold)

FINISH = {"stop": "stop", "length": "length"}


# -- the service's requests, one per choice ----------------------------------------------------

def choice_options(common: OpenAICommon, index: int) -> dict[str, Any]:
    options = dict(common.options)
    if index and "seed" in options:
        options["seed"] = options["seed"] + index
    return options


def chat_request(common: OpenAICommon, messages: list[dict[str, Any]],
                 tools: list[dict[str, Any]], index: int) -> ChatRequest:
    return ChatRequest(model=common.model, messages=messages, tools=tools, format=common.format,
                       think=common.think,
                       options=choice_options(common, index), logprobs=common.logprobs,
                       top_logprobs=common.top_logprobs, force_call=common.force_call)


def generate_request(common: OpenAICommon, prompt: str, suffix: str,
                     index: int) -> GenerateRequest:
    return GenerateRequest(model=common.model, prompt=prompt, suffix=suffix, raw=not suffix,
                           format=common.format, options=choice_options(common, index),
                           logprobs=common.logprobs, top_logprobs=common.top_logprobs)


# -- response shapes ---------------------------------------------------------------------------

def tool_calls_to_openai(calls: list[dict[str, Any]], start: int = 0) -> list[dict[str, Any]]:
    return [{"index": start + i, "id": c.get("id") or f"call_{secrets.token_hex(6)}",
             "type": "function",
             "function": {"name": c["function"]["name"],
                          "arguments": json.dumps(c["function"].get("arguments", {}))}}
            for i, c in enumerate(calls)]


def logprobs_to_openai(entries: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    out = []
    for e in entries or []:
        out.append({"token": e["token"], "logprob": e["logprob"],
                    "bytes": list(e["token"].encode()),
                    "top_logprobs": [{"token": t["token"], "logprob": t["logprob"],
                                      "bytes": list(t["token"].encode())}
                                     for t in e.get("top_logprobs", [])]})
    return out


def completion_logprobs(entries: list[dict[str, Any]]) -> dict[str, Any] | None:
    if not entries:
        return None
    return {"tokens": [e["token"] for e in entries],
            "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{t["token"]: t["logprob"] for t in e.get("top_logprobs", [])}
                             for e in entries],
            "text_offset": []}


def finish_reason(final: Final, saw_tool_calls: bool) -> str:
    if saw_tool_calls:
        return "tool_calls"
    return FINISH.get(final.done_reason, "stop")


def usage(finals: list[Final]) -> dict[str, Any]:
    prompt = finals[0].prompt_eval_count if finals else 0
    completion = sum(f.eval_count for f in finals)
    cached = finals[0].prompt_eval_cached_count if finals else 0
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def envelope(kind: str, ident: str, model: str, **fields: Any) -> dict[str, Any]:
    return {"id": ident, "object": kind, "created": int(time.time()), "model": model,
            "system_fingerprint": "fp_mlxr", **fields}


def chat_delta(delta: Delta, tool_index: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if delta.content:
        out["content"] = delta.content
    if delta.thinking:
        out["reasoning"] = delta.thinking
    if delta.tool_calls:
        out["tool_calls"] = tool_calls_to_openai(delta.tool_calls, tool_index)
    return out


def encode_embedding(vector: list[float], encoding: str) -> list[float] | str:
    """OpenAI's base64 form is the little-endian float32 bytes of the vector."""
    if encoding == "float":
        return vector
    data = array("f", vector)
    if sys.byteorder == "big":
        data.byteswap()
    return base64.b64encode(data.tobytes()).decode()


# -- running the choices -----------------------------------------------------------------------

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


async def _fold_all(completions: list[Completion]) -> list[Reply]:
    """Each choice's whole reply, the choices run concurrently."""
    events: list[list[Delta | Final]] = [[] for _ in completions]
    async for i, event in _merged(completions):
        events[i].append(event)
    return [fold(e) for e in events]


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


# -- handlers ----------------------------------------------------------------------------------

async def chat_completions(request: web.Request) -> web.StreamResponse:
    common, messages, tools = parse_openai_chat(await read_json(request))
    service = request.app[SERVICE]
    completions = await _start(
        [lambda i=i: service.chat(chat_request(common, messages, tools, i))
         for i in range(common.n)])
    try:
        if common.stream:
            return await _stream_chat(request, common, completions)
        return web.json_response(_chat_reply(common, await _fold_all(completions)))
    finally:
        for c in completions:
            await c.aclose()


def _chat_reply(common: OpenAICommon, replies: list[Reply]) -> dict[str, Any]:
    choices = []
    for i, reply in enumerate(replies):
        message: dict[str, Any] = {"role": "assistant", "content": reply.content}
        if reply.thinking:
            message["reasoning"] = reply.thinking
        if reply.tool_calls:
            message["tool_calls"] = tool_calls_to_openai(reply.tool_calls)
        choices.append({"index": i, "message": message,
                        "logprobs": {"content": logprobs_to_openai(reply.logprobs)}
                        if common.logprobs else None,
                        "finish_reason": finish_reason(reply.final, bool(reply.tool_calls))})
    return envelope("chat.completion", new_id("chatcmpl"), common.model, choices=choices,
                    usage=usage([r.final for r in replies]))


async def _stream_chat(request: web.Request, common: OpenAICommon,
                       completions: list[Completion]) -> web.StreamResponse:
    sse = _SSE(request)
    await sse.open()
    ident, n = new_id("chatcmpl"), len(completions)
    tool_counts, finals = [0] * n, []

    def chunk(index: int, delta: dict[str, Any], finish: str | None = None, lp=None):
        choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}
        return envelope("chat.completion.chunk", ident, common.model, choices=[choice])

    for i in range(n):
        await sse.send(chunk(i, {"role": "assistant", "content": ""}))
    try:
        async for i, event in _merged(completions):
            if isinstance(event, Final):
                finals.append(event)
                await sse.send(chunk(i, {}, finish_reason(event, tool_counts[i] > 0)))
                continue
            delta = chat_delta(event, tool_counts[i])
            tool_counts[i] += len(event.tool_calls)
            lp = {"content": logprobs_to_openai(event.logprobs)} if common.logprobs else None
            if delta or lp:
                await sse.send(chunk(i, delta, None, lp))
    except MlxrError as err:
        return await sse.close(err)
    if common.include_usage:
        await sse.send(envelope("chat.completion.chunk", ident, common.model, choices=[],
                                usage=usage(finals)))
    return await sse.close()


async def completions(request: web.Request) -> web.StreamResponse:
    common, prompts, suffix = parse_openai_completion(await read_json(request))
    service = request.app[SERVICE]
    plan = [(p, j) for p in prompts for j in range(common.n)]
    started = await _start([lambda p=p, j=j: service.generate(
        generate_request(common, p, suffix, j)) for p, j in plan])
    try:
        if common.stream:
            return await _stream_completions(request, common, started)
        return web.json_response(_completions_reply(common, await _fold_all(started)))
    finally:
        for c in started:
            await c.aclose()


def _completions_reply(common: OpenAICommon, replies: list[Reply]) -> dict[str, Any]:
    choices = [{"index": i, "text": reply.content,
                "logprobs": completion_logprobs(reply.logprobs) if common.logprobs else None,
                "finish_reason": finish_reason(reply.final, False)}
               for i, reply in enumerate(replies)]
    # Each prompt is counted once in the usage, however many choices it has.
    per_prompt = [r.final for i, r in enumerate(replies) if i % common.n == 0]
    out = usage([r.final for r in replies])
    out["prompt_tokens"] = sum(f.prompt_eval_count for f in per_prompt)
    out["prompt_tokens_details"]["cached_tokens"] = sum(f.prompt_eval_cached_count
                                                        for f in per_prompt)
    out["total_tokens"] = out["prompt_tokens"] + out["completion_tokens"]
    return envelope("text_completion", new_id("cmpl"), common.model, choices=choices,
                    usage=out)


async def _stream_completions(request: web.Request, common: OpenAICommon,
                              started: list[Completion]) -> web.StreamResponse:
    sse = _SSE(request)
    await sse.open()
    ident, finals = new_id("cmpl"), []
    try:
        async for i, event in _merged(started):
            if isinstance(event, Final):
                finals.append((i, event))
                choice = {"index": i, "text": "", "logprobs": None,
                          "finish_reason": finish_reason(event, False)}
            elif event.content or event.logprobs:
                choice = {"index": i, "text": event.content, "finish_reason": None,
                          "logprobs": completion_logprobs(event.logprobs or [])
                          if common.logprobs else None}
            else:
                continue
            await sse.send(envelope("text_completion", ident, common.model, choices=[choice]))
    except MlxrError as err:
        return await sse.close(err)
    if common.include_usage:
        per_prompt = [f for i, f in finals if i % common.n == 0]
        out = usage([f for _, f in finals])
        out["prompt_tokens"] = sum(f.prompt_eval_count for f in per_prompt)
        out["total_tokens"] = out["prompt_tokens"] + out["completion_tokens"]
        await sse.send(envelope("text_completion", ident, common.model, choices=[],
                                usage=out))
    return await sse.close()


async def embeddings(request: web.Request) -> web.Response:
    call, encoding = parse_openai_embeddings(await read_json(request))
    result = await request.app[SERVICE].embed(call)
    data = [{"object": "embedding", "index": i, "embedding": encode_embedding(v, encoding)}
            for i, v in enumerate(result.embeddings)]
    return web.json_response({"object": "list", "data": data, "model": call.model,
                              "usage": {"prompt_tokens": result.prompt_eval_count,
                                        "total_tokens": result.prompt_eval_count}})


def _model_json(record: Any) -> dict[str, Any]:
    owner = record.name.split("/")[-2] if record.name.count("/") >= 1 else "library"
    return {"id": record.name, "object": "model",
            "created": int(record.modified_at.timestamp()), "owned_by": owner}


async def list_models(request: web.Request) -> web.Response:
    records = request.app[STORE].list()
    return web.json_response({"object": "list", "data": [_model_json(r) for r in records]})


async def get_model(request: web.Request) -> web.Response:
    name = request.match_info["model"]
    try:
        record = request.app[STORE].resolve(name)
    except ModelNotFound:
        raise ModelNotFound(f"The model '{name}' does not exist", param="model") from None
    return web.json_response({**_model_json(record), "id": name})  # the name as asked (Ollama)
