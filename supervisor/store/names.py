"""Model names in Ollama's form: `[host/][namespace/]model[:tag]`.

Defaults fill what is missing (host `registry.ollama.ai`, namespace `library`, tag `latest`).
`hf.co/org/repo[:tag]` is an ordinary three-part name whose host is Hugging Face. Names
compare case-insensitively: the manifest path is the lower-cased name, as in Ollama.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import PurePosixPath

from mlxr.shared.errors import InvalidRequest

DEFAULT_HOST = "registry.ollama.ai"
DEFAULT_NAMESPACE = "library"
DEFAULT_TAG = "latest"
HF_HOSTS = ("hf.co", "huggingface.co")
MAX_PART_LEN = 128

_PART_CHARS = {
    "host": re.compile(r"[A-Za-z0-9_.\-:]+"),
    "namespace": re.compile(r"[A-Za-z0-9_\-]+"),
    "model": re.compile(r"[A-Za-z0-9_.\-]+"),
    "tag": re.compile(r"[A-Za-z0-9_.\-]+"),
}


@dataclass(frozen=True, slots=True)
class ModelName:
    host: str
    namespace: str
    model: str
    tag: str

    @property
    def display(self) -> str:
        """The shortest form, as Ollama lists it: `demo:latest`, `user/demo:v1`,
        `example.com:5000/library/demo:latest`."""
        if self.host.lower() != DEFAULT_HOST:
            return self.full
        if self.namespace.lower() != DEFAULT_NAMESPACE:
            return f"{self.namespace}/{self.model}:{self.tag}"
        return f"{self.model}:{self.tag}"

    @property
    def full(self) -> str:
        return f"{self.host}/{self.namespace}/{self.model}:{self.tag}"

    @property
    def key(self) -> str:
        """Case-insensitive identity (what two names share when they name one model)."""
        return self.full.lower()

    @property
    def repository(self) -> str:
        """The repository path on a registry: `namespace/model`."""
        return f"{self.namespace}/{self.model}"

    @property
    def manifest_path(self) -> PurePosixPath:
        """Relative path of the manifest under `manifests/` (lower-cased, as Ollama writes it)."""
        return PurePosixPath(self.host.lower(), self.namespace.lower(), self.model.lower(),
                             self.tag.lower())

    @property
    def is_huggingface(self) -> bool:
        return self.host.lower() in HF_HOSTS


def _check_part(kind: str, value: str, text: str) -> None:
    if not value:
        raise InvalidRequest(f'invalid model name "{text}": empty {kind}')
    if len(value) > MAX_PART_LEN:
        raise InvalidRequest(
            f'invalid model name "{text}": {kind} is longer than {MAX_PART_LEN} characters')
    if ".." in value or value.startswith("."):
        raise InvalidRequest(f'invalid model name "{text}": {kind} "{value}" may not start '
                             'with "." or contain ".."')
    if not _PART_CHARS[kind].fullmatch(value):
        allowed = "letters, digits, '_', '-'" + ("" if kind == "namespace" else ", '.'") + \
            (", ':'" if kind == "host" else "")
        raise InvalidRequest(f'invalid model name "{text}": {kind} "{value}" may only contain '
                             f"{allowed}")


def parse_name(text: str) -> ModelName:
    """Parse and validate a model name; errors are `InvalidRequest` (HTTP 400)."""
    if not isinstance(text, str) or not text.strip():
        raise InvalidRequest("model name is required")
    raw = text
    for scheme in ("http://", "https://"):
        if text.startswith(scheme):
            text = text[len(scheme):]
            break
    if "@" in text or "+" in text:
        raise InvalidRequest(f'invalid model name "{raw}": digests and builds ("@", "+") are '
                             "not supported")
    if "\\" in text or "\x00" in text:
        raise InvalidRequest(f'invalid model name "{raw}": path separators are not allowed')
    path, tag = text, DEFAULT_TAG
    slash, colon = text.rfind("/"), text.rfind(":")
    if colon > slash:
        path, tag = text[:colon], text[colon + 1:]
        if not tag:
            raise InvalidRequest(f'invalid model name "{raw}": empty tag')
    segments = path.split("/")
    if len(segments) > 3:
        raise InvalidRequest(f'invalid model name "{raw}": expected [host/][namespace/]model[:tag]')
    host, namespace = DEFAULT_HOST, DEFAULT_NAMESPACE
    if len(segments) == 3:
        host, namespace, model = segments
    elif len(segments) == 2:
        namespace, model = segments
    else:
        (model,) = segments
    for kind, value in (("host", host), ("namespace", namespace), ("model", model), ("tag", tag)):
        _check_part(kind, value, raw)
    return ModelName(host, namespace, model, tag)


def name_from_manifest_path(rel: PurePosixPath) -> ModelName | None:
    """The name a manifest file stands for, or None for a path that is not one."""
    if len(rel.parts) != 4:
        return None
    host, namespace, model, tag = rel.parts
    try:
        for kind, value in (("host", host), ("namespace", namespace), ("model", model),
                            ("tag", tag)):
            _check_part(kind, value, str(rel))
    except InvalidRequest:
        return None
    return ModelName(host, namespace, model, tag)
