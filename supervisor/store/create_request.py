"""The body of `/api/create` (Ollama's CreateRequest, plus `random`): parsed and checked
before anything is written, so bad input is a 400. A `modelfile` (the older form) is parsed
and merged under the body's own fields."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mlxr.shared.errors import InvalidRequest

from .modelfile import normalize_parameters, parse_modelfile
from .random_model import ARCH_NAMES, DTYPES, PRESETS, VARIANT_PRESETS, VISION_ARCHS
from .sources import check_file_name


@dataclass(slots=True)
class RandomSpec:
    preset: str = "tiny"  # a size preset (tiny, small, medium) or an architecture (llama, ...)
    seed: int = 0
    dtype: str = "float32"


@dataclass(slots=True)
class CreateRequest:
    model: str
    from_: str | None = None
    files: dict[str, str] = field(default_factory=dict)
    template: str | None = None
    system: str | None = None
    license: list[str] | None = None
    parameters: dict[str, Any] | None = None
    messages: list[dict[str, Any]] | None = None
    quantize: str | None = None
    random: RandomSpec | None = None
    adapters: dict[str, str] = field(default_factory=dict)  # file name -> digest, as files
    adapter_path: str | None = None  # ADAPTER of a `modelfile`: a path on this machine

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> "CreateRequest":
        """Ollama's /api/create body (plus `random`); `modelfile` (the older form) is parsed."""
        def text(key: str) -> str | None:
            v = body.get(key)
            if v is not None and not isinstance(v, str):
                raise InvalidRequest(f"{key} must be a string")
            return v or None

        model = text("model") or text("name")
        if not model:
            raise InvalidRequest("model is required")
        req = cls(model=model, from_=text("from"), template=text("template"),
                  system=text("system"), quantize=text("quantize") or text("quantization"))
        for key in ("files", "adapters"):
            files = body.get(key) or {}
            if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()):
                raise InvalidRequest(f'{key} must be an object of file name -> "sha256:<hex>"')
            setattr(req, key, {check_file_name(k): v for k, v in files.items()})
        lic = body.get("license")
        if lic is not None:
            lic = [lic] if isinstance(lic, str) else lic
            if not isinstance(lic, list) or not all(isinstance(x, str) for x in lic):
                raise InvalidRequest("license must be a string or a list of strings")
            req.license = lic
        if body.get("parameters") is not None:
            req.parameters = normalize_parameters(body["parameters"])
        if body.get("messages") is not None:
            req.messages = _check_messages(body["messages"])
        if body.get("random") is not None:
            req.random = _random_spec(body["random"])
        if body.get("modelfile"):
            _merge_modelfile(req, text("modelfile") or "")
        return req


def _check_messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str)
            and isinstance(m.get("content", ""), str) for m in messages):
        raise InvalidRequest("messages must be a list of {role, content} objects")
    return [{"role": m["role"], "content": m.get("content", "")} for m in messages]


def _random_spec(value: Any) -> RandomSpec:
    if value is True:
        return RandomSpec()
    if not isinstance(value, dict):
        raise InvalidRequest('random must be an object like {"preset": "tiny", "seed": 0}')
    preset, seed = value.get("preset", "tiny"), value.get("seed", 0)
    dtype = value.get("dtype", "float32")
    if preset not in PRESETS:
        raise InvalidRequest(f'unknown random preset "{preset}"; choose a size ('
                             + ", ".join(p for p in PRESETS if p not in ARCH_NAMES
                                         and p not in VARIANT_PRESETS
                                         and PRESETS[p].arch not in VISION_ARCHS)
                             + "), an architecture (" + ", ".join(ARCH_NAMES + VARIANT_PRESETS)
                             + ") or a vision model ("
                             + ", ".join(p for p in PRESETS if PRESETS[p].arch in VISION_ARCHS)
                             + ")")
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise InvalidRequest("random.seed must be a non-negative integer")
    if dtype not in DTYPES:
        raise InvalidRequest(f'unknown random dtype "{dtype}"; choose one of '
                             + ", ".join(DTYPES))
    return RandomSpec(preset, seed, dtype)


def _merge_modelfile(req: CreateRequest, text: str) -> None:
    parsed = parse_modelfile(text)
    req.from_ = req.from_ or parsed.from_
    req.template = req.template or parsed.template
    req.system = req.system or parsed.system
    req.license = req.license or (parsed.license or None)
    req.parameters = {**parsed.parameters, **(req.parameters or {})} or None
    req.messages = req.messages or (parsed.messages or None)
    if not req.adapters:
        req.adapter_path = parsed.adapter
