"""A store written by Ollama itself (hand-written here byte for byte in Ollama's format: a GGUF
model layer, template, two licenses, params, config blob) reads back correctly."""

from __future__ import annotations

import hashlib

import pytest

from mlxr.shared.errors import MlxrError
from mlxr.supervisor.store.manifest import Manifest
from mlxr.supervisor.store.store import Store
from tests.unit.store.conftest import TEMPLATE


def test_reads_an_ollama_manifest_and_its_layers(ollama_store):
    root, manifest_bytes, total = ollama_store
    store = Store(root)
    rec = store.resolve("llama3.2")
    assert rec.name == "llama3.2:latest"
    assert rec.digest == hashlib.sha256(manifest_bytes).hexdigest()
    assert rec.size == total
    assert rec.config["model_format"] == "gguf" and rec.config["file_type"] == "Q4_K_M"
    assert rec.template == TEMPLATE
    assert rec.license == "LLAMA 3.2 COMMUNITY LICENSE AGREEMENT\nLlama 3.2 Acceptable Use Policy"
    assert rec.params == {"stop": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]}
    assert rec.system is None and rec.messages == []
    assert rec.capabilities == ["completion"]
    assert rec.model_info == {"general.architecture": "llama"}
    assert [r.name for r in store.list()] == ["llama3.2:latest"]
    assert Manifest.from_bytes(manifest_bytes).to_bytes() == manifest_bytes  # same encoding


def test_case_insensitive_lookup_and_gguf_runs_only_once_converted(ollama_store):
    store = Store(ollama_store[0])
    rec = store.resolve("Registry.Ollama.AI/Library/LLAMA3.2:Latest")
    with pytest.raises(MlxrError, match="has not been converted to MLX yet"):
        store.runner_dir(rec)


def test_copy_keeps_bytes_and_delete_collects_everything(ollama_store):
    root, manifest_bytes, _ = ollama_store
    store = Store(root)
    store.copy("llama3.2", "backup/llama:1")
    assert (root / "manifests/registry.ollama.ai/backup/llama/1").read_bytes() == manifest_bytes
    assert store.resolve("backup/llama:1").digest == store.resolve("llama3.2").digest
    store.delete("llama3.2")
    assert len(list((root / "blobs").iterdir())) == 6  # still named by the copy
    store.delete("backup/llama:1")
    assert list((root / "blobs").iterdir()) == []
    assert list((root / "manifests").iterdir()) == []  # empty directories pruned
