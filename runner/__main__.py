"""`python -m mlxr.runner --model DIR --port P` (or `--config JSON`): serve one model.

`python -m mlxr.runner --spare`: a spare runner. It imports what loading needs (MLX, mlx-lm's
model code: about 1 s on the 2-core EPYC; no transformers, see runner/mlx_lm_import.py), then
waits for its settings as one JSON line on stdin (a RunnerConfig) and serves them; the
supervisor keeps one ready, so a load does not wait for Python and its imports
(supervisor/runners/spare.py). Its BLAS is the one preloaded in its environment: a spare never
re-executes itself.

Every request needs the runner's secret (docs/protocol.md): started by the supervisor, it is
the first line on stdin; by hand, `--token-file FILE` (made if missing), else a fresh one is
written to a new private file whose path the `listening` line on stderr gives."""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import logging
import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path
from typing import NoReturn

from mlxr.runner import heap, mlx_lm_import
from mlxr.shared.blas import choose, preload_env
from mlxr.shared.config import RunnerConfig, Settings
from mlxr.shared.runner_auth import new_token_file, read_token_line, token_from_file

PARENT_POLL_S = 0.5
# The parent's pid, handed across the BLAS re-exec: the new image's own parent is the same
# process, or init if it died meanwhile, which getppid() alone cannot tell apart.
PARENT_ENV = "MLXR_RUNNER_PARENT"


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
    parser.add_argument("--token-file", default=None,
                        help="file with the secret requests must carry (made if missing)")
    parser.add_argument("--follower", action="store_true",
                        help="a distributed runner's rank 1..N-1 (MLX_RANK set): no HTTP, "
                             "follow rank 0's steps")
    args = parser.parse_args(argv)
    values = json.loads(args.config) if args.config else {}
    for key in ("host", "port", "num_parallel", "context_length", "prefill_chunk",
                "prefix_cache_bytes", "token_file"):
        if getattr(args, key) is not None:
            values[key] = getattr(args, key)
    if args.model:
        values["model_dir"] = args.model
    if args.follower:
        values["follower"] = True
    if not values.get("model_dir"):
        parser.error("--model or a config with model_dir is required")
    return RunnerConfig.from_dict(values)


def _preload_blas(config: RunnerConfig, parent: int) -> None:
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
    env = preload_env(dict(os.environ), path)
    env[PARENT_ENV] = str(parent)
    os.execve(sys.executable, [sys.executable, "-m", "mlxr.runner", *sys.argv[1:]], env)


def _set_death_signal(parent: int) -> None:
    """Linux: SIGKILL when the parent dies. The supervisor sets it before exec too (and it
    survives the BLAS re-exec); set here for a parent that did not, before the BLAS probe
    and re-exec. A parent that died before it took effect: exit now."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os._exit(0)


def _watch_parent(parent: int) -> None:
    """Exit when stdin (the supervisor's pipe) closes, or when the parent changes (it died and
    we were re-parented): the second catches a pipe whose write end leaked into another
    process, and is all macOS has besides stdin."""

    def watch_stdin() -> None:
        while sys.stdin.buffer.read(1 << 16):
            pass
        os._exit(0)

    def watch_ppid() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        os._exit(0)

    threading.Thread(target=watch_stdin, name="stdin-watch", daemon=True).start()
    threading.Thread(target=watch_ppid, name="parent-watch", daemon=True).start()


def _token(config: RunnerConfig) -> tuple[str, Path | None]:
    """The secret requests must carry, and the file it was written to when made here."""
    if config.token_stdin:
        token = read_token_line(sys.stdin.buffer)
        if token is None:  # the supervisor went away before sending it
            _fail("runner: no token on stdin (token_stdin is set)")
        return token, None
    if config.token_file:
        path = Path(config.token_file).expanduser()
        try:
            return token_from_file(path), path
        except (OSError, ValueError) as exc:
            _fail(f"runner: cannot use token file {path}: {exc}")
    return new_token_file()


def _import_for_load() -> None:
    """Import what serving and runner/loader.py's `load_model` import, before any model is
    named: MLX, mlx-lm's model code, `tokenizers`. (Transformers only where a tokenizer needs
    it, at load: runner/tokenizer.py.)"""
    import mlx.core  # noqa: F401
    import mlx_lm.models.cache  # noqa: F401
    import mlx_lm.utils  # noqa: F401
    import tokenizers  # noqa: F401

    import mlxr.runner.embed.embeddings  # noqa: F401
    import mlxr.runner.host_body  # noqa: F401
    import mlxr.runner.model_step  # noqa: F401
    import mlxr.runner.probe_reference  # noqa: F401
    import mlxr.runner.server  # noqa: F401
    import mlxr.runner.weights  # noqa: F401


def _wait_as_spare() -> RunnerConfig:
    """A spare runner's settings: imported what loading needs, then read them from stdin.
    The supervisor gone first (end of input): exit."""
    # On a thread, as a runner started for its model imports them on its engine thread,
    # and after `heap.keep_freed` (main): imported on the main thread before it, the 30M
    # model decoded 7-9% slower through the server (135 against 145 tok/s, 10 alternating
    # rounds); with both changes, at parity (131 against 130). Which of the two mattered
    # was not separated (glibc gives threads their own heap arenas).
    importer = threading.Thread(target=_import_for_load, name="spare-imports")
    importer.start()
    importer.join()
    line = sys.stdin.buffer.readline()
    if not line.endswith(b"\n"):
        os._exit(0)
    try:
        config = RunnerConfig.from_dict(json.loads(line))
    except (ValueError, TypeError, AttributeError) as exc:
        _fail(f"runner: a spare runner's settings must be one JSON object: {exc}")
    preloaded = os.environ.get("LD_PRELOAD", "").split()
    if sys.platform.startswith("linux") and config.blas not in ("off", *preloaded):
        _fail(f"runner: a spare runner was started without the BLAS {config.blas}")
    return config


def main(argv: list[str] | None = None) -> None:
    parent = int(os.environ.pop(PARENT_ENV, "0")) or os.getppid()
    argv = sys.argv[1:] if argv is None else argv
    mlx_lm_import.install()  # before anything imports mlx_lm
    _set_death_signal(parent)
    if argv == ["--spare"]:
        heap.keep_freed()
        config = _wait_as_spare()
    else:
        config = parse_config(argv)
        _preload_blas(config, parent)
        heap.keep_freed()
    if config.follower:  # no HTTP, so no secret
        if config.watch_stdin:
            _watch_parent(parent)
        logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                            format="%(asctime)s follower %(levelname)s %(message)s")
        follow(config)
        return
    token, token_path = _token(config)  # before the watch reads stdin
    made_token_file = token_path is not None and not config.token_file
    if config.watch_stdin:
        _watch_parent(parent)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s runner %(levelname)s %(message)s")
    from aiohttp import web

    from mlxr.runner.server import make_app

    app = make_app(config, token)

    async def serve() -> None:
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, config.host, config.port)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        event = {"event": "listening", "port": port}
        if token_path is not None:
            event["token_file"] = str(token_path)
        print(json.dumps(event), file=sys.stderr, flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await runner.cleanup()

    try:
        asyncio.run(serve())
    finally:
        if made_token_file:
            shutil.rmtree(token_path.parent, ignore_errors=True)
    _exit_now()


def _fail(message: str) -> NoReturn:
    """Exit with status 1 and `message` on stderr, without the interpreter's teardown: once
    MLX is imported (a spare imports it before it reads its settings) that teardown can
    abort (see `_exit_now`): a spare given bad settings ended by SIGABRT, not status 1, in
    one CI run."""
    _exit_now(message, 1)


def _exit_now(message: str | None = None, status: int = 0) -> NoReturn:
    """End a runner that stopped in order without the interpreter's teardown. A runner that
    had run MLX's quantized products died in it in 4 of 6 stops by SIGTERM on the 2-core
    EPYC ("terminate called without an active exception": a joinable C++ thread destroyed by
    a static destructor, SIGABRT, exit status -6; a core dump where the system keeps them);
    nothing the runner owns needs that teardown once its server is closed."""
    logging.shutdown()
    if message is not None:
        print(message, file=sys.stderr)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(status)


def follow(config: RunnerConfig) -> None:
    """A distributed runner's rank 1..N-1: load this rank's shard as rank 0 does, then run
    the forward passes rank 0 sends until it says stop. Any failure ends the process (and
    the supervisor ends the group)."""
    from mlxr.runner.distributed.lockstep import Follower, join_group
    from mlxr.runner.loader import freeze_heap, load_model
    from mlxr.shared.blas import loaded_blas

    group = join_group(config)
    if group is None:
        _fail("runner: --follower needs a rank in a group of 2 or more ranks")
    loaded = load_model(config, loaded_blas().describe(), lambda progress: None, group)
    freeze_heap()
    print(json.dumps({"event": "following", "rank": group.rank()}), file=sys.stderr,
          flush=True)
    threading.Thread(target=_report_memory, daemon=True).start()
    Follower(group, loaded.model_step, config).serve()
    _exit_now()


def _report_memory(every_s: float = 2.0) -> None:
    """A follower has no HTTP: it tells the supervisor its memory on its output (the only
    channel a rank on another host has), for /api/ps."""
    import psutil

    me = psutil.Process()
    while True:
        host = psutil.virtual_memory()
        print(json.dumps({"event": "memory", "rss": me.memory_info().rss,
                          "host_total": host.total, "host_available": host.available}),
              file=sys.stderr, flush=True)
        time.sleep(every_s)


if __name__ == "__main__":
    main()
