"""A fake runner that speaks the runner protocol, for crash, eviction and queue timing tests.

Started like the real one (`python -m tests.harness.fake_runner --config '<RunnerConfig JSON>'`,
chosen with MLXR_RUNNER_MODULE). Knobs come from the FAKE_RUNNER environment variable (JSON),
with per-model overrides under "models" (keyed by model name, e.g. "a:latest"):

    load_s     seconds spent "loading" (status says loading meanwhile)     default 0
    delay_s    seconds between generated tokens                            default 0
    memory     bytes reported as live memory                               default 100 MB
    output     text to generate (split into one token per character);
               default: " w0 w1 w2 ..." one word per token
    fail_load  report status "error" with this message instead of loading
    exit_on_start  write this to stderr and exit with code 3 before serving
    signal_on_start  die from this signal (a name: "SIGILL") before serving, as a runner does
               whose BLAS was built for another CPU

Like the real runner it needs its secret on every route (the first line on stdin with
`token_stdin`, else `token_file`; 401 without it).

Token ids: one per character (its code point); no special tokens, so `add_special` changes
nothing. Generation stops with done_reason "length" at num_predict (16 if unset), or "stop" at
the end of `output`. The final line carries `prompt_tokens` when asked, and errors carry their
`kind`, as the real runner's do.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

from aiohttp import web

from mlxr.shared.config import RunnerConfig
from mlxr.shared.errors import ContextOverflow, Unauthorized
from mlxr.shared.ndjson import dumps_line
from mlxr.shared.protocol import Chunk, CompletionRequest, RunnerStatus, error_body
from mlxr.shared.runner_auth import (TokenCheck, new_token_file, read_token_line,
                                     token_from_file)

DEFAULT_PREDICT = 16


def knobs(model: str) -> dict:
    data = json.loads(os.environ.get("FAKE_RUNNER") or "{}")
    return {**{k: v for k, v in data.items() if k != "models"},
            **data.get("models", {}).get(model, {})}


def make_app(config: RunnerConfig, token: str) -> web.Application:
    k = knobs(config.model_name)
    check = TokenCheck(token)

    @web.middleware
    async def auth(request: web.Request, handler):
        if not check(request.headers.get("Authorization")):
            err = Unauthorized("missing or wrong runner token")
            return web.json_response(error_body(err), status=err.status)
        return await handler(request)

    started = time.monotonic()
    state = {"active": 0}

    def status_now() -> RunnerStatus:
        if k.get("fail_load"):
            return RunnerStatus("error", config.model_name, error=k["fail_load"])
        ready = time.monotonic() - started >= float(k.get("load_s", 0))
        return RunnerStatus("ready" if ready else "loading", config.model_name,
                            progress=1.0 if ready else 0.5,
                            context_length=config.context_length,
                            memory=int(k.get("memory", 100_000_000)), active=state["active"])

    async def status(request: web.Request) -> web.Response:
        return web.json_response(status_now().to_dict())

    async def tokenize(request: web.Request) -> web.Response:
        data = await request.json()
        return web.json_response({"tokens": [ord(c) for c in data["content"]]})

    async def detokenize(request: web.Request) -> web.Response:
        data = await request.json()
        return web.json_response({"content": "".join(chr(t) for t in data["tokens"])})

    async def completions(request: web.Request) -> web.StreamResponse:
        req = CompletionRequest.from_dict(await request.json())
        prompt_tokens = list(req.tokens or []) + [ord(c) for c in (req.prompt or "")]
        if len(prompt_tokens) >= (req.options.num_ctx or config.context_length):
            err = ContextOverflow(f"input length ({len(prompt_tokens)} tokens) exceeds the "
                                  f"context length ({req.options.num_ctx} tokens)")
            return web.json_response(error_body(err), status=err.status)
        limit = req.options.num_predict if req.options.num_predict > 0 else DEFAULT_PREDICT
        # As a real runner, never past the context (a fuzzed num_predict may be 2**63 - 1).
        limit = min(limit, (req.options.num_ctx or config.context_length) - len(prompt_tokens))
        if "output" in k:
            pieces, reason = list(k["output"]), "stop"
        else:
            pieces, reason = [f" w{i}" for i in range(limit)], "length"
        if len(pieces) > limit:
            pieces, reason = pieces[:limit], "length"
        response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await response.prepare(request)
        state["active"] += 1
        t0 = time.monotonic()
        try:
            for piece in pieces:
                await asyncio.sleep(float(k.get("delay_s", 0)))
                tokens = [ord(piece[0])] if piece else []
                await response.write(dumps_line({"content": piece, "done": False,
                                                 "tokens": tokens}))
            await response.write(dumps_line(Chunk(
                done=True, done_reason=reason, prompt_eval_count=len(prompt_tokens),
                prompt_eval_duration=1000, eval_count=len(pieces),
                eval_duration=int((time.monotonic() - t0) * 1e9),
                prompt_tokens=prompt_tokens if req.return_prompt_tokens else None).to_dict()))
        finally:
            state["active"] -= 1
        return response

    app = web.Application(middlewares=[auth])
    app.router.add_get("/v1/status", status)
    app.router.add_post("/v1/tokenize", tokenize)
    app.router.add_post("/v1/detokenize", detokenize)
    app.router.add_post("/v1/completions", completions)
    return app


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    config = RunnerConfig.from_dict(json.loads(parser.parse_args().config))
    if knobs(config.model_name).get("exit_on_start"):
        print(knobs(config.model_name)["exit_on_start"], file=sys.stderr, flush=True)
        sys.exit(3)
    if knobs(config.model_name).get("signal_on_start"):
        os.kill(os.getpid(), signal.Signals[knobs(config.model_name)["signal_on_start"]])
    if config.token_stdin:
        token = read_token_line(sys.stdin.buffer)
        if token is None:
            sys.exit("fake runner: no token on stdin")
    elif config.token_file:
        token = token_from_file(Path(config.token_file))
    else:
        token, _ = new_token_file()
    if config.watch_stdin:
        def watch() -> None:
            while sys.stdin.buffer.read(1 << 16):
                pass
            os._exit(0)

        threading.Thread(target=watch, daemon=True).start()
    print(f"fake runner for {config.model_name} on port {config.port}", file=sys.stderr,
          flush=True)
    web.run_app(make_app(config, token), host=config.host, port=config.port, print=None)


if __name__ == "__main__":
    main()
