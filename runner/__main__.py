"""`python -m mlxr.runner --model DIR --port P` (or `--config JSON`): serve one model."""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import logging
import os
import signal
import sys
import threading

from mlxr.shared.blas import choose
from mlxr.shared.config import RunnerConfig, Settings


def parse_config(argv: list[str]) -> RunnerConfig:
    parser = argparse.ArgumentParser(prog="python -m mlxr.runner", description=__doc__)
    parser.add_argument("--config", help="all settings as one JSON object (RunnerConfig)")
    parser.add_argument("--model", help="model directory (config.json, *.safetensors, tokenizer)")
    parser.add_argument("--host", default=None)
    parser.add_argument("--port", type=int, default=None)
    parser.add_argument("--num-parallel", type=int, default=None)
    parser.add_argument("--context-length", type=int, default=None)
    parser.add_argument("--prefill-chunk", type=int, default=None)
    parser.add_argument("--prefix-cache-bytes", type=int, default=None)
    args = parser.parse_args(argv)
    values = json.loads(args.config) if args.config else {}
    for key in ("host", "port", "num_parallel", "context_length", "prefill_chunk",
                "prefix_cache_bytes"):
        if getattr(args, key) is not None:
            values[key] = getattr(args, key)
    if args.model:
        values["model_dir"] = args.model
    if not values.get("model_dir"):
        parser.error("--model or a config with model_dir is required")
    return RunnerConfig.from_dict(values)


def _preload_blas(config: RunnerConfig) -> None:
    """The mlx CPU wheel's own BLAS is several times slower than OpenBLAS on Linux: re-exec
    with the supervisor's probed choice preloaded, or, for a runner started by hand, with
    the library shared/blas.py chooses (probing it in a throwaway process first)."""
    if not sys.platform.startswith("linux") or config.blas == "off":
        return
    path: str | None = config.blas
    if path == "auto":
        settings = Settings.from_env()
        choice = choose(settings.blas, settings.cache_dir)
        print(choice.describe(), file=sys.stderr, flush=True)
        path = choice.path
    if not path or path in os.environ.get("LD_PRELOAD", "").split():
        return  # nothing passed its probe, or the supervisor preloaded it already
    env = dict(os.environ, LD_PRELOAD=" ".join(p for p in (path, os.environ.get("LD_PRELOAD")) if p))
    os.execve(sys.executable, [sys.executable, "-m", "mlxr.runner", *sys.argv[1:]], env)


def _die_with_parent(watch_stdin: bool) -> None:
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if watch_stdin:
        def watch() -> None:
            while sys.stdin.buffer.read(1 << 16):
                pass
            os._exit(0)

        threading.Thread(target=watch, name="stdin-watch", daemon=True).start()


def main(argv: list[str] | None = None) -> None:
    config = parse_config(sys.argv[1:] if argv is None else argv)
    _preload_blas(config)
    _die_with_parent(config.watch_stdin)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s runner %(levelname)s %(message)s")
    from aiohttp import web

    from mlxr.runner.server import make_app

    app = make_app(config)

    async def serve() -> None:
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, config.host, config.port)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        print(json.dumps({"event": "listening", "port": port}), file=sys.stderr, flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await runner.cleanup()

    asyncio.run(serve())


if __name__ == "__main__":
    main()
