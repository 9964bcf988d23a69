"""Ollama's /api inference routes: parse the body, call the service, write Ollama's shapes.

Streams are NDJSON written as the runner produces them; with `stream: false` the events are
folded into one object. A failure after the first line becomes a final `{"error": "..."}` line.
"""

from __future__ import annotations

import datetime as dt
from typing import Any, Callable

from aiohttp import web

from mlxr.shared.config import parse_duration
from mlxr.shared.errors import InvalidRequest, MlxrError
from mlxr.shared.ndjson import dumps_line
from mlxr.supervisor.api.middleware import read_json
from mlxr.supervisor.metrics import LOG_FIELDS
from mlxr.supervisor.inference.service import (ChatRequest, Completion, Delta, EmbedCall, Final,
                                GenerateRequest, RunningModel, Service)

SERVICE = web.AppKey("service", Service)
VERSION = web.AppKey("version", str)


# -- request parsing -------------------------------------------------------------------------

def _str(body: dict[str, Any], key: str) -> str:
    value = body.get(key)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise InvalidRequest(f"{key} must be a string")
    return value


def _list(body: dict[str, Any], key: str) -> list[Any]:
    value = body.get(key)
    if value is None:
        return []
    if not isinstance(value, list):
        raise InvalidRequest(f"{key} must be a list")
    return value


def _keep_alive(body: dict[str, Any]) -> float | None:
    value = body.get("keep_alive")
    return None if value is None else parse_duration(value)


def _common(body: dict[str, Any]) -> dict[str, Any]:
    top = body.get("top_logprobs") or 0
    if not isinstance(top, int) or not 0 <= top <= 20:
        raise InvalidRequest("top_logprobs must be between 0 and 20")
    options = body.get("options")
    if options is not None and not isinstance(options, dict):
        raise InvalidRequest("options must be an object")
    return dict(model=_str(body, "model"), think=body.get("think"), format=body.get("format"),
                options=options or {}, keep_alive_s=_keep_alive(body),
                logprobs=bool(body.get("logprobs")), top_logprobs=top)


def parse_generate(body: dict[str, Any]) -> GenerateRequest:
    context = body.get("context")
    if context is not None and (not isinstance(context, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in context)):
        raise InvalidRequest("context must be a list of token ids")
    return GenerateRequest(prompt=_str(body, "prompt"), suffix=_str(body, "suffix"),
                           system=_str(body, "system") or None,
                           template=_str(body, "template") or None, raw=bool(body.get("raw")),
                           context=context, images=_list(body, "images"), **_common(body))


def parse_chat(body: dict[str, Any]) -> ChatRequest:
    messages = _list(body, "messages")
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise InvalidRequest("each message must be an object with a role")
        if m.get("content") is not None and not isinstance(m["content"], str):
            raise InvalidRequest("message content must be a string")
    tools = _list(body, "tools")
    if not all(isinstance(t, dict) for t in tools):
        raise InvalidRequest("tools must be a list of objects")
    return ChatRequest(messages=messages, tools=tools, **_common(body))


def stream_wanted(body: dict[str, Any]) -> bool:
    return body.get("stream") is None or bool(body["stream"])


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


def fold(lines: list[dict[str, Any]], chat: bool) -> dict[str, Any]:
    """One reply from the lines of a stream (for `stream: false`)."""
    final = dict(lines[-1])
    text, thinking, calls, logprobs = [], [], [], []
    for line in lines[:-1]:
        part = line["message"] if chat else line
        text.append(part.get("content" if chat else "response", ""))
        thinking.append(part.get("thinking", ""))
        calls += part.get("tool_calls", [])
        logprobs += line.get("logprobs", [])
    target = dict(final["message"]) if chat else final
    target["content" if chat else "response"] = "".join(text)
    if any(thinking):
        target["thinking"] = "".join(thinking)
    if calls:
        target["tool_calls"] = calls
    if chat:
        final["message"] = target
    if logprobs:
        final["logprobs"] = logprobs
    return final


async def respond(request: web.Request, completion: Completion, stream: bool,
                  shape: Callable[[str, Delta | Final], dict[str, Any]], chat: bool
                  ) -> web.StreamResponse:
    fields = request[LOG_FIELDS]
    fields["model"] = completion.model
    try:
        if not stream:
            lines = [shape(completion.model, ev) async for ev in completion]
            _log_final(fields, lines[-1])
            return web.json_response(fold(lines, chat), dumps=_dumps)
        response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await response.prepare(request)
        try:
            async for event in completion:
                line = shape(completion.model, event)
                await response.write(dumps_line(line))
                if line.get("done"):
                    _log_final(fields, line)
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
    return {"name": m.name, "model": m.model, "size": m.size, "digest": m.digest,
            "details": m.details, "expires_at": rfc3339(m.expires_at), "size_vram": m.size_vram,
            "context_length": m.context_length, "blas": m.blas}


# -- handlers --------------------------------------------------------------------------------

async def generate(request: web.Request) -> web.StreamResponse:
    body = await read_json(request)
    req, service = parse_generate(body), request.app[SERVICE]
    if body.get("_debug_render_only"):
        return _rendered(req.model, service.render_generate(req), chat=False)
    completion = await service.generate(req)
    return await respond(request, completion, stream_wanted(body), generate_line, chat=False)


async def chat(request: web.Request) -> web.StreamResponse:
    body = await read_json(request)
    req, service = parse_chat(body), request.app[SERVICE]
    if body.get("_debug_render_only"):
        return _rendered(req.model, service.render_chat(req), chat=True)
    completion = await service.chat(req)
    return await respond(request, completion, stream_wanted(body), chat_line, chat=True)


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
    body = await read_json(request)
    result = await request.app[SERVICE].embed(EmbedCall(
        model=_str(body, "model"), input=body.get("input"), truncate=body.get("truncate", True),
        dimensions=body.get("dimensions"), options=_options(body),
        keep_alive_s=_keep_alive(body)))
    return web.json_response({"model": body["model"], "embeddings": result.embeddings,
                              "total_duration": result.total_duration,
                              "load_duration": result.load_duration,
                              "prompt_eval_count": result.prompt_eval_count}, dumps=_dumps)


async def embeddings_legacy(request: web.Request) -> web.Response:
    """The older /api/embeddings: one `prompt`, one `embedding`."""
    body = await read_json(request)
    prompt = _str(body, "prompt")
    result = await request.app[SERVICE].embed(EmbedCall(
        model=_str(body, "model"), input=prompt, options=_options(body),
        keep_alive_s=_keep_alive(body)))
    return web.json_response({"embedding": result.embeddings[0] if prompt else []},
                             dumps=_dumps)


def _options(body: dict[str, Any]) -> dict[str, Any]:
    options = body.get("options")
    if options is not None and not isinstance(options, dict):
        raise InvalidRequest("options must be an object")
    return options or {}


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": request.app[VERSION]})


async def root(request: web.Request) -> web.Response:
    return web.Response(text="Ollama is running")


def add_ollama_routes(app: web.Application) -> None:
    r = app.router
    r.add_get("/", root)  # also answers HEAD
    r.add_get("/api/version", version)
    r.add_post("/api/generate", generate)
    r.add_post("/api/chat", chat)
    r.add_get("/api/ps", ps)
    r.add_post("/api/embed", embed)
    r.add_post("/api/embeddings", embeddings_legacy)
