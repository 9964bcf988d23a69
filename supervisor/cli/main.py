"""`mlxr`: the command line, shaped like `ollama`'s. `serve` runs the server; `doctor`,
`setup-demo` and `import` act on this machine (cli/local.py); the other commands are clients
of the server's HTTP API at MLXR_HOST (else OLLAMA_HOST, else 127.0.0.1:11434). A client command that fails prints
`Error: <message>` on stderr and exits 1 (the `_Group` below renders every `CliError`)."""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from typing import Any

import click

from mlxr.shared.config import parse_socket
from mlxr.supervisor.cli import local
from mlxr.supervisor.cli.client import ApiClient, CliError, ServerError
from mlxr.supervisor.cli.local import settings_from
from mlxr.supervisor.cli.run import RunCommand, pull_with_progress
from mlxr.supervisor.cli.format import models_table, running_table, show_info
from mlxr.supervisor.version import version


def setup_logging(debug: bool) -> None:
    logging.basicConfig(level=logging.DEBUG if debug else logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # One line per request comes from our access log; httpx's own lines would double it.
    logging.getLogger("httpx").setLevel(logging.WARNING)


class _Group(click.Group):
    """Prints a client error as Ollama does (`Error: ...`, exit status 1)."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except CliError as err:
            click.echo(f"Error: {err.message}", err=True)
            ctx.exit(1)


def _print_version(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    """Ollama's `-v`: the server's version, and the client's when it differs (or when no
    server answers)."""
    if not value or ctx.resilient_parsing:
        return
    server, api = None, None
    try:
        with make_client() as client:
            reply = client.request("GET", "/api/version").json()
        server, api = reply.get("mlxr_version"), reply.get("version")
    except CliError:
        click.echo("Warning: could not connect to a running mlxr instance")
    if server:
        click.echo(f"mlxr version is {server}" + (f" (Ollama API {api})" if api else ""))
    if server != version():
        click.echo(f"Warning: client version is {version()}")
    ctx.exit(0)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--version", is_flag=True, expose_value=False, is_eager=True,
              callback=_print_version, help="Show version information")
def main() -> None:
    """An Ollama-compatible LLM server on MLX."""


for command in (local.doctor, local.setup_demo, local.import_, local.config):
    main.add_command(command)


def make_client() -> ApiClient:
    """A client for the server at MLXR_HOST / OLLAMA_HOST (a wildcard address means here),
    with MLXR_API_KEY as its bearer token when set."""
    settings = settings_from()
    local = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(settings.host)
    return ApiClient(dataclasses.replace(settings, host=local or settings.host).base_url,
                     api_key=settings.api_key, socket_path=settings.socket_path)


@main.command()
@click.option("--host", help="address to listen on, host:port or unix:///path/to/socket "
              "(default: MLXR_HOST or OLLAMA_HOST, else 127.0.0.1:11434)")
@click.option("--models", help="model store directory (default: MLXR_MODELS)")
@click.option("--max-loaded-models", type=int, help="runners kept loaded at once")
@click.option("--num-parallel", type=int, help="requests a runner decodes together")
@click.option("--context-length", type=int, help="default context length (num_ctx)")
def serve(host, models, max_loaded_models, num_parallel, context_length) -> None:
    """Start the server."""
    from mlxr.supervisor import app, server_files

    try:
        socket_path = parse_socket(host) if host else None
        settings = settings_from(None if socket_path else host, models, socket_path=socket_path,
                                 max_loaded_models=max_loaded_models, num_parallel=num_parallel,
                                 context_length=context_length)
        if host and not socket_path:  # the flag's TCP address wins over a socket in MLXR_HOST
            settings = dataclasses.replace(settings, socket_path=None)
        setup_logging(settings.debug)
        pid_file = server_files.claim_pid_file(settings)
        try:
            server_files.add_log_file(settings)
            app.serve(settings)
        finally:
            server_files.release_pid_file(pid_file)
    except (OSError, ValueError) as exc:  # bad settings, or the listener could not be made
        raise click.ClickException(str(exc)) from None


# -- client commands -------------------------------------------------------------------------


def _stdin_prompt() -> str | None:
    """What is piped to stdin (None when stdin is a terminal)."""
    return None if sys.stdin.isatty() else sys.stdin.read()


@main.command(cls=RunCommand)
@click.argument("model")
@click.argument("prompt", nargs=-1)
@click.option("--keepalive", metavar="DURATION", help="Duration to keep a model loaded (e.g. 5m)")
@click.option("--verbose", is_flag=True, help="Show timings for response")
@click.option("--insecure", is_flag=True, help="Use an insecure registry")
@click.option("--nowordwrap", is_flag=True,
              help="Don't wrap words to the next line automatically")
@click.option("--format", "format_", metavar="FORMAT", help="Response format (e.g. json)")
@click.option("--think", metavar="[=LEVEL]", help="Enable thinking mode: true/false or "
              "high/medium/low for supported models (--think alone: true)")
@click.option("--hidethinking", is_flag=True, help="Hide thinking output (if provided)")
@click.option("--truncate", metavar="[=BOOL]", help="For embedding models: truncate inputs "
              "exceeding context length (default: true). Set --truncate=false to error instead")
@click.option("--dimensions", type=int, default=0, help="Truncate output embeddings to "
              "specified dimension (embedding models only)")
def run(model, prompt, keepalive, verbose, insecure, nowordwrap, format_, think, hidethinking,
        truncate, dimensions) -> None:
    """Run a model: answer PROMPT (or stdin) once, or chat when neither is given. A model
    that is not here is pulled first."""
    from mlxr.supervisor.cli.chat import RunOptions, interactive, run_once
    from mlxr.supervisor.cli.run import (infer_think, keep_alive_value, print_embedding,
                                         response_format, show_or_pull, think_value,
                                         truncate_value)

    explicit_think, truncate = think_value(think), truncate_value(truncate)
    keepalive = keep_alive_value(keepalive)
    fmt = response_format(format_)
    parts = list(prompt)
    piped = _stdin_prompt()
    if piped:
        parts.insert(0, piped)
    chat = piped is None and not parts and sys.stdout.isatty()
    with make_client() as client:
        info = show_or_pull(client, model, insecure)
        capabilities = info.get("capabilities") or []
        if "embedding" in capabilities:
            print_embedding(client, model, " ".join(parts), keepalive, truncate, dimensions)
            return
        opts = RunOptions(model, prompt=" ".join(parts), format=fmt, keep_alive=keepalive,
                          think=infer_think(explicit_think, capabilities),
                          hide_thinking=hidethinking, verbose=verbose,
                          word_wrap=not nowordwrap, vision="vision" in capabilities)
        if chat:
            interactive(client, opts, info)
        else:
            run_once(client, opts)


@main.command("list")
@click.argument("prefix", default="")
def list_models(prefix) -> None:
    """List models (alias: ls)."""
    with make_client() as client:
        click.echo(models_table(client.tags(), prefix), nl=False)


main.add_command(click.Command("ls", callback=list_models.callback, params=list_models.params,
                               help=list_models.help, hidden=True))


@main.command()
@click.argument("prefix", default="")
def ps(prefix) -> None:
    """List running models."""
    with make_client() as client:
        click.echo(running_table(client.ps(), prefix), nl=False)


SHOW_FIELDS = ("license", "modelfile", "parameters", "system", "template")


@main.command()
@click.argument("model")
@click.option("--license", is_flag=True, help="Show license of a model")
@click.option("--modelfile", is_flag=True, help="Show Modelfile of a model")
@click.option("--parameters", is_flag=True, help="Show parameters of a model")
@click.option("--system", is_flag=True, help="Show system message of a model")
@click.option("--template", is_flag=True, help="Show template of a model")
@click.option("-v", "--verbose", is_flag=True, help="Show detailed model information")
def show(model, verbose, **flags) -> None:
    """Show information for a model."""
    chosen = [name for name in SHOW_FIELDS if flags[name]]
    if len(chosen) > 1:
        raise CliError("only one of '--license', '--modelfile', '--parameters', '--system', "
                       "or '--template' can be specified")
    with make_client() as client:
        resp = client.show(model, verbose=verbose)
    if not chosen:
        click.echo(show_info(resp, verbose), nl=False)
    elif chosen[0] in ("system", "template"):
        click.echo(resp.get(chosen[0], ""), nl=False)
    else:
        click.echo(resp.get(chosen[0], ""))


@main.command()
@click.argument("name")
@click.option("--insecure", is_flag=True, help="Use an insecure registry")
def pull(name, insecure) -> None:
    """Pull a model from a registry."""
    with make_client() as client:
        pull_with_progress(client, name, insecure)


@main.command()
@click.argument("name")
@click.option("--insecure", is_flag=True, help="Use an insecure registry")
def push(name, insecure) -> None:
    """Push a model to a registry."""
    from mlxr.supervisor.cli.progress import Progress

    with make_client() as client, Progress() as progress:
        for item in client.push(name, insecure):
            progress.handle(item, "pushing")
    click.echo(f"\nYou can find your model at:\n\n\t{name}\n")


@main.command()
@click.argument("name")
@click.option("-f", "--file", "modelfile", metavar="PATH",
              help='Name of the Modelfile (default "Modelfile")')
@click.option("-q", "--quantize", metavar="LEVEL",
              help="Quantize model to this level (e.g. q4_K_M, q8_0, int4; MLX 4/5/6/8-bit)")
@click.option("--from", "from_", metavar="DIR|FILE.gguf|MODEL",
              help="Build on a local model directory, a GGUF file or a model (instead of FROM)")
@click.option("--random", "preset", metavar="PRESET|ARCH",
              help="Build a random-weight test model: a size (tiny, small, medium, "
                   "qwen3-0.6b: qwen3), an architecture (llama, mistral, qwen2, qwen3, "
                   "gemma2, gemma3, phi3, granite, qwen3_moe, gpt_oss, gemma4, gemma4-moe) or "
                   "a vision model (qwen2.5-vl, qwen2-vl, gemma3-vision)")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed for --random")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default="float32",
              show_default=True, help="Weight type for --random")
def create(name, modelfile, quantize, from_, preset, seed, dtype) -> None:
    """Create a model from a Modelfile, a directory, a GGUF file or a random preset."""
    from mlxr.supervisor.cli.create import create_request, send_create
    from mlxr.supervisor.cli.progress import Progress

    body, files, adapters = create_request(name, modelfile, from_, preset, seed, quantize)
    if preset is not None and dtype != "float32":
        body["random"]["dtype"] = dtype
    with make_client() as client, Progress() as progress:
        send_create(client, progress, body, files, adapters)


@main.command()
@click.argument("source")
@click.argument("destination")
def cp(source, destination) -> None:
    """Copy a model."""
    with make_client() as client:
        client.copy(source, destination)
    click.echo(f"copied '{source}' to '{destination}'")


def _unload(client: ApiClient, model: str) -> None:
    from mlxr.supervisor.cli.chat import RunOptions, load_model

    load_model(client, RunOptions(model, keep_alive=0))


@main.command()
@click.argument("names", nargs=-1, required=True)
def rm(names) -> None:
    """Remove models (unloading them first)."""
    with make_client() as client:
        for name in names:
            try:
                _unload(client, name)
            except ServerError as err:
                if err.status != 404:
                    raise CliError(f'unable to stop existing running model "{name}": '
                                   f"{err.message}") from None
            client.delete(name)
            click.echo(f"deleted '{name}'")


@main.command()
@click.argument("model")
def stop(model) -> None:
    """Stop (unload) a running model."""
    with make_client() as client:
        try:
            _unload(client, model)
        except ServerError as err:
            if err.status == 404:
                raise CliError(f'couldn\'t find model "{model}" to stop') from None
            raise


@main.group()
def service() -> None:
    """Run `mlxr serve` as your login service (a systemd user unit, or a launchd agent on
    macOS), restarted when it crashes."""


@service.command("install")
@click.option("--no-start", is_flag=True, help="Write the service file; do not start it")
def service_install(no_start) -> None:
    """Install (or update) the service with this shell's MLXR_*/OLLAMA_* settings."""
    from mlxr.supervisor.cli import service as svc

    path = svc.install(svc.Platform.here(), os.environ, start=not no_start)
    click.echo(f"installed {path}")


@service.command("uninstall")
def service_uninstall() -> None:
    """Stop and remove the service."""
    from mlxr.supervisor.cli import service as svc

    platform = svc.Platform.here()
    click.echo(f"removed {platform.path}" if svc.uninstall(platform) else
               "no mlxr service is installed")


@service.command("status")
def service_status() -> None:
    """The service manager's view of the service."""
    from mlxr.supervisor.cli import service as svc

    platform = svc.Platform.here()
    if not platform.path.exists():
        raise click.ClickException("no mlxr service is installed (mlxr service install)")
    sys.exit(svc.run_manager(platform, "status"))


@service.command("logs")
def service_logs() -> None:
    """The service's recent log lines."""
    from mlxr.supervisor.cli import service as svc

    sys.exit(svc.run_manager(svc.Platform.here(), "logs"))


@main.command(add_help_option=False,
              context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.pass_context
def bench(ctx) -> None:
    """Benchmark the runner against peers (options: mlxr bench --help)."""
    from mlxr.supervisor.bench.cli import main as bench_main

    bench_main(ctx.args)

if __name__ == "__main__":
    main()
