"""`mlxr import --from-ollama`: an Ollama store's models become ours by linking, never copying
or changing Ollama's files."""

from __future__ import annotations

import hashlib
import os

import pytest

from mlxr.shared.errors import InvalidRequest, ModelNotFound
from mlxr.supervisor.store import conversions
from mlxr.supervisor.store.names import parse_name
from mlxr.supervisor.store.ollama_import import import_models, list_models, ollama_models_dir
from mlxr.supervisor.store.store import Store


def _snapshot(root):
    return {p: (p.stat().st_ino, p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
            for p in root.rglob("*") if p.is_file()}


def test_import_links_blobs_and_keeps_the_manifest_bytes(ollama_store, tmp_path):
    root, manifest_bytes, total = ollama_store
    before = _snapshot(root)
    store = Store(tmp_path / "mlxr")
    [done] = import_models(store, root)
    assert done.name == "llama3.2:latest" and done.size == total
    assert done.linked == {"hardlink": 6}
    rec = store.resolve("llama3.2")
    assert store.manifest_file(parse_name("llama3.2")).read_bytes() == manifest_bytes
    for layer in store.manifest_of(rec).all_layers():
        ours, theirs = store.blobs.path(layer.hex), root / "blobs" / f"sha256-{layer.hex}"
        assert os.path.samefile(ours, theirs)  # the same file: nothing was copied
    assert _snapshot(root) == before  # Ollama's files unchanged
    store.delete("llama3.2")  # removing ours leaves theirs
    assert _snapshot(root) == before
    assert import_models(store, root, "llama3.2:latest")[0].linked == {"hardlink": 6}


def test_import_checks_digests_and_writes_no_manifest_on_failure(ollama_store, tmp_path):
    root, _, _ = ollama_store
    blob = next(p for p in (root / "blobs").iterdir() if p.read_bytes().startswith(b"LLAMA 3.2"))
    blob.write_bytes(b"tampered")
    store = Store(tmp_path / "mlxr")
    with pytest.raises(InvalidRequest, match="does not hold sha256:"):
        import_models(store, root)
    assert store.list() == []


def test_import_errors(ollama_store, tmp_path):
    root, _, _ = ollama_store
    store = Store(tmp_path / "mlxr")
    with pytest.raises(ModelNotFound, match='"qwen" not found in the Ollama store'):
        import_models(store, root, "qwen")
    with pytest.raises(InvalidRequest, match="not an Ollama model store"):
        list_models(tmp_path / "nowhere")
    assert ollama_models_dir({"OLLAMA_MODELS": str(root)}) == root
    assert ollama_models_dir({}).parts[-2:] == (".ollama", "models")


def test_garbage_collection_removes_derived_directories(ollama_store, tmp_path):
    root, _, _ = ollama_store
    store = Store(tmp_path / "mlxr")
    import_models(store, root)
    gguf = store.manifest_of(store.resolve("llama3.2")).gguf()
    derived = conversions.derived_path(store.root, gguf.hex)
    derived.mkdir(parents=True)
    (derived / "config.json").write_text("{}")
    old = store.root / "derived" / "gguf-v0" / gguf.hex
    old.mkdir(parents=True)
    assert store.runner_dir(store.resolve("llama3.2")) == derived
    store.prune()
    assert derived.is_dir() and not old.parent.exists()  # an older converter's output goes
    store.delete("llama3.2")
    assert not derived.exists()
