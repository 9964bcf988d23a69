"""`mlxr`: the command line. `serve` runs the server; `setup-demo` puts a demo model in the
store. Client commands (run, list, ps, ...) are added to the `main` group the same way: a
function decorated with `@main.command()` that builds its Settings with `settings_from()`."""

from __future__ import annotations

import asyncio
import importlib.metadata
import logging
import sys
from pathlib import Path

import click

from shared.config import Settings, parse_host

DEMO_MODEL = "demo"
DEMO_PRESET = "small"


def version() -> str:
    try:
        return importlib.metadata.version("mlxr")
    except importlib.metadata.PackageNotFoundError:
        return "0.1.0"


def settings_from(host: str | None = None, models: str | None = None, **overrides) -> Settings:
    """Settings from the environment, with command-line flags on top."""
    if host:
        overrides["host"], overrides["port"] = parse_host(host)
    if models:
        overrides["models_dir"] = Path(models).expanduser()
    return Settings.from_env(**overrides)


def setup_logging(debug: bool) -> None:
    logging.basicConfig(level=logging.DEBUG if debug else logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # One line per request comes from our access log; httpx's own lines would double it.
    logging.getLogger("httpx").setLevel(logging.WARNING)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(version=version(), prog_name="mlxr", message="%(prog)s %(version)s")
def main() -> None:
    """An Ollama-compatible LLM server on MLX."""


@main.command()
@click.option("--host", help="address to listen on, host:port (default: MLXR_HOST or "
              "OLLAMA_HOST, else 127.0.0.1:11434)")
@click.option("--models", help="model store directory (default: MLXR_MODELS)")
@click.option("--max-loaded-models", type=int, help="runners kept loaded at once")
@click.option("--num-parallel", type=int, help="requests a runner decodes together")
@click.option("--context-length", type=int, help="default context length (num_ctx)")
def serve(host, models, max_loaded_models, num_parallel, context_length) -> None:
    """Start the server."""
    from aiohttp import web

    from supervisor.app import make_app

    settings = settings_from(host, models, max_loaded_models=max_loaded_models,
                             num_parallel=num_parallel, context_length=context_length)
    setup_logging(settings.debug)
    log = logging.getLogger("mlxr")
    app = make_app(settings)
    log.info("Listening on %s:%d (version %s), models in %s", settings.host, settings.port,
             version(), settings.models_dir)
    # handler_cancellation: a client that disconnects cancels its request (and the runner's).
    web.run_app(app, host=settings.host, port=settings.port, print=None, access_log=None,
                handler_cancellation=True, shutdown_timeout=5.0)


@main.command("setup-demo")
@click.option("--models", help="model store directory (default: MLXR_MODELS)")
def setup_demo(models) -> None:
    """Make sure a model named `demo` (random weights, preset "small") is in the store."""
    from shared.errors import ModelNotFound
    from supervisor.registry.create import CreateRequest, RandomSpec, create_model
    from supervisor.registry.store import Store

    settings = settings_from(models=models)
    store = Store(settings.models_dir)
    try:
        record = store.resolve(DEMO_MODEL)
        click.echo(f"{record.name} is ready in {settings.models_dir}")
        return
    except ModelNotFound:
        pass

    async def create() -> None:
        req = CreateRequest(model=DEMO_MODEL, random=RandomSpec(DEMO_PRESET, 0))
        async for progress in create_model(store, req):
            if progress.get("status"):
                click.echo(progress["status"])

    asyncio.run(create())
    click.echo(f"{store.resolve(DEMO_MODEL).name} is ready in {settings.models_dir}")


if __name__ == "__main__":
    main()
