"""`mlxr create`: a Modelfile and flags become Ollama's JSON create body; local model files
and an ADAPTER's files are uploaded as blobs first (only those the server lacks), as
`ollama create` does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mlxr.shared.errors import InvalidRequest
from mlxr.supervisor.cli.client import ApiClient, CliError, file_digest


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
                   cwd: Path | None = None
                   ) -> tuple[dict[str, Any], dict[str, Path], dict[str, Path]]:
    """Ollama's JSON create body from a Modelfile and flags, the local model files to upload
    (their digests go into `files` once uploaded) and the ADAPTER's files (into `adapters`).
    --from / --random replace FROM."""
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
    return body, files, _adapter_files(parsed.adapter, path.parent)


def _adapter_files(adapter: str | None, base: Path) -> dict[str, Path]:
    """An ADAPTER line's files (a directory, or a .safetensors file beside its config)."""
    from mlxr.supervisor.store.adapters import adapter_files

    if adapter is None:
        return {}
    path = Path(adapter).expanduser()
    try:
        return adapter_files(path if path.is_absolute() else base / path)
    except InvalidRequest as err:
        raise CliError(err.message) from None


def upload(client: ApiClient, progress: Any, path: Path, digest: str) -> None:
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


def send_create(client: ApiClient, progress: Any, body: dict[str, Any],
                files: dict[str, Path], adapters: dict[str, Path]) -> None:
    """Upload what the server lacks, then stream the create's progress."""
    progress.status("gathering model components")
    for key, found in (("files", files), ("adapters", adapters)):
        digests = {file_name: file_digest(path) for file_name, path in found.items()}
        for file_name, path in found.items():
            upload(client, progress, path, digests[file_name])
        if digests:
            body[key] = digests
    for item in client.create(body):
        progress.handle(item)
