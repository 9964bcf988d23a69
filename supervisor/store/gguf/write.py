"""An MLX/Hugging Face model directory -> a GGUF file, the way llama.cpp's converter lays one
out (its tensor names, metadata keys, q/k row order and Gemma's norm + 1), so tests and
benchmarks can make GGUF models from the random models nothing needs to download.

Tensor types, by the file type asked for (as llama.cpp picks them): 1-D tensors and biases stay
F32; a
2-D tensor whose rows do not divide into the type's blocks falls back to F16 (F32 on "F32").
"Q4_K_M" stores as Q6_K what llama.cpp's quantizer does: the output projection (the token
embedding where the head is tied to it), and attn_v and ffn_down (a mixture's ffn_down_exps)
in the layers `_more_bits` picks (the first and last eighth, every third between); every
other matrix as Q4_K. "Q4_K" uses Q4_K throughout, "Q6_K" Q6_K. "MXFP4" (gpt-oss's own
format, as its GGUFs come) stores a mixture's experts as MXFP4 and every other matrix as F16. A
mixture's router
(`ffn_gate_inp`) stays F32, as llama.cpp's quantizer leaves it; its experts are 3-D tensors,
quantized row by row like matrices.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

FILE_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q4_K_M",
              "Q6_K", "MXFP4")


def _load_float32(model_dir: Path) -> dict[str, np.ndarray]:
    import mlx.core as mx

    tensors: dict[str, np.ndarray] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        for name, array in mx.load(str(path)).items():
            tensors[name] = np.array(array.astype(mx.float32))
    return tensors


def _tensor_type(file_type: str, gguf_name: str, shape: tuple[int, ...], layers: int = 0,
                 head: str = "output.weight"):
    """The type of tensor `gguf_name`; `head`: the tensor the output projection reads (the token
    embedding of a tied model), `layers`: the model's layer count."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

    if len(shape) < 2 or gguf_name.endswith((".ffn_gate_inp.weight", ".bias")):
        return T.F32  # (gpt-oss's expert biases are 2-D; llama.cpp adds them as F32 only)
    if file_type == "Q4_K_M":
        parts = gguf_name.split(".")
        wider = gguf_name == head or (
            len(parts) == 4 and parts[0] == "blk"
            and parts[2] in ("attn_v", "ffn_down", "ffn_down_exps")
            and _more_bits(int(parts[1]), layers))
        wanted = T.Q6_K if wider else T.Q4_K
    elif file_type == "MXFP4":
        wanted = T.MXFP4 if gguf_name.split(".")[-2].endswith("_exps") else T.F16
    else:
        wanted = T[file_type]
    block = GGML_QUANT_SIZES[wanted][0]
    if shape[-1] % block:
        return T.F32 if file_type == "F32" else T.F16
    return wanted


def _more_bits(layer: int, layers: int) -> bool:
    """Whether a Q4_K_M file keeps layer `layer`'s attn_v and ffn_down at Q6_K, as llama.cpp
    does: the first and last eighth of the layers, and every third layer between."""
    eighth = layers // 8
    return layer < eighth or layer >= 7 * layers // 8 or (layer - eighth) % 3 == 2


def _encode(x: np.ndarray, ggml_type) -> tuple[np.ndarray, Any]:
    """(data for GGUFWriter.add_tensor, raw_dtype) of a float32 array as `ggml_type`."""
    from gguf import GGMLQuantizationType as T, quants as gq

    from . import quants

    if ggml_type == T.F32:
        return x.astype(np.float32), None
    if ggml_type == T.F16:
        return x.astype(np.float16), None
    # (a mixture's experts are (experts, rows, columns): quantized as rows, kept 3-D)
    rows = x.reshape(-1, x.shape[-1])
    if ggml_type == T.Q4_K:
        data = quants.quantize_q4_k(rows)
    elif ggml_type == T.Q6_K:
        data = quants.quantize_q6_k(rows)
    else:
        data = gq.quantize(rows, ggml_type)
    return data.reshape(*x.shape[:-1], -1), ggml_type


def _add_kv(writer, key: str, value: Any) -> None:
    from gguf import GGUFValueType as V

    if isinstance(value, bool):
        writer.add_key_value(key, value, V.BOOL)
    elif isinstance(value, int):
        writer.add_key_value(key, value, V.UINT32 if 0 <= value < 1 << 32 else V.INT64)
    elif isinstance(value, float):
        writer.add_key_value(key, value, V.FLOAT32)
    elif isinstance(value, str):
        writer.add_key_value(key, value, V.STRING)
    elif isinstance(value, (list, tuple)):
        if value and all(isinstance(v, float) for v in value):
            writer.add_key_value(key, list(value), V.ARRAY, V.FLOAT32)
        elif value and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            writer.add_key_value(key, list(value), V.ARRAY, V.INT32)
        else:
            writer.add_array(key, list(value))
    elif value is not None:
        raise TypeError(f"cannot write {key}={value!r} to GGUF")


def write_gguf(model_dir: Path, dest: Path, file_type: str = "F16") -> Path:
    """Write `model_dir` (float safetensors, any supported architecture, or a BERT / Nomic
    BERT encoder) as a GGUF file."""
    from . import arch as arches, encoders
    from .tokenizer import gguf_tokenizer_fields

    if file_type not in FILE_TYPES:
        raise ValueError(f"file type {file_type!r}: choose one of {', '.join(FILE_TYPES)}")
    model_dir, dest = Path(model_dir), Path(dest)
    config = json.loads((model_dir / "config.json").read_text())
    if config.get("quantization"):
        raise ValueError("write GGUF files from float models only")
    if encoders.spec_for_model_type(str(config.get("model_type"))):
        return _write_encoder(model_dir, dest, file_type, config)
    arch, kv = arches.gguf_metadata(config)
    kv = {**kv, **gguf_tokenizer_fields(model_dir)}
    if (model_dir / "modules.json").exists():  # an embedding model (Qwen3-Embedding)
        kv[f"{arch}.pooling_type"] = _pooling_type(model_dir)
    tensors = arches.stack_experts(_load_float32(model_dir))
    if arch == "gemma-embedding":
        # (the base model's names, `layers.0...`; its Dense modules as dense_2, dense_3)
        tensors = {n if n.startswith("model.") else f"model.{n}": x for n, x in tensors.items()}
        for stem, hf_stem in arches.DENSE_MODULES.items():
            folder = model_dir / hf_stem.split("/")[0]
            if (folder / "model.safetensors").exists():
                x = _load_float32(folder)["linear.weight"]
                tensors[f"{hf_stem}.weight"] = x
                kv[f"{arch}.{stem}_feat_in"], kv[f"{arch}.{stem}_feat_out"] = x.shape[1], x.shape[0]
    writer = _writer(dest, arch, kv, file_type, config, model_dir)
    names = {arches.gguf_tensor_name(arch, hf_name) for hf_name in tensors}
    head = "output.weight" if "output.weight" in names else "token_embd.weight"
    layers = int(config.get("num_hidden_layers", 0))
    for hf_name in sorted(tensors):
        x = tensors[hf_name]
        name = arches.gguf_tensor_name(arch, hf_name)
        order = arches.gguf_row_order(arch, hf_name, config)
        if order is not None:
            x = x[order]
        offset = arches.value_offset(arch, hf_name)
        if offset:
            x = x - np.float32(offset)  # the inverse of the reader's offset
        data, raw = _encode(np.ascontiguousarray(x),
                            _tensor_type(file_type, name, x.shape, layers, head))
        writer.add_tensor(name, data, raw_dtype=raw)
    for name, x in arches.gguf_extra_tensors(config).items():
        writer.add_tensor(name, np.asarray(x, np.float32))
    return _finish(writer, dest)


def _writer(dest: Path, arch: str, kv: dict[str, Any], file_type: str, config: dict,
            model_dir: Path):
    from gguf import GGUFWriter, LlamaFileType

    ftype = {"F32": "ALL_F32", "Q4_K": "MOSTLY_Q4_K_S",
             "MXFP4": "MOSTLY_MXFP4_MOE"}.get(file_type, "MOSTLY_" + file_type)
    kv = {**kv, "general.file_type": int(LlamaFileType[ftype])}
    kv.setdefault("general.name", str(config.get("mlxr_random_preset") or model_dir.name))
    writer = GGUFWriter(str(dest), arch)
    for key, value in kv.items():
        if key != "general.architecture":
            _add_kv(writer, key, value)
    return writer


def _finish(writer, dest: Path) -> Path:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dest


def _pooling_type(model_dir: Path) -> int:
    """llama.cpp's pooling type for the directory's sentence-transformers pooling."""
    from mlxr.shared.sentence_transformers import read_pooling_config

    from .pooling import POOLING

    modes = read_pooling_config(model_dir).modes
    kind = next((k for k, mode in POOLING.items() if [mode] == modes), None)
    if kind is None:
        raise ValueError(f"pooling {modes} has no GGUF form")
    return kind


def _write_encoder(model_dir: Path, dest: Path, file_type: str, config: dict) -> Path:
    """An encoder as llama.cpp's converter writes it: its pooling from the sentence-transformers
    files (mean where they say nothing), the WordPiece vocabulary in phantom-space form, the
    weights under GGUF names (the pooler and masked-LM heads left out, the position and token
    type tables kept F32, as llama.cpp does: its CPU adds no F16 row to F32)."""
    from . import encoders, unigram, wordpiece

    arch, kv = encoders.gguf_metadata(config, _pooling_type(model_dir))
    if config.get("model_type") == "xlm-roberta":  # SentencePiece Unigram, as "t5"
        kv = {**kv, **unigram.gguf_fields(model_dir)}
    else:
        kv = {**kv, **wordpiece.gguf_fields(model_dir, config.get("vocab_size"))}
    writer = _writer(dest, arch, kv, file_type, config, model_dir)
    offset = encoders.position_offset(config)
    for hf_name, x in sorted(_load_float32(model_dir).items()):
        hf_name = hf_name.removeprefix("bert.").removeprefix("roberta.")
        if hf_name.startswith(("pooler.", "cls.", "lm_head.", "embeddings.position_ids")):
            continue
        if hf_name == "embeddings.position_embeddings.weight":
            x = x[offset:]  # (XLM-RoBERTa's rows before its first position)
        name = encoders.gguf_tensor_name(arch, hf_name)
        kind = _tensor_type("F32" if name in encoders.F32_TENSORS else file_type, name, x.shape)
        data, raw = _encode(np.ascontiguousarray(x), kind)
        writer.add_tensor(name, data, raw_dtype=raw)
    return _finish(writer, dest)
