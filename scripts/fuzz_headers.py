"""Coverage-guided fuzzing (atheris, libFuzzer) of the model-file header parsers: what a
hostile safetensors file, GGUF file or config.json meets before anything loads its weights.

    .venv/bin/python scripts/fuzz_headers.py TARGET [SECONDS] [libFuzzer flags...]
    .venv/bin/python scripts/fuzz_headers.py all 60        # every target, 60 s each

Targets:
  safetensors      shared/model_checks.py: the 8-byte length, the JSON header, every entry
  safetensors-mlx  well-formed files the input describes (dtypes, shapes with extreme
                   dimensions, offsets mostly consistent), checked, and mx.load + eval of every
                   one the checks accept: a crash there (a file the checks let through that
                   takes MLX down) is a finding
  config           shared/model_checks.py: config.json (JSON, model_type, dimensions, quantization)
  gguf             supervisor/store/gguf: read_gguf (both modes), check_supported, the converted
                   config.json and tokenizer files derived from the header, from mutated bytes
  gguf-meta        the same from well-formed files the input describes (an architecture,
                   hyperparameters of any type and value, tokenizer metadata, tensors of any
                   name, shape and type), and a whole conversion of every file the checks
                   accept: the semantic faults byte mutation rarely reaches

A finding is any exception other than MlxrError (the clear errors these parsers promise), a
crash, a run over 10 s or over 2 GiB of memory. libFuzzer stops at the first one and writes the
input to build/fuzz/TARGET/crash-* (replay: the script, the target and that file's path).
The corpus starts from small valid files made here and grows in build/fuzz/TARGET/corpus.
Each run ends with libFuzzer's final statistics (executions, exec/s, coverage, peak memory).
"""

from __future__ import annotations

import json
import logging
import struct
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import atheris

ROOT = Path(__file__).resolve().parent.parent
TARGETS = ("safetensors", "safetensors-mlx", "config", "gguf", "gguf-meta")
DEFAULT_SECONDS = 60

with atheris.instrument_imports(include=["mlxr"]):  # (modules imported later are not)
    from mlxr.shared import model_checks
    from mlxr.shared.errors import MlxrError
    from mlxr.supervisor.store.gguf import (arch, checks, convert, header,  # noqa: F401
                                            quants, tokenizer)

logging.disable(logging.WARNING)  # the tokenizer's warnings about odd inputs, per input

# Words libFuzzer splices into inputs (its -dict, in its quoted syntax), per target.
WORDS = {
    "safetensors": ['"dtype"', '"shape"', '"data_offsets"', '"__metadata__"', '"F32"', '"BF16"',
                    '"U32"', '"F4"', '"BOOL"', '"18446744073709551615"', '"2147483648"', '"-1"'],
    "config": ['"model_type"', '"hidden_size"', '"num_hidden_layers"', '"vocab_size"',
               '"text_config"', '"quantization"', '"bits"', '"group_size"', '"1e308"', '"-1"',
               '"1000000000"', '"true"', '"null"', '"4.5"'],
    "gguf": ['"general.architecture"', '"llama.block_count"', '"llama.embedding_length"',
             '"llama.attention.head_count"', '"tokenizer.ggml.model"', '"tokenizer.ggml.tokens"',
             '"tokenizer.ggml.merges"', '"general.alignment"', '"blk.0.attn_q.weight"',
             '"\\xff\\xff\\xff\\xff\\xff\\xff\\xff\\x7f"', '"\\x09\\x00\\x00\\x00"'],
}
WORDS["safetensors-mlx"] = []
WORDS["gguf-meta"] = []


# -- seeds: small valid inputs ------------------------------------------------------------
def safetensors_file(tensors: dict[str, tuple[str, list[int], bytes]],
                     metadata: dict[str, str] | None = None) -> bytes:
    header: dict = {"__metadata__": metadata} if metadata else {}
    data = b""
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape,
                        "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


def safetensors_seeds() -> list[bytes]:
    return [
        safetensors_file({"w": ("F32", [2, 3], bytes(24)), "b": ("F16", [3], bytes(6))},
                         {"format": "pt"}),
        safetensors_file({"q.weight": ("U32", [4, 1], bytes(16)),
                          "q.scales": ("BF16", [4, 1], bytes(8)),
                          "q.biases": ("BF16", [4, 1], bytes(8)), "e": ("F32", [0], b"")},
                         {"format": "mlx"}),
        safetensors_file({"m": ("BOOL", [1], b"\1"), "x": ("I64", [1, 1, 1], bytes(8)),
                          "f": ("F4", [2], b"\0")}),
        safetensors_file({}),
    ]


def config_seeds() -> list[bytes]:
    qwen3 = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 64,
             "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
             "head_dim": 32, "intermediate_size": 256, "vocab_size": 2048,
             "max_position_embeddings": 4096, "rope_theta": 1e6, "tie_word_embeddings": False}
    quantized = {**qwen3, "quantization": {"group_size": 64, "bits": 4, "mode": "affine",
                                           "model.layers.0.mlp.down_proj": {"bits": 8,
                                                                             "group_size": 64},
                                           "lm_head": False}}
    gemma3 = {"model_type": "gemma3", "text_config": {"model_type": "gemma3_text",
                                                      "hidden_size": 2560, "sliding_window": 1024,
                                                      "num_hidden_layers": 34},
              "vision_config": {"hidden_size": 1152, "num_hidden_layers": 27},
              "quantization_config": {"quant_method": "gptq", "bits": 4}}
    bert = {"model_type": "bert", "hidden_size": 384, "num_hidden_layers": 6,
            "vocab_size": 30522, "max_position_embeddings": 512, "head_dim": None}
    return [json.dumps(c).encode() for c in (qwen3, quantized, gemma3, bert)]


def gguf_file(arch: str, kv: dict, tensors: dict[str, tuple[object, object]]) -> bytes:
    import gguf as g

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "seed.gguf"
        w = g.GGUFWriter(str(path), arch)
        for key, value in kv.items():
            if isinstance(value, bool):
                w.add_bool(key, value)
            elif isinstance(value, int):
                w.add_uint32(key, value)
            elif isinstance(value, float):
                w.add_float32(key, value)
            elif isinstance(value, str):
                w.add_string(key, value)
            else:
                w.add_array(key, value)
        for name, (data, raw_dtype) in tensors.items():
            w.add_tensor(name, data, raw_dtype=raw_dtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return path.read_bytes()


def gguf_seeds() -> list[bytes]:
    import gguf as g
    import numpy as np

    T = g.GGMLQuantizationType
    x = np.linspace(-1, 1, 8 * 32, dtype=np.float32).reshape(8, 32)
    gpt2 = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "llama-bpe",
            "tokenizer.ggml.tokens": ["a", "b", "ab", "Ġ", "<|eot_id|>", "c", "d", "cd"],
            "tokenizer.ggml.token_type": [1, 1, 1, 1, 3, 1, 1, 1],
            "tokenizer.ggml.merges": ["a b", "c d"], "tokenizer.ggml.eos_token_id": 4,
            "tokenizer.ggml.bos_token_id": 0, "tokenizer.chat_template": "{{ messages }}"}
    spm = {"tokenizer.ggml.model": "llama",
           "tokenizer.ggml.tokens": ["<unk>", "<s>", "</s>", "▁", "a", "b", "▁a", "ab"],
           "tokenizer.ggml.scores": [0.0, 0.0, 0.0, -1.0, -2.0, -3.0, -4.0, -5.0],
           "tokenizer.ggml.token_type": [2, 3, 3, 1, 1, 1, 1, 1],
           "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2}
    tensors = {"token_embd.weight": (g.quants.quantize(x, T.Q8_0), T.Q8_0),
               "output_norm.weight": (np.ones(32, np.float32), None),
               "blk.0.attn_q.weight": (x.astype(np.float16), None),
               "blk.0.ffn_down.weight": (g.quants.quantize(x, T.Q4_0), T.Q4_0)}
    hp = {"embedding_length": 32, "block_count": 1, "feed_forward_length": 64,
          "attention.head_count": 2, "attention.head_count_kv": 1, "context_length": 128}
    return [
        gguf_file("llama", {**{f"llama.{k}": v for k, v in hp.items()},
                            "llama.rope.freq_base": 500000.0, **gpt2},
                  {**tensors, "rope_freqs.weight": (np.ones(8, np.float32), None)}),
        gguf_file("qwen3", {**{f"qwen3.{k}": v for k, v in hp.items()},
                            "qwen3.attention.key_length": 16, **gpt2}, tensors),
        gguf_file("gemma3", {**{f"gemma3.{k}": v for k, v in hp.items()},
                             "gemma3.attention.sliding_window_pattern": [True],
                             "gemma3.attention.sliding_window": 64, **spm}, tensors),
        gguf_file("phi3", {**{f"phi3.{k}": v for k, v in hp.items()},
                           "phi3.rope.scaling.original_context_length": 64, **spm},
                  {**tensors, "rope_factors_long.weight": (np.ones(8, np.float32), None)}),
    ]


def recipe_seeds() -> list[bytes]:
    """Inputs of the targets that read them as recipes (FuzzedDataProvider), not files."""
    return [bytes(range(256)) * 4, bytes(1024), b"\xff" * 1024]


# -- gguf-meta: a GGUF file described by the input ----------------------------------------
U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 = range(13)
_PACK = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f", BOOL: "<?",
         U64: "<Q", I64: "<q", F64: "<d"}
INTERESTING = [0, 1, 2, 3, 4, 7, 8, 16, 31, 32, 33, 64, 128, 255, 256, 4096, 65535, 65536,
               (1 << 31) - 1, 1 << 31, (1 << 32) - 1, 1 << 32, (1 << 63) - 1, (1 << 64) - 1]
ARCHES = ["llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "granite", "bert", "", "x"]
HPARAMS = ["block_count", "embedding_length", "feed_forward_length", "attention.head_count",
           "attention.head_count_kv", "attention.key_length", "attention.value_length",
           "attention.head_dim", "context_length", "vocab_size", "rope.freq_base",
           "rope.global.freq_base", "rope.local.freq_base", "rope.dimension_count",
           "attention.layer_norm_rms_epsilon", "rope.scaling.type", "rope.scaling.factor",
           "rope.scaling.original_context_length", "rope.scaling.yarn_beta_fast",
           "rope.scaling.beta_slow", "rope.freq_scale", "attention.sliding_window",
           "attention.sliding_window_pattern", "final_logit_softcapping",
           "attn_logit_softcapping", "attention.scale", "embedding_scale", "residual_scale",
           "logit_scale", "rope.freq_base_swa", "tensor_data_layout"]
TOKENIZER = ["tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
             "tokenizer.ggml.eot_token_id", "tokenizer.ggml.padding_token_id",
             "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.add_bos_token",
             "tokenizer.ggml.add_eos_token", "tokenizer.ggml.add_space_prefix",
             "tokenizer.ggml.pre", "tokenizer.chat_template", "general.alignment",
             "general.file_type"]
TENSORS = ["token_embd.weight", "output.weight", "output_norm.weight", "rope_freqs.weight",
           "rope_factors_long.weight", "rope_factors_short.weight", "blk.0.attn_q.weight",
           "blk.0.attn_k.weight", "blk.0.attn_v.weight", "blk.0.attn_output.weight",
           "blk.0.attn_norm.weight", "blk.0.ffn_up.weight", "blk.0.ffn_down.weight",
           "blk.0.attn_q.bias", "blk.0.attn_q_norm.weight", "blk.1.ffn_norm.weight",
           "blk.0.attn_qkv.weight", "v.blk.0.x.weight", "x"]
TYPES = [0, 1, 2, 3, 6, 7, 8, 10, 11, 12, 13, 14, 16, 24, 30, 39, 99]


def _string(text: str | bytes) -> bytes:
    data = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    return struct.pack("<Q", len(data)) + data


def _float(fmt: str, x: float) -> bytes:
    try:
        return struct.pack(fmt, x)
    except OverflowError:  # past float32's range: its infinity
        return struct.pack(fmt, float("inf") if x > 0 else float("-inf"))


def _int(fdp) -> int:
    return fdp.PickValueInList(INTERESTING) if fdp.ConsumeBool() else fdp.ConsumeIntInRange(0, 300)


def _scalar(fdp, vtype: int) -> bytes:
    if vtype == STRING:
        return _string(fdp.ConsumeUnicode(fdp.ConsumeIntInRange(0, 12)))
    if vtype in (F32, F64):
        return _float(_PACK[vtype], fdp.ConsumeFloat())
    if vtype == BOOL:
        return struct.pack("<?", fdp.ConsumeBool())
    bits = struct.calcsize(_PACK[vtype]) * 8
    signed = vtype in (I8, I16, I32, I64)
    value = _int(fdp) % (1 << bits)
    if signed and value >= 1 << (bits - 1):
        value -= 1 << bits
    return struct.pack(_PACK[vtype], value)


def _value(fdp) -> tuple[int, bytes]:
    vtype = fdp.ConsumeIntInRange(0, 12)
    return vtype, _value_of(fdp, vtype, 0)


def _value_of(fdp, vtype: int, depth: int) -> bytes:
    if vtype == ARRAY:  # nested up to 6 deep: the reader takes 4
        etype = fdp.ConsumeIntInRange(0, 12 if depth < 5 else 8)
        count = fdp.ConsumeIntInRange(0, 8 if depth == 0 else 2)
        return struct.pack("<IQ", etype, count) + b"".join(
            _value_of(fdp, etype, depth + 1) for _ in range(count))
    return _scalar(fdp, vtype)


def _entry(key: str, vtype: int, payload: bytes) -> bytes:
    return _string(key) + struct.pack("<I", vtype) + payload


def _array(etype: int, items: list[bytes]) -> bytes:
    return struct.pack("<IQ", etype, len(items)) + b"".join(items)


def gguf_from_recipe(fdp) -> bytes:
    """A GGUF file the fuzz input describes; offsets are laid out properly unless the input
    says otherwise, so most inputs reach the checks after the header's own."""
    arch = fdp.PickValueInList(ARCHES)
    kvs = [_entry("general.architecture", STRING, _string(arch))]
    for key in HPARAMS:
        if fdp.ConsumeBool():
            if fdp.ConsumeProbability() < 0.7:  # the usual type, an interesting value
                kvs.append(_entry(f"{arch}.{key}", U32, struct.pack("<I", _int(fdp) % (1 << 32))))
            else:
                kvs.append(_entry(f"{arch}.{key}", *_value(fdp)))
    n_tokens = fdp.ConsumeIntInRange(0, 10)
    if fdp.ConsumeProbability() < 0.9:
        kvs.append(_entry("tokenizer.ggml.model", STRING,
                          _string(fdp.PickValueInList(["gpt2", "llama", "bert", ""]))))
    if fdp.ConsumeProbability() < 0.9:
        tokens = [_string(fdp.PickValueInList(["a", "b", "ab", "▁", "▁a", " ", "<|eot_id|>",
                                               "<s>", "", "abab"])) for _ in range(n_tokens)]
        kvs.append(_entry("tokenizer.ggml.tokens", ARRAY, _array(STRING, tokens)))
    if fdp.ConsumeBool():
        n = n_tokens if fdp.ConsumeProbability() < 0.8 else fdp.ConsumeIntInRange(0, 10)
        kvs.append(_entry("tokenizer.ggml.token_type", ARRAY, _array(
            I32, [struct.pack("<i", fdp.ConsumeIntInRange(-1, 7)) for _ in range(n)])))
    if fdp.ConsumeBool():
        n = n_tokens if fdp.ConsumeProbability() < 0.8 else fdp.ConsumeIntInRange(0, 10)
        kvs.append(_entry("tokenizer.ggml.scores", ARRAY, _array(
            F32, [_float("<f", fdp.ConsumeFloat()) for _ in range(n)])))
    if fdp.ConsumeBool():
        merges = [_string(fdp.PickValueInList(["a b", "ab ab", "a", "", "▁ a", "a  b"]))
                  for _ in range(fdp.ConsumeIntInRange(0, 4))]
        kvs.append(_entry("tokenizer.ggml.merges", ARRAY, _array(STRING, merges)))
    for key in TOKENIZER:
        if fdp.ConsumeBool():
            kvs.append(_entry(key, *_value(fdp)) if fdp.ConsumeBool() else
                       _entry(key, U32, struct.pack("<I", fdp.ConsumeIntInRange(0, 12))))
    infos, data, offset = [], b"", 0
    for _ in range(fdp.ConsumeIntInRange(0, 6)):
        name = fdp.PickValueInList(TENSORS)
        ne = [fdp.PickValueInList([1, 2, 4, 8, 32, 64, 256, 3, 0, 1 << 31, 1 << 32])
              for _ in range(fdp.ConsumeIntInRange(0, 3))]
        ggml_type = fdp.PickValueInList(TYPES)
        size = _tensor_bytes(ne, ggml_type)
        if fdp.ConsumeProbability() < 0.1:
            offset = _int(fdp)
        infos.append(_string(name) + struct.pack("<I", len(ne)) +
                     b"".join(struct.pack("<Q", n) for n in ne) +
                     struct.pack("<IQ", ggml_type, offset % (1 << 64)))
        size = min(size, 1 << 16)
        data += bytes(range(256)) * (size // 256) + bytes(size % 256) + bytes(-size % 32)
        offset += size + (-size % 32)
    head = b"GGUF" + struct.pack("<IQQ", 3, len(infos), len(kvs)) + b"".join(kvs) + \
        b"".join(infos)
    return head + bytes(-len(head) % 32) + data[:len(data) - fdp.ConsumeIntInRange(0, 2) * 8]


def _tensor_bytes(ne: list[int], ggml_type: int) -> int:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError):
        return 0
    n = 1
    for d in ne:
        n *= d
    return n // block * size


# -- targets ------------------------------------------------------------------------------
def fuzz_safetensors(data: bytes) -> None:
    try:
        model_checks.safetensors_header_of("model.safetensors", data)
    except MlxrError:
        pass


def safetensors_from_recipe(fdp) -> bytes:
    """A safetensors file the fuzz input describes: byte ranges laid out to fit their shapes
    unless the input says otherwise, so most inputs pass the checks and reach MLX."""
    header: dict = {}
    if fdp.ConsumeBool():
        header["__metadata__"] = {"format": fdp.PickValueInList(["mlx", "pt", ""])}
    offset = 0
    for i in range(fdp.ConsumeIntInRange(0, 4)):
        dtype = fdp.PickValueInList(list(model_checks.DTYPE_BITS) + ["Q4", "f32"])
        shape = [fdp.PickValueInList([0, 1, 2, 3, 8, 255, (1 << 31) - 1, 1 << 31, 1 << 32,
                                      (1 << 63) - 1, 1 << 64])
                 if fdp.ConsumeProbability() < 0.3 else fdp.ConsumeIntInRange(0, 6)
                 for _ in range(fdp.ConsumeIntInRange(0, 4))]
        n = model_checks.DTYPE_BITS.get(dtype, 8)
        for d in shape:
            n *= d
        if fdp.ConsumeProbability() < 0.2:  # the size a parser with 64-bit sizes would expect
            n %= 1 << 64
        size = min(n // 8, 1 << 12)
        begin = offset if fdp.ConsumeProbability() < 0.9 else fdp.ConsumeIntInRange(0, 64)
        end = begin + size if fdp.ConsumeProbability() < 0.9 else fdp.ConsumeIntInRange(0, 64)
        header[f"t{i}"] = {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}
        offset = max(offset, end)
    text = json.dumps(header).encode()
    data = bytes(range(256)) * (offset // 256) + bytes(offset % 256)
    return struct.pack("<Q", len(text)) + text + data[:max(0, offset -
                                                           fdp.ConsumeIntInRange(0, 1) * 4)]


def make_fuzz_safetensors_mlx(work: Path):
    import mlx.core as mx

    path = work / "input.safetensors"

    def run(data: bytes) -> None:
        data = safetensors_from_recipe(atheris.FuzzedDataProvider(data))
        try:
            model_checks.safetensors_header_of("model.safetensors", data)
        except MlxrError:
            return
        path.write_bytes(data)
        try:
            arrays = mx.load(str(path))
        except (RuntimeError, ValueError):  # MLX's own clean refusal: not a finding
            return
        mx.eval([a.sum() for a in arrays.values()])  # every element read, as a model would

    return run


def fuzz_config(data: bytes) -> None:
    try:
        model_checks.config_of(data)
    except MlxrError:
        pass


def make_fuzz_gguf(work: Path, *, from_recipe: bool = False):
    path, out = work / "input.gguf", work / "converted"

    def run(data: bytes) -> None:
        if from_recipe:
            data = gguf_from_recipe(atheris.FuzzedDataProvider(data))
        path.write_bytes(data)
        try:
            header.read_gguf(path, skip_arrays=True)
            gguf = header.read_gguf(path)
            summary = convert.check_supported(path, gguf)
            convert.hf_config_of(gguf, summary)
            tokenizer.hf_tokenizer_files(summary.kv)
        except MlxrError:
            return
        if from_recipe:  # everything the checks accept must convert, or fail with a 4xx
            shutil.rmtree(out, ignore_errors=True)
            try:
                convert.convert(path, out, float_dtype="float32")
            except MlxrError:
                pass

    return run


# -- running ------------------------------------------------------------------------------
def run_target(target: str, seconds: int, extra: list[str]) -> None:
    base = ROOT / "build" / "fuzz" / target
    corpus = base / "corpus"
    corpus.mkdir(parents=True, exist_ok=True)
    seeds = {"safetensors": safetensors_seeds, "config": config_seeds, "gguf": gguf_seeds,
             "gguf-meta": recipe_seeds, "safetensors-mlx": recipe_seeds}[target]
    for i, seed in enumerate(seeds()):
        (corpus / f"seed-{i}").write_bytes(seed)
    words = base / "words.dict"
    words.write_text("".join(f"w{i}={w}\n" for i, w in enumerate(WORDS[target])))
    work = base / "work"  # the files a target writes, one at a time
    work.mkdir(exist_ok=True)
    fn = {"safetensors": lambda: fuzz_safetensors, "config": lambda: fuzz_config,
          "gguf": lambda: make_fuzz_gguf(work),
          "gguf-meta": lambda: make_fuzz_gguf(work, from_recipe=True),
          "safetensors-mlx": lambda: make_fuzz_safetensors_mlx(work)}[target]()
    max_len = 65536 if target == "gguf" else 8192
    argv = [sys.argv[0], f"-max_total_time={seconds}", "-timeout=10", "-rss_limit_mb=2048",
            f"-max_len={max_len}", *([f"-dict={words}"] if WORDS[target] else []),
            f"-artifact_prefix={base}/", "-print_final_stats=1", *extra, str(corpus)]
    replay = [a for a in extra if not a.startswith("-")]
    if replay:  # files named: run them once (libFuzzer's replay mode)
        argv = [sys.argv[0], f"-artifact_prefix={base}/", *extra]
    atheris.Setup(argv, fn)
    atheris.Fuzz()


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in (*TARGETS, "all"):
        print(__doc__, file=sys.stderr)
        return 64
    target = argv[0]
    seconds = int(argv[1]) if len(argv) > 1 and argv[1].isdigit() else DEFAULT_SECONDS
    extra = argv[2:] if len(argv) > 1 and argv[1].isdigit() else argv[1:]
    if target != "all":
        run_target(target, seconds, extra)
        return 0
    failed = []
    for name in TARGETS:
        print(f"== fuzzing {name} for {seconds} s", flush=True)
        code = subprocess.call([sys.executable, __file__, name, str(seconds), *extra])
        if code != 0:
            failed.append(name)
    if failed:
        print("findings in: " + ", ".join(failed) + " (see build/fuzz/<target>/crash-*)",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
