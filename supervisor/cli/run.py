"""`mlxr run` as `ollama run` does it: a model missing here is pulled first, an embedding model
prints the embedding of the prompt as JSON, a model that can think thinks unless told not to,
and the flags take Ollama's values.

`--think` and `--truncate` take a value only in the `--flag=value` form (cobra's bool and
NoOptDefVal flags): a bare `--think` means true and the next word stays part of the prompt."""

from __future__ import annotations

import json
import sys
from typing import Any

import click

from mlxr.shared.config import parse_duration
from mlxr.shared.errors import InvalidRequest
from mlxr.supervisor.cli.client import ApiClient, CliError, ServerError

THINK_LEVELS = {"true": True, "false": False, "high": "high", "medium": "medium", "low": "low",
                "max": "max"}
_BARE_FLAGS = {"--think": "--think=true", "--truncate": "--truncate=true"}
# Go's strconv.ParseBool, which cobra's bool flags use.
_GO_BOOLS = {**dict.fromkeys(("1", "t", "T", "TRUE", "true", "True"), True),
             **dict.fromkeys(("0", "f", "F", "FALSE", "false", "False"), False)}


class RunCommand(click.Command):
    """Rewrites a bare `--think` / `--truncate` to `=true` before click parses the line."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        out: list[str] = []
        for i, arg in enumerate(args):
            if arg == "--":
                out.extend(args[i:])
                break
            out.append(_BARE_FLAGS.get(arg, arg))
        return super().parse_args(ctx, out)


def think_value(value: str | None) -> bool | str | None:
    if value is None:
        return None
    if value not in THINK_LEVELS:
        raise CliError(f'invalid value for --think: "{value}" (must be true, false, high, '
                       "medium, low, or max)")
    return THINK_LEVELS[value]


def truncate_value(value: str | None) -> bool | None:
    if value is None:
        return None
    if value not in _GO_BOOLS:
        raise CliError(f'invalid argument "{value}" for "--truncate" flag: parse error')
    return _GO_BOOLS[value]


def keep_alive_value(value: str | None) -> str | None:
    if value is not None:
        try:
            parse_duration(value)
        except InvalidRequest as err:
            raise CliError(err.message) from None
    return value


def response_format(value: str | None) -> Any:
    if not value:
        return None
    if value == "json":
        return "json"
    try:
        return json.loads(value)
    except ValueError:
        raise CliError(f'invalid format "{value}": use "json" or a JSON schema') from None


def pull_with_progress(client: ApiClient, name: str, insecure: bool) -> None:
    """`pulling manifest`, one bar per layer, `success`, on stderr (as `mlxr pull`)."""
    from mlxr.supervisor.cli.progress import Progress

    with Progress() as progress:
        for item in client.pull(name, insecure):
            progress.handle(item, "pulling", skip_empty=True)


def show_or_pull(client: ApiClient, name: str, insecure: bool) -> dict[str, Any]:
    """The model's /api/show reply, pulling the model first when the server lacks it."""
    try:
        return client.show(name)
    except ServerError as err:
        if err.status != 404:
            raise
    pull_with_progress(client, name, insecure)
    return client.show(name)


def print_embedding(client: ApiClient, name: str, prompt: str, keep_alive: str | None,
                    truncate: bool | None, dimensions: int) -> None:
    """An embedding model's answer: the prompt's embedding, one JSON array on stdout."""
    if not prompt:
        raise CliError(f'embedding models require input text. Usage: mlxr run {name} '
                       '"your text here"')
    body: dict[str, Any] = {"model": name, "input": prompt}
    if keep_alive is not None:
        body["keep_alive"] = keep_alive
    if truncate is not None:
        body["truncate"] = truncate
    if dimensions > 0:
        body["dimensions"] = dimensions
    embeddings = client.request("POST", "/api/embed", body).json().get("embeddings") or []
    if not embeddings:
        raise CliError("no embeddings returned")
    sys.stdout.write(json.dumps(embeddings[0], separators=(",", ":")) + "\n")


def infer_think(explicit: bool | str | None, capabilities: list[str]) -> bool | str | None:
    """Ollama's inferThinkingOption: a thinking model thinks unless --think says otherwise."""
    if explicit is not None:
        return explicit
    return True if "thinking" in capabilities else None
