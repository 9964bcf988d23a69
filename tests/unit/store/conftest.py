"""An Ollama store, hand-written byte for byte in Ollama's format: a GGUF model layer,
template, two licenses, params and the config blob."""

from __future__ import annotations

import hashlib
import json

import pytest

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


