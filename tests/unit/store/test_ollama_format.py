"""A store written by Ollama itself (hand-written here byte for byte in Ollama's format: a GGUF
model layer, template, two licenses, params, config blob) reads back correctly."""

from __future__ import annotations

import hashlib
import json

import pytest

from mlxr.shared.errors import InvalidRequest
from mlxr.supervisor.store.manifest import Manifest
from mlxr.supervisor.store.store import Store

TEMPLATE = ("<|start_header_id|>system<|end_header_id|>\n\n{{ .System }}<|eot_id|>"
            "{{ range .Messages }}{{ .Content }}{{ end }}")
PARAMS = b'{"stop":["<|start_header_id|>","<|end_header_id|>","<|eot_id|>"]}\n'


def _blob(root, data: bytes) -> tuple[str, int]:
    digest = hashlib.sha256(data).hexdigest()
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    (root / "blobs" / f"sha256-{digest}").write_bytes(data)
    return f"sha256:{digest}", len(data)


@pytest.fixture
def ollama_store(tmp_path):
    root = tmp_path / "models"
    gguf = _blob(root, b"GGUF\x03\x00\x00\x00" + bytes(1000))
    template = _blob(root, TEMPLATE.encode())
    lic1 = _blob(root, b"LLAMA 3.2 COMMUNITY LICENSE AGREEMENT")
    lic2 = _blob(root, b"Llama 3.2 Acceptable Use Policy")
    params = _blob(root, PARAMS)
    config = _blob(root, json.dumps({
        "model_format": "gguf", "model_family": "llama", "model_families": ["llama"],
        "model_type": "3.2B", "file_type": "Q4_K_M", "architecture": "amd64", "os": "linux",
        "rootfs": {"type": "layers", "diff_ids": [gguf[0], template[0], lic1[0], lic2[0],
                                                  params[0]]}}).encode() + b"\n")
    layers = [("application/vnd.ollama.image.model", gguf),
              ("application/vnd.ollama.image.template", template),
              ("application/vnd.ollama.image.license", lic1),
              ("application/vnd.ollama.image.license", lic2),
              ("application/vnd.ollama.image.params", params)]
    text = ('{"schemaVersion":2,"mediaType":"application/vnd.docker.distribution.manifest.v2+json",'
            f'"config":{{"mediaType":"application/vnd.docker.container.image.v1+json",'
            f'"digest":"{config[0]}","size":{config[1]}}},"layers":['
            + ",".join(f'{{"mediaType":"{m}","digest":"{d}","size":{s}}}' for m, (d, s) in layers)
            + "]}\n")
    path = root / "manifests" / "registry.ollama.ai" / "library" / "llama3.2" / "latest"
    path.parent.mkdir(parents=True)
    path.write_bytes(text.encode())
    return root, text.encode(), sum(s for _, (_, s) in layers) + config[1]


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


def test_case_insensitive_lookup_and_gguf_is_not_runnable(ollama_store):
    store = Store(ollama_store[0])
    rec = store.resolve("Registry.Ollama.AI/Library/LLAMA3.2:Latest")
    with pytest.raises(InvalidRequest, match="no safetensors weights; its format is gguf"):
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
