"""One middleware renders every error: Ollama's `{"error": "..."}` on /api routes, OpenAI's
error object on /v1 routes. Handlers raise `shared.errors.MlxrError` subclasses."""

from __future__ import annotations

import json
import logging
from typing import Any

from aiohttp import web

from mlxr.shared.errors import InvalidRequest, MlxrError

log = logging.getLogger("mlxr.http")


def is_openai_path(path: str) -> bool:
    return path.startswith("/v1/")


def error_body(err: MlxrError, openai: bool) -> dict[str, Any]:
    if openai:
        return {"error": {"message": err.message, "type": err.openai_type,
                          "param": err.param, "code": err.code}}
    return {"error": err.message}


def error_response(err: MlxrError, path: str) -> web.Response:
    return web.json_response(error_body(err, is_openai_path(path)), status=err.status)


@web.middleware
async def error_middleware(request: web.Request, handler):
    try:
        return await handler(request)
    except MlxrError as err:
        return error_response(err, request.path)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        err = MlxrError(exc.reason or "error")
        err.status = exc.status
        err.openai_type = "invalid_request_error" if exc.status < 500 else "server_error"
        return error_response(err, request.path)
    except Exception as exc:  # a bug: answer 500 with the reason, keep serving
        log.exception("unhandled error on %s %s", request.method, request.path)
        return error_response(MlxrError(f"internal error: {exc}"), request.path)


async def read_json(request: web.Request) -> dict[str, Any]:
    """The request body as a JSON object; an empty body is `{}`. Bad JSON is a 400."""
    raw = await request.read()
    if not raw.strip():
        return {}
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"invalid JSON body: {exc}") from None
    if not isinstance(data, dict):
        raise InvalidRequest("request body must be a JSON object")
    return data
