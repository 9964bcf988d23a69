"""`mlxr import --from-ollama` of a store holding a hostile model file: refused with
InvalidModelFile naming the model, before anything is linked or a manifest written."""

from __future__ import annotations

import hashlib
import json
import struct

import pytest

from mlxr.shared.errors import InvalidModelFile
from mlxr.supervisor.store.ollama_import import import_models
from mlxr.supervisor.store.store import Store

MANIFEST = ("manifests", "registry.ollama.ai", "library", "llama3.2", "latest")


def replace_layer(root, media_suffix: str, data: bytes, name: str | None = None) -> None:
    """Give the Ollama model a layer with `data` under its true digest (a hostile store, not a
    damaged one: the digests all check out)."""
    hex_digest = hashlib.sha256(data).hexdigest()
    (root / "blobs" / f"sha256-{hex_digest}").write_bytes(data)
    path = root.joinpath(*MANIFEST)
    manifest = json.loads(path.read_bytes())
    layers = [x for x in manifest["layers"] if not x["mediaType"].endswith(media_suffix)]
    layer = {"mediaType": "application/vnd.ollama.image" + media_suffix,
             "digest": f"sha256:{hex_digest}", "size": len(data)}
    if name:
        layer["name"] = name
    manifest["layers"] = [layer, *layers]
    path.write_text(json.dumps(manifest))


HOSTILE = [
    (".model", b"GGUF" + struct.pack("<IQQ", 3, 0, 1 << 60), None,
     "claims 1152921504606846976 metadata entries"),
    (".model", b"GGUF" + struct.pack("<IQQ", 3, 1, 0) + struct.pack("<Q", 1) + b"t" +
     struct.pack("<I", 2) + struct.pack("<QQ", 1 << 40, 1 << 40) + struct.pack("<IQ", 0, 0),
     None, "tensor 't' has a dimension over 2147483647"),
    (".tensor", struct.pack("<Q", 1 << 50) + b"{}", "model.safetensors",
     "model.safetensors: safetensors header length 1125899906842624 is larger than the file"),
    (".json", b'{"model_type": "llama", "num_hidden_layers": 1000000}', "config.json",
     "config.json: num_hidden_layers 1000000 is out of range"),
]


@pytest.mark.parametrize("media, data, name, message", HOSTILE,
                         ids=["gguf-counts", "gguf-dims", "safetensors", "config"])
def test_a_hostile_model_file_is_not_imported(ollama_store, tmp_path, media, data, name,
                                              message):
    root, _, _ = ollama_store
    replace_layer(root, media, data, name)
    store = Store(tmp_path / "mlxr")
    with pytest.raises(InvalidModelFile, match=f"^Ollama model llama3.2:latest: .*{message}"):
        import_models(store, root)
    assert store.list() == []
    assert not any(p.is_file() for p in (tmp_path / "mlxr").rglob("sha256-*"))
