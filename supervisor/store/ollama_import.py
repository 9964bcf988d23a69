"""`mlxr import --from-ollama`: models of an existing Ollama store used without copying them.

Ollama's store has our layout (manifests/<host>/<namespace>/<model>/<tag>, blobs/sha256-<hex>),
so importing a model is: link each of its blobs into our blobs, then write its manifest bytes
unchanged under the same name. GGUF weights are converted to MLX on first use.

Invariants:
- Ollama's files are only read: blobs are hard-linked (a symbolic link across file systems),
  never copied, moved or written; a blob's digest is checked before it is linked.
- A manifest is written only after every blob it names is ours (store.write_manifest checks).
- A model file is linked only once its header passes the checks create makes (a GGUF header
  bounded by its file, safetensors headers, config.json): a hostile one is a 400 naming it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from mlxr.shared.errors import InvalidRequest, ModelNotFound
from mlxr.shared.model_checks import check_model_files

from .gguf.header import read_gguf
from .manifest import MEDIA_MODEL, Layer, Manifest, ManifestError
from .names import ModelName, name_from_manifest_path, parse_name
from .store import Store


@dataclass(slots=True)
class Imported:
    name: str
    linked: dict[str, int] = field(default_factory=dict)  # "hardlink"/"symlink"/"present" -> n
    size: int = 0


def ollama_models_dir(environ: dict[str, str] | None = None) -> Path:
    """Where Ollama keeps its models: $OLLAMA_MODELS, else ~/.ollama/models."""
    env = os.environ if environ is None else environ
    return Path(env.get("OLLAMA_MODELS") or Path.home() / ".ollama" / "models").expanduser()


def list_models(root: Path) -> list[tuple[ModelName, Path]]:
    """The models of an Ollama store (name, manifest file), sorted by name."""
    manifests = root / "manifests"
    if not manifests.is_dir():
        raise InvalidRequest(f"{root} is not an Ollama model store (no manifests/ directory)")
    found = []
    for path in manifests.glob("*/*/*/*"):
        if not path.is_file():
            continue
        name = name_from_manifest_path(PurePosixPath(path.relative_to(manifests).as_posix()))
        if name is not None:
            found.append((name, path))
    return sorted(found, key=lambda x: x[0].display)


def import_model(store: Store, root: Path, name: ModelName, manifest_file: Path) -> Imported:
    data = manifest_file.read_bytes()
    try:
        m = Manifest.from_bytes(data)
    except ManifestError as exc:
        raise InvalidRequest(f"Ollama model {name.display}: {exc}") from None
    result = Imported(name.display)
    for layer in m.all_layers():  # every file checked before any is linked
        src = root / "blobs" / f"sha256-{layer.hex}"
        if not src.is_file():
            raise InvalidRequest(f"Ollama model {name.display}: blob {layer.digest} is "
                                 f"missing from {root / 'blobs'}")
        _check_layer(name, layer, src)
    with store.pinned(m.hex_digests()):
        for layer in m.all_layers():
            src = root / "blobs" / f"sha256-{layer.hex}"
            how = store.blobs.link(src, layer.hex)
            result.linked[how] = result.linked.get(how, 0) + 1
            result.size += layer.size
        store.write_manifest(name, data)
    return result


def _check_layer(name: ModelName, layer: Layer, path: Path) -> None:
    """A model file's header, before it becomes ours: a GGUF header bounded by its file, a
    safetensors header and a config.json as create checks them."""
    try:
        if layer.media_type == MEDIA_MODEL:
            read_gguf(path, skip_arrays=True)
        elif layer.name and (layer.name.endswith(".safetensors") or layer.name == "config.json"):
            check_model_files({layer.name: path})
    except InvalidRequest as exc:
        raise type(exc)(f"Ollama model {name.display}: {exc.message}") from None


def import_models(store: Store, root: Path, wanted: str | None = None) -> list[Imported]:
    """Import one model (`wanted`, an Ollama name) or all of them."""
    models = list_models(root)
    if wanted is not None:
        key = parse_name(wanted).key
        models = [(n, p) for n, p in models if n.key == key]
        if not models:
            raise ModelNotFound(f'model "{wanted}" not found in the Ollama store {root}')
    return [import_model(store, root, n, p) for n, p in models]
