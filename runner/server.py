"""The runner's HTTP face: /v1/status, /v1/completions, /v1/tokenize, /v1/detokenize,
/v1/embeddings. Every route needs the runner's secret (shared/runner_auth.py; 401 without it).
Validation happens here, before a request is queued, so bad input is a 4xx and never a broken
stream. Nothing here calls MLX: sequences are built without MLX state, and the
engine thread does all MLX work."""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import Any

from aiohttp import web

from mlxr.shared.config import RunnerConfig
from mlxr.shared.errors import (ContextOverflow, InvalidModelFile, InvalidRequest, MlxrError,
                                RunnerFailed, ServerBusy, Unauthorized)
from mlxr.shared.ndjson import dumps_line
from mlxr.shared.images import decode_base64_image
from mlxr.shared.protocol import CompletionRequest, EmbedRequest, error_body
from mlxr.shared.runner_auth import TokenCheck
from mlxr.runner.embed.embeddings import embed
from mlxr.runner.engine import Engine
from mlxr.runner.grammar import make_grammar
from mlxr.runner.request import make_sequence
from mlxr.runner.think_budget import ThinkBudget

log = logging.getLogger("mlxr.runner")

MAX_BODY_BYTES = 64 << 20
# A prompt up to this many characters is encoded on the event loop (about 1.3 ms at 2,048
# with the Qwen3 tokenizer on the 2-core EPYC), not in an executor thread: under a running
# batch, the hop to the thread and back (the interpreter lock, shared with the engine thread)
# made a request's arrival to its submission 4.0 ms at the median and 15.5 at p90 (16-prompt
# bursts into a busy runner); inline, 1.1 and 5.1 ms.
INLINE_ENCODE_CHARS = 2048
ENGINE = web.AppKey("engine", Engine)
TOKEN_CHECK = web.AppKey("token_check", TokenCheck)
UNAUTHORIZED = Unauthorized("missing or wrong runner token")


@web.middleware
async def errors(request: web.Request, handler):
    if not request.app[TOKEN_CHECK](request.headers.get("Authorization")):
        return web.json_response(error_body(UNAUTHORIZED), status=UNAUTHORIZED.status)
    try:
        return await handler(request)
    except MlxrError as err:
        return web.json_response(error_body(err), status=err.status)
    except web.HTTPException:
        raise
    except Exception as exc:
        log.exception("unhandled error")
        return web.json_response(error_body(RunnerFailed(f"internal error: {exc}")), status=500)


async def _json(request: web.Request) -> Any:
    try:
        return await request.json(loads=_loads)
    except ValueError as exc:
        raise InvalidRequest(f"invalid JSON body: {exc}") from None


def _loads(raw: str) -> Any:
    import orjson

    return orjson.loads(raw)


def _ready_engine(request: web.Request) -> Engine:
    engine = request.app[ENGINE]
    if engine.state == "error":
        if engine.error_kind == InvalidModelFile.kind:
            raise InvalidModelFile(engine.error or "invalid model file")
        raise RunnerFailed(engine.error or "model failed to load")
    if engine.state != "ready":
        raise ServerBusy("model is still loading")
    return engine


async def status(request: web.Request) -> web.Response:
    return web.json_response(request.app[ENGINE].status().to_dict())


async def tokenize(request: web.Request) -> web.Response:
    engine = _ready_engine(request)
    data = await _json(request)
    content = data.get("content") if isinstance(data, dict) else None
    if not isinstance(content, str):
        raise InvalidRequest("content must be a string")
    tokens = await asyncio.get_running_loop().run_in_executor(
        None, _encode, engine, content, bool(data.get("add_special", False)))
    return web.json_response({"tokens": tokens})


async def detokenize(request: web.Request) -> web.Response:
    engine = _ready_engine(request)
    data = await _json(request)
    tokens = data.get("tokens") if isinstance(data, dict) else None
    if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
        raise InvalidRequest("tokens must be a list of integers")
    _check_token_ids(engine, tokens)
    return web.json_response({"content": engine.loaded.tokenizer.decode(tokens)})


async def embeddings(request: web.Request) -> web.Response:
    import orjson  # json.dumps is slow on up to 2048 x dims floats

    engine = _ready_engine(request)
    req = EmbedRequest.from_dict(await _json(request))
    if engine.loaded.embedder is None:
        raise InvalidRequest("model does not support embeddings")
    result = await embed(req, engine.loaded.embedder, engine.call)
    return web.Response(body=orjson.dumps(result.to_dict(), option=orjson.OPT_SERIALIZE_NUMPY),
                        content_type="application/json")


def _encode(engine: Engine, text: str, add_special: bool) -> list[int]:
    tokenizer = engine.loaded.tokenizer
    bos = getattr(tokenizer, "bos_token", None)
    if add_special and bos and text.startswith(bos):
        add_special = False  # the chat template already wrote it
    return tokenizer.encode(text, add_special_tokens=add_special)


async def _prepare_images(engine: Engine, prompt: str, images: list[str]):
    """Decode the images, then run the model's processor (`_side_work`, each part)."""
    decoded = await _side_work(engine, lambda: [
        decode_base64_image(data, f"image {i}") for i, data in enumerate(images)])
    return await _side_work(engine, lambda: engine.loaded.vision.prepare(prompt, decoded))


async def _side_work(engine: Engine, fn):
    """`fn`'s result, computed where it slows the running streams least. With the model on
    the CPU: on the engine thread, in a turn of its own between two steps (Engine.call). In
    a thread beside the steps, on the 2-core EPYC, 8 streams' 10 ms decode steps took 40-60
    ms while an image was prepared (an engine trace): the thread and the steps' BLAS threads
    share the cores, and it needs the interpreter lock the engine thread holds most of the
    time; on the engine thread each part adds its own 8-15 ms to one turn. With the model on
    a GPU, the steps leave the cores free: a thread of the event loop's executor."""
    if engine.on_cpu:
        return await asyncio.wrap_future(engine.call(fn))
    return await asyncio.get_running_loop().run_in_executor(None, fn)


def _check_token_ids(engine: Engine, tokens: list[int]) -> None:
    vocab = engine.loaded.vocab_size
    bad = next((t for t in tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise InvalidRequest(f"token id {bad} is out of range (vocabulary size {vocab})")


async def _opening_token(engine: Engine, req: CompletionRequest) -> int | None:
    """The one token of the request's `think_open`, for its grammar and its budget; None
    without one, or where the tag is several tokens (both then act as without it)."""
    if not req.think_open:
        return None
    ids = await asyncio.get_running_loop().run_in_executor(
        None, _encode, engine, req.think_open, False)
    return ids[0] if len(ids) == 1 else None


async def _think_budget(engine: Engine, req: CompletionRequest, num_prompt: int,
                        opening: int | None) -> ThinkBudget | None:
    if req.think_budget is None or not req.think_end:
        return None
    tag = await asyncio.get_running_loop().run_in_executor(
        None, _encode, engine, req.think_end, False)
    return ThinkBudget(req.think_budget, tag, num_prompt, opening) if tag else None


async def completions(request: web.Request) -> web.StreamResponse:
    engine = _ready_engine(request)
    if "completion" not in engine.loaded.capabilities:
        raise InvalidRequest("model does not support generate")
    req = CompletionRequest.from_dict(await _json(request))
    tokens = list(req.tokens or [])
    vision = None
    if req.images:
        if engine.loaded.vision is None:
            raise InvalidRequest("model does not support images")
        vision = await _prepare_images(engine, req.prompt, req.images)
        tokens = list(vision.tokens)
    elif req.prompt:
        add_special = req.add_special if req.add_special is not None else not tokens
        if len(req.prompt) <= INLINE_ENCODE_CHARS:
            tokens += _encode(engine, req.prompt, add_special)
        else:
            tokens += await asyncio.get_running_loop().run_in_executor(
                None, _encode, engine, req.prompt, add_special)
    if not tokens:
        raise InvalidRequest("prompt is empty")
    _check_token_ids(engine, tokens)
    _check_token_ids(engine, list(req.options.logit_bias))
    num_ctx = min(req.options.num_ctx or engine.config.context_length, engine.loaded.max_context)
    if len(tokens) >= num_ctx:
        raise ContextOverflow(
            f"input length ({len(tokens)} tokens) exceeds the context length ({num_ctx} tokens)")
    engine.check_fits(len(tokens))
    grammar, opening = None, await _opening_token(engine, req)
    if req.format is not None:  # compiled here, so a bad schema is a 400, not a broken stream
        grammar = await asyncio.get_running_loop().run_in_executor(
            None, make_grammar, engine.loaded.tokenizer, engine.loaded.vocab_size, req.format,
            len(tokens), req.format_after, opening)

    outbox: asyncio.Queue = asyncio.Queue()
    seq = make_sequence(next(request.app[SEQ_IDS]), tokens, req.options, num_ctx, req.logprobs,
                        req.top_logprobs, outbox.put_nowait, grammar=grammar,
                        return_prompt_tokens=req.return_prompt_tokens, shift=req.shift,
                        think_budget=await _think_budget(engine, req, len(tokens), opening),
                        vision=vision)
    response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
    await response.prepare(request)
    engine.submit(seq)
    finished = False
    try:
        while not finished:
            item = await outbox.get()
            finished = bool(item.get("done")) or "error" in item
            await response.write(dumps_line(item))
    finally:
        if not finished:
            engine.cancel(seq)  # the client went away
    return response


SEQ_IDS = web.AppKey("seq_ids", itertools.count)


def make_app(config: RunnerConfig, token: str) -> web.Application:
    """The runner's app; every request must carry `token` (shared/runner_auth.py)."""
    app = web.Application(middlewares=[errors], client_max_size=MAX_BODY_BYTES)
    app[TOKEN_CHECK] = TokenCheck(token)
    loop_holder: dict[str, asyncio.AbstractEventLoop] = {}

    def deliver(batch: list[tuple[Any, Any]]) -> None:
        loop_holder["loop"].call_soon_threadsafe(_deliver_all, batch)

    engine = Engine(config, deliver)
    app[ENGINE] = engine
    app[SEQ_IDS] = itertools.count(1)

    async def on_startup(app: web.Application) -> None:
        loop_holder["loop"] = asyncio.get_running_loop()
        engine.start()

    async def on_cleanup(app: web.Application) -> None:
        engine.stop()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    app.router.add_get("/v1/status", status)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/tokenize", tokenize)
    app.router.add_post("/v1/detokenize", detokenize)
    app.router.add_post("/v1/embeddings", embeddings)
    return app


def _deliver_all(batch: list[tuple[Any, Any]]) -> None:
    for sink, item in batch:
        sink(item)
