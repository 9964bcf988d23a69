"""Ollama's /api inference routes: parse the body, call the service, write Ollama's shapes.

Streams are NDJSON written as the runner produces them; with `stream: false` the events are
folded (`inference.types.fold`) into one reply. A failure after the first line becomes a final
`{"error": "..."}` line.
"""

from __future__ import annotations

import datetime as dt
from typing import Any, Callable

from aiohttp import web

from mlxr.shared.errors import MlxrError
from mlxr.shared.ndjson import dumps_line
from mlxr.supervisor.api.body import (parse_chat, parse_embed, parse_embeddings_legacy,
                                      parse_generate, read_json, stream_wanted)
from mlxr.supervisor.api.keys import SERVICE, VERSION
from mlxr.supervisor.inference.types import Completion, Delta, Final, Reply, RunningModel, fold
from mlxr.supervisor.metrics import LOG_FIELDS
from mlxr.supervisor.version import OLLAMA_API_VERSION


# -- response shapes -------------------------------------------------------------------------

def now_iso() -> str:
    return rfc3339(dt.datetime.now(dt.timezone.utc))


def rfc3339(t: dt.datetime) -> str:
    return t.astimezone(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _final_fields(final: Final) -> dict[str, Any]:
    out: dict[str, Any] = {"done": True, "done_reason": final.done_reason}
    if final.done_reason in ("load", "unload"):
        return out
    out.update(total_duration=final.total_duration, load_duration=final.load_duration,
               prompt_eval_count=final.prompt_eval_count,
               prompt_eval_duration=final.prompt_eval_duration, eval_count=final.eval_count,
               eval_duration=final.eval_duration)
    return out


def generate_line(model: str, event: Delta | Final) -> dict[str, Any]:
    out: dict[str, Any] = {"model": model, "created_at": now_iso(), "response": ""}
    if isinstance(event, Final):
        out.update(_final_fields(event))
        if event.context is not None:
            out["context"] = event.context
        return out
    out["response"] = event.content
    if event.thinking:
        out["thinking"] = event.thinking
    if event.logprobs:
        out["logprobs"] = event.logprobs
    out["done"] = False
    return out


def chat_line(model: str, event: Delta | Final) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": ""}
    out: dict[str, Any] = {"model": model, "created_at": now_iso(), "message": message}
    if isinstance(event, Final):
        out.update(_final_fields(event))
        return out
    message["content"] = event.content
    if event.thinking:
        message["thinking"] = event.thinking
    if event.tool_calls:
        message["tool_calls"] = event.tool_calls
    if event.logprobs:
        out["logprobs"] = event.logprobs
    out["done"] = False
    return out


def generate_reply(model: str, reply: Reply) -> dict[str, Any]:
    """The whole reply to a generate request with `stream: false`."""
    out = generate_line(model, reply.final)
    out["response"] = reply.content
    if reply.thinking:
        out["thinking"] = reply.thinking
    if reply.logprobs:
        out["logprobs"] = reply.logprobs
    return out


def chat_reply(model: str, reply: Reply) -> dict[str, Any]:
    """The whole reply to a chat request with `stream: false`."""
    out = chat_line(model, reply.final)
    message = out["message"]
    message["content"] = reply.content
    if reply.thinking:
        message["thinking"] = reply.thinking
    if reply.tool_calls:
        message["tool_calls"] = reply.tool_calls
    if reply.logprobs:
        out["logprobs"] = reply.logprobs
    return out


async def respond(request: web.Request, completion: Completion, stream: bool,
                  line: Callable[[str, Delta | Final], dict[str, Any]],
                  whole: Callable[[str, Reply], dict[str, Any]]) -> web.StreamResponse:
    """Stream `completion` as NDJSON lines shaped by `line`, or (`stream: false`) answer
    with its events folded into one reply shaped by `whole`."""
    fields = request[LOG_FIELDS]
    fields["model"] = completion.model
    try:
        if not stream:
            reply = whole(completion.model, fold([event async for event in completion]))
            _log_final(fields, reply)
            return web.json_response(reply, dumps=_dumps)
        response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await response.prepare(request)
        try:
            async for event in completion:
                out = line(completion.model, event)
                await response.write(dumps_line(out))
                if out.get("done"):
                    _log_final(fields, out)
        except MlxrError as err:
            fields["error"] = repr(err.message)
            await response.write(dumps_line({"error": err.message}))
        await response.write_eof()
        return response
    finally:
        await completion.aclose()


def _dumps(obj: Any) -> str:
    return dumps_line(obj).decode()


def _log_final(fields: dict[str, Any], line: dict[str, Any]) -> None:
    for key in ("done_reason", "load_duration", "prompt_eval_count", "prompt_eval_duration",
                "eval_count", "eval_duration"):
        if key in line:
            value = line[key]
            fields[key.replace("_duration", "_ms")] = (f"{value / 1e6:.1f}"
                                                        if key.endswith("duration") else value)


def running_model_json(m: RunningModel) -> dict[str, Any]:
    out = {"name": m.name, "model": m.model, "size": m.size, "digest": m.digest,
           "details": m.details, "expires_at": rfc3339(m.expires_at), "size_vram": m.size_vram,
           "context_length": m.context_length, "blas": m.blas, "kv": m.kv}
    if m.weights:
        out["weights"] = m.weights
    if m.ranks:  # a model sharded over several ranks: how, and each one's host and memory
        out["sharding"] = m.sharding
        out["ranks"] = m.ranks
    return out


# -- handlers --------------------------------------------------------------------------------

async def generate(request: web.Request) -> web.StreamResponse:
    body = await read_json(request)
    req, service = parse_generate(body), request.app[SERVICE]
    if body.get("_debug_render_only"):
        return _rendered(req.model, await service.render_generate(req), chat=False)
    completion = await service.generate(req)
    return await respond(request, completion, stream_wanted(body), generate_line,
                         generate_reply)


async def chat(request: web.Request) -> web.StreamResponse:
    body = await read_json(request)
    req, service = parse_chat(body), request.app[SERVICE]
    if body.get("_debug_render_only"):
        return _rendered(req.model, await service.render_chat(req), chat=True)
    completion = await service.chat(req)
    return await respond(request, completion, stream_wanted(body), chat_line, chat_reply)


def _rendered(model: str, prompt: str, chat: bool) -> web.Response:
    """Ollama's `_debug_render_only`: the rendered prompt, without running the model."""
    out: dict[str, Any] = {"model": model, "created_at": now_iso(), "done": False,
                           "_debug_info": {"rendered_template": prompt, "image_count": 0}}
    if chat:
        out["message"] = {"role": "assistant", "content": ""}
    return web.json_response(out)


async def ps(request: web.Request) -> web.Response:
    models = request.app[SERVICE].ps()
    return web.json_response({"models": [running_model_json(m) for m in models]})


async def embed(request: web.Request) -> web.Response:
    call = parse_embed(await read_json(request))
    result = await request.app[SERVICE].embed(call)
    return web.json_response({"model": call.model, "embeddings": result.embeddings,
                              "total_duration": result.total_duration,
                              "load_duration": result.load_duration,
                              "prompt_eval_count": result.prompt_eval_count}, dumps=_dumps)


async def embeddings_legacy(request: web.Request) -> web.Response:
    """The older /api/embeddings: one `prompt`, one `embedding`."""
    call = parse_embeddings_legacy(await read_json(request))
    result = await request.app[SERVICE].embed(call)
    return web.json_response({"embedding": result.embeddings[0] if call.input else []},
                             dumps=_dumps)


async def version(request: web.Request) -> web.Response:
    """`version` is the Ollama API version implemented (what Ollama clients compare);
    `mlxr_version` is mlxr's own."""
    return web.json_response({"version": OLLAMA_API_VERSION,
                              "mlxr_version": request.app[VERSION]})


async def status(request: web.Request) -> web.Response:
    """Ollama's `GET /api/status` (its client's `CloudStatusExperimental`; `ollama launch`
    asks it before offering cloud models). mlxr runs local models only, so its cloud is
    always off; `source` "none": no setting turned it off, there is none to turn on."""
    return web.json_response({"cloud": {"disabled": True, "source": "none"}})


async def root(request: web.Request) -> web.Response:
    return web.Response(text="Ollama is running")
