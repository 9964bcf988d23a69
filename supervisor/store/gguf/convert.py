"""A GGUF file -> an MLX model directory (config.json, model-*.safetensors, tokenizer.json,
tokenizer_config.json) that mlx_lm loads.

Run as a child process of the supervisor (`python -m mlxr.supervisor.store.gguf.convert SRC
DST`), so the MLX work and memory of a conversion stay out of the server. It prints progress as
JSON lines on stdout ({"completed": bytes, "total": bytes}); a model it cannot convert ends it
with exit status 2 and one JSON line on stderr ({"error": message}) that the caller turns into
a 400.

Invariants:
- Quantized tensors stay quantized at the precision they have (quants.py); float tensors become
  the model's float type: float32 where MLX runs on the CPU, else the source's (F16 -> float16).
- The output depends only on the GGUF bytes, CONVERTER_VERSION and that float type; the caller
  keys the directory by all three and writes it under a temporary name first.
- Nothing is written into DST before every tensor name and type is known to be supported.
- `check_supported` (run at create, before any conversion) leaves nothing in the header for
  the converter to trip on (checks.py); the converted config.json is checked as any
  config.json is (shared/model_checks.py). A hostile file is an InvalidModelFile (a 400), not
  a failed conversion (a 500).
"""

from __future__ import annotations

import collections
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from mlxr.shared.errors import InvalidModelFile, InvalidRequest, UnsupportedModel
from mlxr.shared.model_checks import check_config

from .header import GgufFile, TensorInfo, read_gguf

# Bump when the output of a conversion changes: older derived directories are then redone.
CONVERTER_VERSION = 2
SHARD_BYTES = 2 << 30
GROUP_SIZE = 32
_FLOAT_TYPES = (0, 1, 30)  # F32, F16, BF16
_EXPERTS = re.compile(r"\.(switch_mlp|experts)\.")  # a mixture's stacked experts (3-D)


@dataclass(slots=True)
class GgufSummary:
    """What the store needs from a GGUF file's header (no tensor data is read)."""

    architecture: str
    kv: dict[str, Any]
    parameter_count: int
    tensor_types: dict[str, int]  # tensor name -> ggml type
    file_type: str  # "Q4_K_M", "F16", ...

    @property
    def chat_template(self) -> str | None:
        value = self.kv.get("tokenizer.chat_template")
        return value if isinstance(value, str) and value else None


def is_gguf(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def _file_type_name(kv: dict[str, Any], types: dict[str, int]) -> str:
    from gguf import GGMLQuantizationType, LlamaFileType

    code = kv.get("general.file_type")
    if isinstance(code, int):
        try:
            name = LlamaFileType(code).name  # "MOSTLY_Q4_K_M", "ALL_F32" (Ollama: "F32")
            return name.removeprefix("MOSTLY_").removeprefix("ALL_").replace("GUESSED", "")
        except ValueError:
            pass
    counts = collections.Counter(t for n, t in types.items() if n.endswith(".weight"))
    if not counts:
        return "unknown"
    return GGMLQuantizationType(counts.most_common(1)[0][0]).name


def check_supported(path: Path, gguf: GgufFile | None = None) -> GgufSummary:
    """Read a GGUF header and check that this converter can take it: the architecture, every
    tensor name and type, the tokenizer kind. Raises UnsupportedModel errors naming what is
    not supported (long metadata arrays are skipped unless `gguf` is given)."""
    from . import arch, checks, encoders, pooling, quants, tokenizer, wordpiece

    gguf = gguf or read_gguf(path, skip_arrays=True)
    kv = gguf.kv
    name = kv.get("general.architecture")
    if not isinstance(name, str):
        raise InvalidRequest(f"{path.name} has no general.architecture")
    if name not in arch.ARCHITECTURES and not encoders.is_encoder(name):
        raise UnsupportedModel(
            f'unsupported model architecture "{name}"; mlxr runs GGUF models of these '
            "architectures: " + ", ".join((*arch.ARCHITECTURES, *encoders.ARCHITECTURES)))
    layers = checks.check_hparams(path.name, kv, name)
    if encoders.is_encoder(name) or pooling.embeds(kv):
        pooling.pooling_mode(kv)  # a reranker or per-token file: refused here, by name
    types: dict[str, int] = {}
    for t in gguf.tensors:
        hf = tensor_name(name, t.name)  # raises for a tensor it cannot place
        checks.check_tensor(path.name, t, hf, layers)
        if t.ggml_type not in _FLOAT_TYPES:
            try:
                quants.requantized_bits(t.ggml_type)
            except UnsupportedModel as exc:
                raise type(exc)(f'{exc.message} in "{t.name}"') from None
        types[t.name] = t.ggml_type
    checks.check_tokenizer_kv(path.name, kv)
    if encoders.is_encoder(name):
        wordpiece.check_tokenizer(kv)
    else:
        tokenizer.check_tokenizer(kv)
    count = sum(t.n_elements for t in gguf.tensors)
    return GgufSummary(name, kv, count, types, _file_type_name(kv, types))


def tensor_name(arch_name: str, gguf_name: str) -> str | None:
    """The converted directory's name of a GGUF tensor (None: read as metadata, or left out)."""
    from . import arch, encoders

    if encoders.is_encoder(arch_name):
        return encoders.hf_tensor_name(arch_name, gguf_name)
    return arch.hf_tensor_name(arch_name, gguf_name)


def hf_config_of(gguf: GgufFile, summary: GgufSummary) -> dict[str, Any]:
    """The converted model's config.json (less torch_dtype) from the header and the rope
    tensors' values, checked as any config.json is."""
    from . import arch, encoders, tokenizer

    tensors = {t.name: t for t in gguf.tensors}
    if encoders.is_encoder(summary.architecture):
        def rows(name: str) -> int | None:
            return tensors[name].shape[0] if name in tensors else None

        config = encoders.hf_config(summary.kv, vocab_size=_vocab_size(summary.kv, tensors),
                                    type_vocab_size=rows("token_types.weight") or 1,
                                    positions=rows("position_embd.weight"))
        return check_config(config, f"{gguf.path.name} (its config.json)")
    rope_freqs = tensors.get("rope_freqs.weight")
    config = arch.hf_config(
        summary.kv, vocab_size=_vocab_size(summary.kv, tensors),
        tied="output.weight" not in tensors, has_rope_freqs=rope_freqs is not None,
        rope_freqs=None if rope_freqs is None else np.asarray(gguf.data(rope_freqs), np.float32),
        rope_tensors={n: np.asarray(gguf.data(tensors[n]), np.float32)
                      for n in arch.ROPE_TENSORS if n in tensors},
        tensor_names=list(tensors))
    config.update({k: v for k, v in tokenizer.special_token_ids(summary.kv).items()
                   if v is not None})
    return check_config(config, f"{gguf.path.name} (its config.json)")


def target_float_dtype(source_types: set[str]) -> str:
    """float32 where MLX computes on the CPU; elsewhere the source's half type, if any."""
    import mlx.core as mx

    if mx.default_device() == mx.cpu:
        return "float32"
    return "bfloat16" if "BF16" in source_types else "float16"


def convert(src: Path, dst: Path, progress: Callable[[int, int], None] | None = None,
            float_dtype: str | None = None, dequantize: bool = False) -> dict[str, Any]:
    """Convert `src` into the (new, empty) directory `dst`; returns the config written.
    `dequantize`: every tensor as floats (gguf's reference values), for comparisons."""
    import mlx.core as mx
    from gguf import GGMLQuantizationType

    from . import arch, encoders, pooling, quants, tokenizer, wordpiece

    gguf = read_gguf(src)
    summary = check_supported(src, gguf)
    kv, name = summary.kv, summary.architecture
    encoder = encoders.is_encoder(name)
    dequantize = dequantize or encoder  # runner/embed runs float layers only
    floats = {GGMLQuantizationType(t.ggml_type).name for t in gguf.tensors}
    dtype = getattr(mx, float_dtype or target_float_dtype(floats))
    config = hf_config_of(gguf, summary)
    config["torch_dtype"] = str(dtype).removeprefix("mlx.core.")
    dst.mkdir(parents=True, exist_ok=True)
    total = sum(t.n_bytes for t in gguf.tensors)
    done = 0
    bits_of: dict[str, tuple[int, str]] = {}  # a quantized layer's bits and mode
    modules: dict[str, dict[str, Any]] = {}  # a module folder's weights, as floats
    dense: list[tuple[str, int, int]] = []  # (folder, inputs, outputs)
    shard: dict[str, mx.array] = {}
    shard_bytes, shard_index = 0, 0
    for t in gguf.tensors:
        hf = tensor_name(name, t.name)
        done += t.n_bytes
        if hf is None:
            if progress is not None:
                progress(done, total)
            continue
        shape = t.shape
        if "/" in hf:  # a sentence-transformers module's weight (EmbeddingGemma's Dense)
            folder, key = hf.split("/", 1)
            out = quants.to_mlx(t.ggml_type, gguf.data(t), shape, t.name, quantize=False)
            modules.setdefault(folder, {})[key] = mx.array(out.weight).astype(mx.float32)
            dense.append((folder, shape[1], shape[0]))
            if progress is not None:
                progress(done, total)
            continue
        matrix = len(shape) == 2 or (len(shape) == 3 and _EXPERTS.search(hf) is not None)
        out = quants.to_mlx(t.ggml_type, gguf.data(t), shape, t.name,
                            quantize=not dequantize and hf.endswith(".weight") and matrix)
        order = None if encoder else arch.row_order(name, hf, config)
        if order is not None and len(order) != shape[0]:  # q/k rows are heads x head size
            raise InvalidModelFile(f'{src.name}: tensor "{t.name}" has {shape[0]} rows where '
                                   f"its heads need {len(order)}")
        offset = 0.0 if encoder else arch.value_offset(name, hf)
        arrays = _arrays(out, hf, order, offset, dtype)
        parts = None if encoder else arch.split_rows(name, hf, config)
        if parts is not None:
            arrays = _split(arrays, hf, parts)
        if out.bits is not None:
            for part in parts or [(hf, 0)]:
                bits_of[part[0].removesuffix(".weight")] = (out.bits, out.mode)
        for key, value in arrays.items():
            shard[key] = value
            shard_bytes += value.nbytes
        if shard_bytes >= SHARD_BYTES:
            shard_index += 1
            mx.save_safetensors(str(dst / f"model-{shard_index:05d}.safetensors"), shard,
                                metadata={"format": "mlx"})
            shard, shard_bytes = {}, 0
        if progress is not None:
            progress(done, total)
    if shard or shard_index == 0:
        shard_index += 1
        mx.save_safetensors(str(dst / f"model-{shard_index:05d}.safetensors"), shard,
                            metadata={"format": "mlx"})
    for folder, tensors in modules.items():
        (dst / folder).mkdir(exist_ok=True)
        mx.save_safetensors(str(dst / folder / "model.safetensors"), tensors,
                            metadata={"format": "pt"})
    if bits_of:
        config["quantization"] = _quantization(bits_of)
    config["mlxr_gguf"] = {"converter_version": CONVERTER_VERSION,
                           "file_type": summary.file_type}
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    if encoder:
        limit = config.get("max_position_embeddings") or config["n_positions"]
        files = {**wordpiece.encoder_files(kv), **pooling.sentence_transformers_files(kv, limit)}
    else:
        files = tokenizer.hf_tokenizer_files(kv)
        if pooling.embeds(kv):  # an embedding model (Qwen3-Embedding): how to pool
            files.update(pooling.sentence_transformers_files(kv, dense=tuple(sorted(dense))))
    for file_name, data in files.items():
        (dst / file_name).parent.mkdir(exist_ok=True)
        (dst / file_name).write_bytes(data)
    return config


def _vocab_size(kv: dict[str, Any], tensors: dict[str, TensorInfo]) -> int:
    embed = tensors.get("token_embd.weight")
    if embed is not None:
        return embed.shape[0]  # (vocab, hidden)
    tokens = kv.get("tokenizer.ggml.tokens")
    return len(tokens) if isinstance(tokens, list) else 0


def _arrays(out, hf: str, order: np.ndarray | None, offset: float, dtype) -> dict[str, Any]:
    import mlx.core as mx

    stem = hf.removesuffix(".weight")
    if out.bits is None:
        weight = out.weight if order is None else out.weight[order]
        if offset:
            weight = weight + np.float32(offset)
        return {hf: mx.array(weight).astype(dtype)}
    parts = {hf: out.weight, f"{stem}.scales": out.scales, f"{stem}.biases": out.biases}
    result = {}
    for key, value in parts.items():
        if value is None:  # (mxfp4: no biases)
            continue
        value = value if order is None else value[order]
        array = mx.array(value)
        # (mxfp4's scales are exponent bytes: kept as they are)
        result[key] = array if key == hf or out.mode != "affine" else array.astype(dtype)
    return result


def _split(arrays: dict[str, Any], hf: str, parts: list[tuple[str, int]]) -> dict[str, Any]:
    """A fused tensor's arrays (weight, or weight/scales/biases; or a bias) cut by rows into
    the tensors mlx_lm holds: rows stay whole, so quantized groups do too. Rows are the
    second-last axis (a mixture's experts are (experts, rows, columns)); a bias's, its only."""
    stem = hf.rsplit(".", 1)[0]
    out = {}
    for key, value in arrays.items():
        axis = max(value.ndim - 2, 0)
        start = 0
        for name, rows in parts:
            index = (slice(None),) * axis + (slice(start, start + rows),)
            out[key.replace(stem, name.rsplit(".", 1)[0], 1)] = value[index]
            start += rows
        if start != value.shape[axis]:
            raise InvalidModelFile(f"{hf}: {value.shape[axis]} rows where its parts need {start}")
    return out


def _quantization(bits_of: dict[str, tuple[int, str]]) -> dict[str, Any]:
    """mlx_lm's quantization config: the most common bits and mode, per-layer entries for the
    rest."""
    bits, mode = collections.Counter(bits_of.values()).most_common(1)[0][0]
    config: dict[str, Any] = {"group_size": GROUP_SIZE, "bits": bits, "mode": mode}
    for path, (layer_bits, layer_mode) in sorted(bits_of.items()):
        if (layer_bits, layer_mode) != (bits, mode):
            config[path] = {"group_size": GROUP_SIZE, "bits": layer_bits}
            if layer_mode != "affine":
                config[path]["mode"] = layer_mode
    return config


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m mlxr.supervisor.store.gguf.convert SRC.gguf DST_DIR",
              file=sys.stderr)
        return 64
    last = [-1]

    def progress(done: int, total: int) -> None:
        step = done * 100 // max(total, 1)
        if step != last[0]:
            last[0] = step
            print(json.dumps({"completed": done, "total": total}), flush=True)

    try:
        convert(Path(argv[0]), Path(argv[1]), progress)
    except InvalidRequest as exc:
        print(json.dumps({"error": str(exc), "kind": exc.kind}), file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
