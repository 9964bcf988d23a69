"""Checks of model files that come from elsewhere (a directory, uploaded blobs, a registry, a
download): safetensors headers and config.json, before anything loads them.

The store runs them at create (a 400 naming the file and the fault) and the runner before MLX
loads the weights (a file changed after create fails the load with the same message).

Invariants:
- Nothing read from a file sizes an allocation or a read until it is checked against the
  file's size and a fixed cap: a safetensors header is read only once its length is known to
  fit in the file and in MAX_HEADER_BYTES; config.json only when under MAX_CONFIG_BYTES.
- A safetensors header that passes describes only bytes inside the file: every tensor's byte
  range lies in the data section, holds exactly shape x dtype bytes, and overlaps no other.
  No dimension reaches 2**31 (MLX's shapes are 32-bit; a wrapped one reads out of bounds).
- A config.json that passes is a JSON object with a plain `model_type`, and every dimension
  it names (at its top level or in a `*_config` section) is an integer in [1, cap].
Only InvalidModelFile leaves these functions, whatever the bytes.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from mlxr.shared.errors import InvalidModelFile

MAX_HEADER_BYTES = 100_000_000  # the safetensors format's own limit
MAX_CONFIG_BYTES = 16 << 20
MAX_DIMS = 8
MAX_DIM = (1 << 31) - 1
# Bits per element of the safetensors dtypes.
DTYPE_BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E4M3": 8, "F8_E5M2": 8, "F8_E8M0": 8,
              "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32,
              "I64": 64, "U64": 64, "F64": 64, "C64": 64, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6}
# config.json dimensions and the largest each may be: far above any real model (Llama 3
# 405B: hidden 16,384, 126 layers; Gemma 3: 262,208 tokens), far below what would exhaust
# memory or time merely building the model's modules.
DIMENSION_CAPS = {
    "hidden_size": 1 << 18, "n_embd": 1 << 18, "d_model": 1 << 18,
    "intermediate_size": 1 << 20, "moe_intermediate_size": 1 << 20, "n_inner": 1 << 20,
    "num_hidden_layers": 1 << 12, "n_layer": 1 << 12, "num_layers": 1 << 12,
    "num_attention_heads": 1 << 12, "n_head": 1 << 12, "num_key_value_heads": 1 << 12,
    "head_dim": 1 << 14,
    "vocab_size": 1 << 24,
    "max_position_embeddings": 1 << 26, "n_positions": 1 << 26, "n_ctx": 1 << 26,
    "num_local_experts": 1 << 12, "num_experts": 1 << 12, "n_routed_experts": 1 << 12,
    "num_experts_per_tok": 1 << 12,
}
_MODEL_TYPE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_\-]{0,63}")


@dataclass(slots=True)
class TensorEntry:
    dtype: str
    shape: tuple[int, ...]
    begin: int  # byte offsets into the data section (after the header)
    end: int


@dataclass(slots=True)
class SafetensorsHeader:
    tensors: dict[str, TensorEntry]
    metadata: dict[str, str] = field(default_factory=dict)
    data_start: int = 0  # 8 + the header's length


def header_length(name: str, prefix: bytes, file_bytes: int) -> int:
    """The header length a safetensors file's first 8 bytes give, once it is known to fit
    in the file and under MAX_HEADER_BYTES."""
    if len(prefix) < 8 or file_bytes < 8:
        raise InvalidModelFile(f"{name} is not a safetensors file: truncated ({file_bytes} "
                               "bytes, less than the 8-byte header length)")
    length = int.from_bytes(prefix[:8], "little")
    if length > file_bytes - 8:
        raise InvalidModelFile(f"{name}: safetensors header length {length} is larger than "
                               f"the file ({file_bytes} bytes): truncated or not safetensors")
    if length > MAX_HEADER_BYTES:
        raise InvalidModelFile(f"{name}: safetensors header length {length} is over the "
                               f"format's limit of {MAX_HEADER_BYTES} bytes")
    return length


def parse_safetensors_header(name: str, header: bytes, data_bytes: int) -> SafetensorsHeader:
    """Check the JSON header of a safetensors file whose data section is `data_bytes` long."""
    try:
        doc = json.loads(header.decode("utf-8"), object_pairs_hook=_unique_keys)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise InvalidModelFile(f"{name}: the safetensors header is not valid JSON "
                               f"({_short(exc)})") from None
    if not isinstance(doc, dict):
        raise InvalidModelFile(f"{name}: the safetensors header is not a JSON object")
    out = SafetensorsHeader({}, data_start=8 + len(header))
    meta = doc.pop("__metadata__", None)
    if meta is not None:
        if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
            raise InvalidModelFile(f"{name}: __metadata__ must map strings to strings")
        out.metadata = meta
    for tensor, entry in doc.items():
        out.tensors[tensor] = _tensor_entry(name, tensor, entry, data_bytes)
    _check_no_overlap(name, out.tensors)
    return out


def read_safetensors_header(path: Path, name: str | None = None) -> SafetensorsHeader:
    """Read and check a safetensors file's header (never its tensor data)."""
    path = Path(path)
    name = name or path.name
    try:
        with open(path, "rb") as f:
            file_bytes = os.fstat(f.fileno()).st_size
            length = header_length(name, f.read(8), file_bytes)
            header = f.read(length)
    except OSError as exc:
        raise InvalidModelFile(f"{name}: cannot read it ({exc.strerror or exc})") from None
    if len(header) != length:  # it shrank while being read
        raise InvalidModelFile(f"{name}: truncated safetensors header")
    return parse_safetensors_header(name, header, file_bytes - 8 - length)


def safetensors_header_of(name: str, data: bytes) -> SafetensorsHeader:
    """`read_safetensors_header` of a whole file held in memory."""
    length = header_length(name, data[:8], len(data))
    return parse_safetensors_header(name, data[8:8 + length], len(data) - 8 - length)


def check_config(config: Any, name: str = "config.json") -> dict[str, Any]:
    """Check a parsed config.json: a JSON object with a `model_type`, its dimensions integers
    in range (see DIMENSION_CAPS) and a sane `quantization`; returns it."""
    if not isinstance(config, dict):
        raise InvalidModelFile(f"{name} is not a JSON object")
    model_type = config.get("model_type")
    if model_type is None:
        raise InvalidModelFile(f"{name} has no model_type: not a Hugging Face/MLX model config")
    if not isinstance(model_type, str) or not _MODEL_TYPE.fullmatch(model_type):
        raise InvalidModelFile(f"{name}: model_type {_shown(model_type)} is not a model type "
                               "name (letters, digits, '_' and '-')")
    check_dimensions(config, name)
    for key, section in config.items():
        if key.endswith("_config") and isinstance(section, dict):
            check_dimensions(section, f"{name} {key}")
    _check_quantization(config, name)
    return config


def check_dimensions(values: Mapping[str, Any], where: str) -> None:
    """Each DIMENSION_CAPS key present (and not null) is an integer in [1, its cap]."""
    for key, cap in DIMENSION_CAPS.items():
        value = values.get(key)
        if value is not None:
            check_dimension(value, key, cap, where)


def check_dimension(value: Any, key: str, cap: int, where: str) -> int:
    """`value` (named `key`, in `where`) as an integer in [1, cap]; else InvalidModelFile."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidModelFile(f"{where}: {key} must be an integer, not {_shown(value)}")
    if not 1 <= value <= cap:
        raise InvalidModelFile(f"{where}: {key} {_shown(value)} is out of range "
                               f"(1 to {cap:,})")
    return value


def read_config(path: Path, name: str = "config.json") -> dict[str, Any]:
    """Read and check a config.json file."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > MAX_CONFIG_BYTES:
                raise InvalidModelFile(f"{name} is {size:,} bytes, over the "
                                       f"{MAX_CONFIG_BYTES:,}-byte limit for a model config")
            data = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise InvalidModelFile(f"{name}: cannot read it ({exc.strerror or exc})") from None
    return config_of(data, name)


def config_of(data: bytes, name: str = "config.json") -> dict[str, Any]:
    """`read_config` of a file's bytes."""
    if len(data) > MAX_CONFIG_BYTES:
        raise InvalidModelFile(f"{name} is over the {MAX_CONFIG_BYTES:,}-byte limit for a "
                               "model config")
    try:
        config = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise InvalidModelFile(f"{name} is not valid JSON ({_short(exc)})") from None
    return check_config(config, name)


def check_model_files(files: Mapping[str, Path]) -> None:
    """Check the config.json and every .safetensors file of a model (file name -> path);
    other files are left alone."""
    for file_name in sorted(files):
        if file_name == "config.json":
            read_config(files[file_name])
        elif file_name.endswith(".safetensors"):
            read_safetensors_header(files[file_name], file_name)


def model_files(directory: Path) -> dict[str, Path]:
    """The files of a model directory these checks cover: config.json and the .safetensors
    files, at its top level and one level down (an adapter's, e.g. `.adapter/`)."""
    directory = Path(directory)
    found: dict[str, Path] = {}
    for path in sorted(directory.iterdir()):
        if path.is_dir():
            for sub in sorted(path.iterdir()):
                if sub.name.endswith(".safetensors") and sub.is_file():
                    found[f"{path.name}/{sub.name}"] = sub
        elif (path.name == "config.json" or path.name.endswith(".safetensors")) and \
                path.is_file():  # (not a FIFO or device, which a read would wait on forever)
            found[path.name] = path
    return found


def check_model_dir(directory: Path) -> None:
    """`check_model_files` of a directory's model files (see model_files)."""
    try:
        files = model_files(directory)
    except OSError as exc:
        raise InvalidModelFile(f"{directory}: cannot list it ({exc.strerror or exc})") from None
    check_model_files(files)


# -- helpers -------------------------------------------------------------------------------
def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise ValueError(f"duplicate key {dup[:80]!r}")
    return out


def _tensor_entry(name: str, tensor: str, entry: Any, data_bytes: int) -> TensorEntry:
    where = f"{name}: tensor {tensor[:80]!r}"
    if not isinstance(entry, dict):
        raise InvalidModelFile(f"{where} is not an object with dtype, shape and data_offsets")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
        raise InvalidModelFile(f"{where} has an unknown dtype {_shown(dtype)}")
    if not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(_is_int(d) for d in shape):
        raise InvalidModelFile(f"{where}: shape must be a list of at most {MAX_DIMS} "
                               f"integers, not {_shown(shape)}")
    if any(not 0 <= d <= MAX_DIM for d in shape):
        raise InvalidModelFile(f"{where}: shape {_shown(shape)} has a dimension outside "
                               f"0 to {MAX_DIM}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(x) for x in offsets)):
        raise InvalidModelFile(f"{where}: data_offsets must be two integers, not "
                               f"{_shown(offsets)}")
    begin, end = offsets
    if not 0 <= begin <= end:
        raise InvalidModelFile(f"{where}: data_offsets {_shown(offsets)} are not an "
                               "ascending pair of non-negative offsets")
    if end > data_bytes:
        raise InvalidModelFile(f"{where}: data_offsets {_shown(offsets)} run past the end of "
                               f"the file (its data section is {data_bytes} bytes): truncated")
    bits = DTYPE_BITS[dtype]
    for d in shape:
        bits *= d
    if bits != (end - begin) * 8:
        raise InvalidModelFile(f"{where}: shape {_shown(shape)} of {dtype} needs "
                               f"{_bytes(bits)} but its data_offsets hold {end - begin} bytes")
    return TensorEntry(dtype, tuple(shape), begin, end)


def _check_quantization(config: Mapping[str, Any], name: str) -> None:
    """mlx_lm's `quantization` (bits and group_size, also per layer) and the `bits` of a
    Hugging Face `quantization_config`."""
    quant = config.get("quantization")
    if quant is not None:
        if not isinstance(quant, dict):
            raise InvalidModelFile(f"{name}: quantization must be an object, not {_shown(quant)}")
        for where, values in [("quantization", quant)] + [
                (f"quantization {k[:80]!r}", v) for k, v in quant.items() if isinstance(v, dict)]:
            for key, cap in (("bits", 8), ("group_size", 1 << 12)):
                if key in values or where == "quantization":
                    if key not in values:
                        raise InvalidModelFile(f"{name}: quantization has no {key}")
                    check_dimension(values[key], key, cap, f"{name} {where}")
    hf = config.get("quantization_config")
    if isinstance(hf, dict) and hf.get("bits") is not None:
        check_dimension(hf["bits"], "bits", 16, f"{name} quantization_config")


def _check_no_overlap(name: str, tensors: dict[str, TensorEntry]) -> None:
    ranges = sorted((t.begin, t.end, n) for n, t in tensors.items() if t.end > t.begin)
    for (_, prev_end, prev), (begin, _, this) in zip(ranges, ranges[1:]):
        if begin < prev_end:
            raise InvalidModelFile(f"{name}: tensors {prev[:80]!r} and {this[:80]!r} overlap "
                                   "in the file")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _bytes(bits: int) -> str:
    return f"{bits // 8} bytes" if bits % 8 == 0 else f"{bits / 8} bytes"


def _shown(value: Any, depth: int = 0) -> str:
    """A short rendering of a JSON value for a message (bounded for any value: no huge
    integer is turned into digits, no long list or deep nesting is walked)."""
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, int):
        return str(value) if value.bit_length() <= 128 else f"a {value.bit_length()}-bit integer"
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value[:60]) + ("..." if len(value) > 60 else "")
    if isinstance(value, list):
        if depth >= 2:
            return "[...]"
        items = [_shown(v, depth + 1) for v in value[:8]]
        return "[" + ", ".join(items + (["..."] if len(value) > 8 else [])) + "]"
    return "an object" if isinstance(value, dict) else type(value).__name__


def _short(exc: Exception) -> str:
    text = str(exc)
    return text if len(text) <= 120 else text[:117] + "..."
