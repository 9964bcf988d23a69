"""LoRA adapters for `create`: read an adapter in mlx-lm's format (adapters.safetensors and an
adapter_config.json with `lora_parameters`, as `mlx_lm.lora` writes it) or PEFT's
(adapter_model.safetensors and an adapter_config.json with `r`, `lora_alpha`, `target_modules`),
check it against the base model's weights, and store it in mlx-lm's format, which the runner
hands to `mlx_lm.utils.load(adapter_path=...)`.

Invariants:
- `read_adapter` and `check_base` raise InvalidRequest (400) for anything the runner could not
  apply exactly: an adapter is stored only when every tensor in it lands on a decoder layer's
  linear module of the base model with matching shapes. Nothing is ignored silently.
- PEFT weights are converted by name and layout only (lora_A.weight (r, in) -> lora_a (in, r),
  lora_B.weight (out, r) -> lora_b (r, out)); values and dtypes are copied byte for byte and the
  scale becomes lora_alpha / r (lora_alpha / sqrt(r) with use_rslora). No MLX is imported here.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mlxr.shared.errors import InvalidRequest

from .metadata import read_safetensors_header

ADAPTER_WEIGHTS = "adapters.safetensors"  # mlx-lm's names, also how adapters are stored
ADAPTER_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"
_FLOAT_SIZES = {"F32": 4, "F16": 2, "BF16": 2}
_LAYER = re.compile(r"^(?P<prefix>(?:.*\.)?layers\.)(?P<index>\d+)\.(?P<key>.+)$")
_PEFT_TENSOR = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])"
                          r"(?:\.default)?\.weight$")
_MLX_TENSOR = re.compile(r"^(?P<module>.+)\.(?P<leaf>lora_a|lora_b|m)$")


@dataclass(slots=True)
class _Tensor:
    source: str  # the tensor's name in the source file
    module: str  # its module path, e.g. model.layers.0.self_attn.q_proj
    leaf: str  # lora_a, lora_b or m (DoRA's magnitudes)
    dtype: str
    shape: list[int]  # as mlx-lm expects it (transposed for PEFT)


@dataclass(slots=True)
class Adapter:
    kind: str  # "mlx-lm" or "peft"
    weights: Path
    fine_tune_type: str  # "lora" or "dora"
    rank: int
    scale: float
    tensors: list[_Tensor] = field(default_factory=list)
    num_layers: int = -1
    keys: list[str] | None = None  # layer-relative module paths (None: mlx-lm's default)

    def config_bytes(self) -> bytes:
        """The adapter_config.json to store (only what mlx_lm.load_adapters reads)."""
        params: dict[str, Any] = {"rank": self.rank, "scale": self.scale, "dropout": 0.0}
        if self.keys is not None:
            params["keys"] = self.keys
        config = {"fine_tune_type": self.fine_tune_type, "num_layers": self.num_layers,
                  "lora_parameters": params}
        return json.dumps(config, indent=2).encode() + b"\n"


def adapter_files(path: Path) -> dict[str, Path]:
    """The files of an adapter directory (or of the directory of a .safetensors file) that
    `create` sends: the config and the one weights file."""
    if path.is_file() and path.suffix == ".gguf":
        raise InvalidRequest(f'"{path.name}" is a GGUF adapter: mlxr applies adapters in '
                             "safetensors form (mlx-lm's adapters.safetensors or PEFT's "
                             "adapter_model.safetensors, with adapter_config.json)")
    directory = path.parent if path.is_file() else path
    if not directory.is_dir():
        raise InvalidRequest(f'no such adapter directory "{path}"')
    weights = [path] if path.is_file() else \
        [directory / n for n in (ADAPTER_WEIGHTS, PEFT_WEIGHTS) if (directory / n).is_file()]
    if not weights:
        raise InvalidRequest(f'"{directory}" has no {ADAPTER_WEIGHTS} (mlx-lm) or '
                             f"{PEFT_WEIGHTS} (PEFT)")
    if not (directory / ADAPTER_CONFIG).is_file():
        raise InvalidRequest(f'"{directory}" has no {ADAPTER_CONFIG}')
    return {ADAPTER_CONFIG: directory / ADAPTER_CONFIG, weights[0].name: weights[0]}


def read_adapter(files: dict[str, Path]) -> Adapter:
    """The adapter among `files` (file name -> path); checks its own consistency."""
    if any(n.lower().endswith(".gguf") for n in files):
        raise InvalidRequest("GGUF adapters are not supported: give the adapter in safetensors "
                             "form (mlx-lm or PEFT) with its adapter_config.json")
    by_base = {Path(n).name: p for n, p in files.items()}
    config_path = by_base.get(ADAPTER_CONFIG)
    if config_path is None:
        raise InvalidRequest(f"adapters must include {ADAPTER_CONFIG}")
    weights = [by_base[n] for n in (ADAPTER_WEIGHTS, PEFT_WEIGHTS) if n in by_base]
    if not weights:
        weights = [p for n, p in by_base.items() if n.endswith(".safetensors")]
    if len(weights) != 1:
        raise InvalidRequest("adapters must include exactly one .safetensors file "
                             f"({ADAPTER_WEIGHTS} or {PEFT_WEIGHTS}); got {len(weights)}")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        raise InvalidRequest(f"{ADAPTER_CONFIG} is not valid JSON") from None
    if not isinstance(config, dict):
        raise InvalidRequest(f"{ADAPTER_CONFIG} must be a JSON object")
    try:
        header = read_safetensors_header(weights[0])
    except InvalidRequest:
        raise InvalidRequest("the adapter weights are not a safetensors file") from None
    if "lora_parameters" in config:
        return _mlx_adapter(config, weights[0], header)
    if "r" in config or str(config.get("peft_type", "")).upper() == "LORA":
        return _peft_adapter(config, weights[0], header)
    raise InvalidRequest(f"{ADAPTER_CONFIG} is neither mlx-lm's (lora_parameters) nor PEFT's "
                         "(r, lora_alpha)")


def _number(config: dict, key: str, kind: type, where: str = "") -> Any:
    value = config.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or (kind is int and not float(value).is_integer()) or value <= 0:
        raise InvalidRequest(f"{ADAPTER_CONFIG}: {where}{key} must be a positive number")
    return kind(value)


def _mlx_adapter(config: dict, weights: Path, header: dict) -> Adapter:
    kind = config.get("fine_tune_type", "lora")
    if kind not in ("lora", "dora"):
        raise InvalidRequest(f'{ADAPTER_CONFIG}: fine_tune_type "{kind}" is not supported '
                             "(lora and dora are); fuse full fine-tunes with mlx_lm.fuse and "
                             "create from the fused directory")
    params = config["lora_parameters"]
    if not isinstance(params, dict):
        raise InvalidRequest(f"{ADAPTER_CONFIG}: lora_parameters must be an object")
    rank = _number(params, "rank", int, "lora_parameters.")
    scale = params.get("scale")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise InvalidRequest(f"{ADAPTER_CONFIG}: lora_parameters.scale must be a number")
    num_layers = config.get("num_layers", -1)
    keys = params.get("keys")
    if not isinstance(num_layers, int) or isinstance(num_layers, bool):
        raise InvalidRequest(f"{ADAPTER_CONFIG}: num_layers must be an integer")
    if keys is not None and not (isinstance(keys, list) and all(isinstance(k, str)
                                                                for k in keys)):
        raise InvalidRequest(f"{ADAPTER_CONFIG}: lora_parameters.keys must be a list of names")
    tensors = []
    for name, info in _tensor_infos(header):
        m = _MLX_TENSOR.match(name)
        if m is None or (m["leaf"] == "m" and kind != "dora"):
            raise InvalidRequest(f'adapter tensor "{name}" is not a LoRA weight (lora_a, '
                                 "lora_b)")
        tensors.append(_Tensor(name, m["module"], m["leaf"], info["dtype"], info["shape"]))
    adapter = Adapter("mlx-lm", weights, kind, rank, float(scale), tensors, num_layers, keys)
    _check_ranks(adapter)
    return adapter


def _peft_adapter(config: dict, weights: Path, header: dict) -> Adapter:
    unsupported = [what for what, bad in (
        ("use_dora", config.get("use_dora")),
        ("fan_in_fan_out", config.get("fan_in_fan_out")),
        ("bias", config.get("bias", "none") not in (None, "none")),
        ("modules_to_save", config.get("modules_to_save")),
        ("rank_pattern", config.get("rank_pattern")),
        ("alpha_pattern", config.get("alpha_pattern"))) if bad]
    if config.get("peft_type", "LORA") != "LORA":
        unsupported.insert(0, f"peft_type {config.get('peft_type')}")
    if unsupported:
        raise InvalidRequest("unsupported PEFT adapter: " + ", ".join(unsupported)
                             + " (mlxr applies plain LoRA: one rank and alpha, no bias)")
    rank = _number(config, "r", int)
    alpha = _number(config, "lora_alpha", float)
    scale = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
    tensors = []
    for name, info in _tensor_infos(header):
        m = _PEFT_TENSOR.match(name)
        if m is None or len(info["shape"]) != 2:
            raise InvalidRequest(f'unsupported PEFT adapter tensor "{name}": only lora_A and '
                                 "lora_B weights of linear layers are applied")
        rows, cols = info["shape"]
        leaf, shape = ("lora_a", [cols, rows]) if m["ab"] == "A" else ("lora_b", [cols, rows])
        tensors.append(_Tensor(name, m["module"], leaf, info["dtype"], shape))
    adapter = Adapter("peft", weights, "lora", rank, scale, tensors)
    _check_ranks(adapter)
    return adapter


def _tensor_infos(header: dict) -> list[tuple[str, dict]]:
    out = []
    for name, info in sorted(header.items()):
        if not isinstance(info, dict) or info.get("dtype") not in _FLOAT_SIZES:
            dtype = info.get("dtype") if isinstance(info, dict) else None
            raise InvalidRequest(f'adapter tensor "{name}" has dtype {dtype}: F32, F16 or BF16 '
                                 "are supported")
        out.append((name, info))
    if not out:
        raise InvalidRequest("the adapter weights file holds no tensors")
    return out


def _check_ranks(adapter: Adapter) -> None:
    for t in adapter.tensors:
        if t.leaf == "m":
            continue
        if len(t.shape) != 2 or t.shape[1 if t.leaf == "lora_a" else 0] != adapter.rank:
            raise InvalidRequest(f'adapter tensor "{t.source}" has shape {t.shape}, not rank '
                                 f"{adapter.rank} as {ADAPTER_CONFIG} says")


def check_base(adapter: Adapter, base_files: dict[str, Path]) -> None:
    """Check that every adapter tensor targets a linear module of one of the base model's
    decoder layers with the right shapes; names PEFT tensors as the base model does. Fills
    `num_layers` and `keys` for a PEFT adapter."""
    config = _base_config(base_files)
    bits = (config.get("quantization") or {}).get("bits") \
        if isinstance(config.get("quantization"), dict) else None
    weights: dict[str, tuple[str, list[int]]] = {}  # "layers.N.key" -> (module, [out, in])
    for name, path in base_files.items():
        if not name.endswith(".safetensors"):
            continue
        for tensor, info in read_safetensors_header(path).items():
            m = _LAYER.match(tensor)
            if m is None or not tensor.endswith(".weight") or len(info.get("shape", [])) != 2:
                continue
            out_dims, in_dims = info["shape"]
            if bits and info.get("dtype") == "U32":
                in_dims = in_dims * 32 // int(bits)
            rel = f"layers.{m['index']}.{m['key']}"[:-len(".weight")]
            weights[rel] = (tensor[:-len(".weight")], [out_dims, in_dims])
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    num_hidden = text.get("num_hidden_layers")
    lowest, keys = None, set()
    for t in adapter.tensors:
        m = _LAYER.match(t.module)
        if m is None:
            raise InvalidRequest(f'adapter tensor "{t.source}" targets {t.module}, outside the '
                                 "decoder layers: only the layers' linear modules can be adapted")
        index, key = int(m["index"]), m["key"]
        found = weights.get(f"layers.{index}.{key}")
        if found is None:
            raise InvalidRequest(f'adapter tensor "{t.source}": the base model has no linear '
                                 f"weight layers.{index}.{key}")
        module, (out_dims, in_dims) = found
        want = {"lora_a": [in_dims, adapter.rank], "lora_b": [adapter.rank, out_dims],
                "m": [out_dims]}[t.leaf]
        if t.shape != want:
            raise InvalidRequest(f'adapter tensor "{t.source}" has shape {t.shape}; the base '
                                 f"model's {module} needs {want}")
        if adapter.kind == "mlx-lm":
            _check_mlx_coverage(adapter, t, index, key, num_hidden)
        t.module = module
        lowest = index if lowest is None else min(lowest, index)
        keys.add(key)
    if adapter.kind == "peft":
        adapter.keys = sorted(keys)
        adapter.num_layers = num_hidden - lowest if isinstance(num_hidden, int) else -1


def _check_mlx_coverage(adapter: Adapter, t: _Tensor, index: int, key: str,
                        num_hidden: Any) -> None:
    """mlx-lm converts only the last `num_layers` layers and (when given) only `keys`."""
    if adapter.keys is not None and key not in adapter.keys:
        raise InvalidRequest(f'adapter tensor "{t.source}": {key} is not among '
                             "lora_parameters.keys")
    if adapter.num_layers >= 0 and isinstance(num_hidden, int) \
            and index < num_hidden - adapter.num_layers:
        raise InvalidRequest(f'adapter tensor "{t.source}": layer {index} is not among the '
                             f"last {adapter.num_layers} layers (num_layers)")


def _base_config(base_files: dict[str, Path]) -> dict:
    try:
        config = json.loads(base_files["config.json"].read_text())
    except (KeyError, OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def write_weights(adapter: Adapter, dest: Path) -> Path:
    """The adapter's weights as mlx-lm names them, written to `dest` (PEFT: transposed)."""
    data = adapter.weights.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    start = 8 + length
    entries: dict[str, Any] = {}
    chunks: list[bytes] = []
    offset = 0
    for t in adapter.tensors:
        info = header[t.source]
        begin, end = info["data_offsets"]
        raw = data[start + begin:start + end]
        if adapter.kind == "peft":  # transpose, element by element, whatever the float type
            item = np.dtype(f"u{_FLOAT_SIZES[t.dtype]}").newbyteorder("<")
            raw = np.frombuffer(raw, item).reshape(info["shape"]).T.tobytes()
        name = f"{t.module}.{t.leaf}"
        entries[name] = {"dtype": t.dtype, "shape": t.shape,
                         "data_offsets": [offset, offset + len(raw)]}
        chunks.append(raw)
        offset += len(raw)
    text = json.dumps({"__metadata__": {"format": "mlx"}, **entries}, separators=(",", ":"))
    text += " " * (-len(text) % 8)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text.encode())
        for chunk in chunks:
            f.write(chunk)
    return dest
