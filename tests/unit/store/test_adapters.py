"""LoRA adapters at create time (no MLX): which files make an adapter, PEFT's weights renamed
and transposed byte for byte into mlx-lm's layout (float32 and bfloat16), the checks against
the base model's weights, and Ollama's quantization names."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from mlxr.shared.errors import InvalidRequest
from mlxr.supervisor.store.adapters import check_base, read_adapter, write_weights
from mlxr.supervisor.store.modelfile import parse_modelfile
from mlxr.supervisor.store.quantize import QUANT_TYPES, parse_quantize

HIDDEN, INTER, RANK = 8, 12, 2


def base_model(path, bits=None):
    path.mkdir(parents=True, exist_ok=True)
    config = {"model_type": "qwen3", "num_hidden_layers": 2}
    weights = {}
    for layer in range(2):
        weights[f"model.layers.{layer}.self_attn.q_proj.weight"] = np.zeros((HIDDEN, HIDDEN),
                                                                            np.float32)
        weights[f"model.layers.{layer}.mlp.up_proj.weight"] = np.zeros((INTER, HIDDEN),
                                                                       np.float32)
    if bits:  # packed as MLX stores quantized weights: in * bits / 32 uint32 columns
        config["quantization"] = {"bits": bits, "group_size": 64}
        weights = {k: np.zeros((v.shape[0], v.shape[1] * bits // 32), np.uint32)
                   for k, v in weights.items()}
    save_file(weights, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config))
    return {"config.json": path / "config.json", "model.safetensors": path / "model.safetensors"}


def peft_adapter(path, tensors=None, **config):
    path.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    tensors = tensors if tensors is not None else {
        "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight":
            rng.normal(size=(RANK, HIDDEN)).astype(np.float32),
        "base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight":
            rng.normal(size=(HIDDEN, RANK)).astype(np.float32),
        "base_model.model.model.layers.1.mlp.up_proj.lora_A.weight":
            rng.normal(size=(RANK, HIDDEN)).astype(np.float32),
        "base_model.model.model.layers.1.mlp.up_proj.lora_B.weight":
            rng.normal(size=(INTER, RANK)).astype(np.float32)}
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": RANK, "lora_alpha": 16, "target_modules": ["q_proj"],
         **config}))
    return {"adapter_config.json": path / "adapter_config.json",
            "adapter_model.safetensors": path / "adapter_model.safetensors"}, tensors


def test_a_peft_adapter_becomes_mlx_lm_names_layout_and_scale(tmp_path):
    files, tensors = peft_adapter(tmp_path / "peft")
    adapter = read_adapter(files)
    check_base(adapter, base_model(tmp_path / "base"))
    out = load_file(str(write_weights(adapter, tmp_path / "out.safetensors")))
    for name, value in tensors.items():
        module = name.removeprefix("base_model.model.").rsplit(".lora_", 1)[0]
        leaf = "lora_a" if ".lora_A." in name else "lora_b"
        assert np.array_equal(out[f"{module}.{leaf}"], value.T)
    assert json.loads(adapter.config_bytes()) == {
        "fine_tune_type": "lora", "num_layers": 1, "lora_parameters": {
            "rank": RANK, "scale": 8.0, "dropout": 0.0,
            "keys": ["mlp.up_proj", "self_attn.q_proj"]}}
    rslora = read_adapter(peft_adapter(tmp_path / "rs", use_rslora=True)[0])
    assert rslora.scale == pytest.approx(16 / np.sqrt(RANK))


def test_bfloat16_tensors_are_transposed_bit_for_bit(tmp_path):
    files, _ = peft_adapter(tmp_path / "peft")
    path = files["adapter_model.safetensors"]  # rewrite as BF16: the top 16 bits of float32
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    body, chunks, offset, halves = data[8 + length:], [], 0, {}
    for name in sorted(k for k in header if k != "__metadata__"):
        begin, end = header[name]["data_offsets"]
        bits = (np.frombuffer(body[begin:end], "<u4") >> 16).astype("<u2")
        halves[name] = bits.reshape(header[name]["shape"])
        chunks.append(bits.tobytes())
        header[name] = {"dtype": "BF16", "shape": header[name]["shape"],
                        "data_offsets": [offset, offset + len(chunks[-1])]}
        offset += len(chunks[-1])
    header.pop("__metadata__", None)
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(chunks))
    adapter = read_adapter(files)
    check_base(adapter, base_model(tmp_path / "base"))
    written = write_weights(adapter, tmp_path / "out.safetensors").read_bytes()
    (length,) = struct.unpack("<Q", written[:8])
    out_header = json.loads(written[8:8 + length])
    name = "base_model.model.model.layers.1.mlp.up_proj.lora_B.weight"
    entry = out_header["model.layers.1.mlp.up_proj.lora_b"]
    begin, end = entry["data_offsets"]
    got = np.frombuffer(written[8 + length + begin:8 + length + end], "<u2")
    assert entry["dtype"] == "BF16" and entry["shape"] == [RANK, INTER]
    assert np.array_equal(got.reshape(RANK, INTER), halves[name].T)


def test_a_quantized_base_is_checked_by_its_unpacked_shapes(tmp_path):
    files, _ = peft_adapter(tmp_path / "peft")
    check_base(read_adapter(files), base_model(tmp_path / "q4", bits=4))


@pytest.mark.parametrize("config, tensors, message", [
    ({"use_dora": True}, None, "unsupported PEFT adapter: use_dora"),
    ({"modules_to_save": ["lm_head"]}, None, "unsupported PEFT adapter: modules_to_save"),
    ({"fan_in_fan_out": True}, None, "fan_in_fan_out"),
    ({"peft_type": "IA3"}, None, "peft_type IA3"),
    ({"r": 4}, None, "not rank 4"),
    ({}, {"base_model.model.lm_head.lora_A.weight": np.zeros((RANK, HIDDEN), np.float32)},
     "outside the decoder layers"),
    ({}, {"base_model.model.model.layers.1.self_attn.k_proj.lora_A.weight":
          np.zeros((RANK, HIDDEN), np.float32)}, "has no linear weight layers.1.self_attn.k_proj"),
    ({}, {"base_model.model.model.layers.1.mlp.up_proj.lora_B.weight":
          np.zeros((HIDDEN, RANK), np.float32)}, "needs [2, 12]"),
    ({}, {"base_model.model.model.embed_tokens.lora_embedding_A":
          np.zeros((RANK, HIDDEN), np.float32)}, "unsupported PEFT adapter tensor"),
    ({}, {"base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight":
          np.zeros((RANK, HIDDEN), np.int32)}, "has dtype I32"),
])
def test_what_cannot_be_applied_exactly_is_refused(tmp_path, config, tensors, message):
    files, _ = peft_adapter(tmp_path / "peft", tensors, **config)
    with pytest.raises(InvalidRequest, match=message.replace("[", r"\[")):
        check_base(read_adapter(files), base_model(tmp_path / "base"))


def test_mlx_lm_adapters_respect_num_layers_and_keys(tmp_path):
    path = tmp_path / "mlx"
    path.mkdir()
    save_file({"model.layers.0.self_attn.q_proj.lora_a": np.zeros((HIDDEN, RANK), np.float32)},
              str(path / "adapters.safetensors"))
    files = {"adapters.safetensors": path / "adapters.safetensors",
             "adapter_config.json": path / "adapter_config.json"}
    base = base_model(tmp_path / "base")
    for params, num_layers, message in (
            ({"keys": ["mlp.up_proj"]}, 2, "not among lora_parameters.keys"),
            ({}, 1, "not among the last 1 layers"),
            ({}, 2, None)):
        (path / "adapter_config.json").write_text(json.dumps(
            {"fine_tune_type": "lora", "num_layers": num_layers,
             "lora_parameters": {"rank": RANK, "scale": 2.0, **params}}))
        if message is None:
            check_base(read_adapter(files), base)
        else:
            with pytest.raises(InvalidRequest, match=message):
                check_base(read_adapter(files), base)
    (path / "adapter_config.json").write_text(json.dumps(
        {"fine_tune_type": "full", "lora_parameters": {"rank": 2, "scale": 1}}))
    with pytest.raises(InvalidRequest, match='fine_tune_type "full" is not supported'):
        read_adapter(files)
    with pytest.raises(InvalidRequest, match="GGUF adapters are not supported"):
        read_adapter({"adapter.gguf": path / "adapters.safetensors"})
    with pytest.raises(InvalidRequest, match="must include adapter_config.json"):
        read_adapter({"adapters.safetensors": path / "adapters.safetensors"})


def test_adapter_in_a_modelfile():
    parsed = parse_modelfile("FROM base\nADAPTER ./lora\nSYSTEM hi\n")
    assert (parsed.from_, parsed.adapter, parsed.system) == ("base", "./lora", "hi")


@pytest.mark.parametrize("name, bits", [
    ("q4_K_M", 4), ("Q4_K_S", 4), ("q4_0", 4), ("q4_1", 4), ("int4", 4), ("Q4", 4),
    ("q5_k_m", 5), ("Q5_0", 5), ("q6_K", 6), ("q8_0", 8), ("INT8", 8), ("q8", 8)])
def test_ollama_quantization_names_map_to_mlx_bits(name, bits):
    choice = parse_quantize(name)
    assert (choice.name, choice.bits, choice.group_size) == (name.upper(), bits, 64)
    assert choice.describe() == f"{name.upper()} (MLX {bits}-bit, group size 64)"


def test_an_unknown_quantization_lists_the_accepted_names():
    with pytest.raises(InvalidRequest) as err:
        parse_quantize("q3_K_M")
    assert err.value.message.startswith('unsupported quantization type "q3_K_M": supported '
                                        "types are " + ", ".join(QUANT_TYPES))
