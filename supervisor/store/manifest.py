"""Ollama's manifest: a Docker image manifest v2 whose layers are model files.

The bytes are what a model's digest is taken of, so they are serialized the way Ollama's Go
encoder writes them (compact JSON, fields in struct order, a trailing newline) and a manifest
read from disk or a registry is kept byte for byte.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

MEDIA_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
MEDIA_CONFIG = "application/vnd.docker.container.image.v1+json"
MEDIA_TENSOR = "application/vnd.ollama.image.tensor"
MEDIA_JSON = "application/vnd.ollama.image.json"
MEDIA_MODEL = "application/vnd.ollama.image.model"  # a GGUF file
MEDIA_TEMPLATE = "application/vnd.ollama.image.template"
MEDIA_SYSTEM = "application/vnd.ollama.image.system"
MEDIA_PARAMS = "application/vnd.ollama.image.params"
MEDIA_LICENSE = "application/vnd.ollama.image.license"
MEDIA_MESSAGES = "application/vnd.ollama.image.messages"
# A LoRA adapter applied on top of the model's weights at load. Ollama's adapter layer is one
# GGUF file; ours are two named files in mlx-lm's adapter format (adapters.safetensors and
# adapter_config.json), linked into the runner directory (store.py) and applied by the runner.
MEDIA_ADAPTER = "application/vnd.ollama.image.adapter"
# Layers that describe the model rather than hold its files; `create` replaces them.
METADATA_MEDIA = (MEDIA_TEMPLATE, MEDIA_SYSTEM, MEDIA_PARAMS, MEDIA_LICENSE, MEDIA_MESSAGES)


class ManifestError(ValueError):
    """A manifest that is not one we can read."""


@dataclass(slots=True)
class Layer:
    media_type: str
    digest: str  # "sha256:<hex>"
    size: int
    name: str | None = None  # the file name, for tensor and json layers
    from_: str | None = None

    @property
    def hex(self) -> str:
        return self.digest.split(":", 1)[1]

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"mediaType": self.media_type, "digest": self.digest, "size": self.size}
        if self.from_:
            d["from"] = self.from_
        if self.name:
            d["name"] = self.name
        return d

    @classmethod
    def from_json(cls, d: Any) -> "Layer":
        if not isinstance(d, dict):
            raise ManifestError("layer is not an object")
        digest, size, media = d.get("digest"), d.get("size"), d.get("mediaType")
        if not (isinstance(digest, str) and digest.startswith("sha256:") and len(digest) == 71
                and all(c in "0123456789abcdef" for c in digest[7:])):
            raise ManifestError(f"bad layer digest {digest!r}")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ManifestError(f"bad layer size {size!r}")
        if not isinstance(media, str):
            raise ManifestError("layer without mediaType")
        name = d.get("name")
        return cls(media, digest, size, name if isinstance(name, str) and name else None,
                   d.get("from") or None)


@dataclass(slots=True)
class Manifest:
    config: Layer
    layers: list[Layer] = field(default_factory=list)
    schema_version: int = 2
    media_type: str = MEDIA_MANIFEST

    def to_bytes(self) -> bytes:
        body = {"schemaVersion": self.schema_version, "mediaType": self.media_type,
                "config": self.config.to_json(), "layers": [x.to_json() for x in self.layers]}
        return json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"

    @classmethod
    def from_bytes(cls, data: bytes) -> "Manifest":
        try:
            d = json.loads(data)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ManifestError(f"manifest is not JSON: {exc}") from None
        except RecursionError:  # JSON nested deeper than the parser goes
            raise ManifestError("manifest is not JSON: nested too deeply") from None
        if not isinstance(d, dict) or d.get("schemaVersion") != 2:
            raise ManifestError("not a schema version 2 manifest")
        layers = d.get("layers") or []
        if not isinstance(layers, list):
            raise ManifestError("layers is not a list")
        return cls(Layer.from_json(d.get("config")), [Layer.from_json(x) for x in layers],
                   2, d.get("mediaType") or MEDIA_MANIFEST)

    def all_layers(self) -> list[Layer]:
        return [self.config, *self.layers]

    def hex_digests(self) -> set[str]:
        return {x.hex for x in self.all_layers()}

    @property
    def total_size(self) -> int:
        return sum(x.size for x in self.all_layers())

    def first(self, media_type: str) -> Layer | None:
        return next((x for x in self.layers if x.media_type == media_type), None)

    def gguf(self) -> Layer | None:
        """The GGUF weights layer of a model in Ollama's own format, if any."""
        return self.first(MEDIA_MODEL)

    def adapters(self) -> list[Layer]:
        """The adapter layers (named files of one LoRA adapter), if any."""
        return [x for x in self.layers if x.media_type == MEDIA_ADAPTER]

    def files(self) -> list[Layer]:
        """The layers that are model files (tensor and json layers with a name)."""
        return [x for x in self.layers if x.name and x.media_type in (MEDIA_TENSOR, MEDIA_JSON)]
