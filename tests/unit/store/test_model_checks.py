"""Hostile model files: each malformed safetensors header or config.json is refused with
InvalidModelFile naming the file and the fault, nothing is sized by a length taken from the
file, and real model directories pass."""

from __future__ import annotations

import json
import struct
import tracemalloc

import numpy as np
import pytest
from safetensors.numpy import save_file

from mlxr.shared.errors import InvalidModelFile, InvalidRequest
from mlxr.shared.model_checks import (MAX_CONFIG_BYTES, MAX_HEADER_BYTES, check_model_dir,
                                      check_model_files, config_of, model_files, read_config,
                                      read_safetensors_header, safetensors_header_of)
from mlxr.supervisor.store.random_model import write_random_model


def st(header: object, data: bytes = b"", length: int | None = None) -> bytes:
    """A safetensors file: 8-byte length, the header (JSON unless bytes), the data."""
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(text) if length is None else length) + text + data


def entry(dtype: str = "F32", shape=(2,), offsets=(0, 8)) -> dict:
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


GOOD = {"__metadata__": {"format": "mlx"}, "w": entry("F32", [2, 2], [0, 16]),
        "b": entry("BF16", [3], [16, 22]), "empty": entry("F16", [0, 4], [22, 22]),
        "f4": entry("F4", [4], [22, 24])}


def test_a_valid_header_is_read_without_its_data(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(st(GOOD, bytes(24)))
    header = read_safetensors_header(path)
    assert header.metadata == {"format": "mlx"}
    assert {n: (t.dtype, t.shape, t.begin, t.end) for n, t in header.tensors.items()} == {
        "w": ("F32", (2, 2), 0, 16), "b": ("BF16", (3,), 16, 22),
        "empty": ("F16", (0, 4), 22, 22), "f4": ("F4", (4,), 22, 24)}
    save_file({"x": np.zeros((3, 5), np.float32)}, str(tmp_path / "real.safetensors"),
              metadata={"format": "pt"})
    assert read_safetensors_header(tmp_path / "real.safetensors").tensors["x"].shape == (3, 5)


HOSTILE_HEADERS = [
    (b"", "truncated \\(0 bytes"),
    (b"\x10\x00\x00", "truncated \\(3 bytes"),
    (st(GOOD, bytes(24), length=1 << 50), "header length 1125899906842624 is larger than the "
                                          "file"),
    (st(GOOD, bytes(24), length=2 ** 64 - 1), "is larger than the file"),
    (st(GOOD, bytes(24))[:40], "is larger than the file"),  # truncated inside the header
    (st(b"\xff\xfe{}"), "not valid JSON"),
    (st(b"{\"a\": "), "not valid JSON"),
    (st(b"[" * 100_000), "not valid JSON"),  # nesting past Python's recursion limit
    (st(b""), "not valid JSON"),
    (st([1, 2]), "not a JSON object"),
    (st(b'{"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "w": {}}', bytes(4)),
     "duplicate key 'w'"),
    (st({"__metadata__": {"format": 1}}), "__metadata__ must map strings to strings"),
    (st({"w": [1]}), "tensor 'w' is not an object"),
    (st({"w": entry("Q4_K")}, bytes(8)), "unknown dtype \"Q4_K\""),
    (st({"w": entry(shape="22")}, bytes(8)), "shape must be a list"),
    (st({"w": entry(shape=[2.0])}, bytes(8)), "shape must be a list"),
    (st({"w": entry(shape=[True, 2])}, bytes(8)), "shape must be a list"),
    (st({"w": entry(shape=[1] * 9)}, bytes(8)), "at most 8 integers"),
    (st({"w": entry(shape=[-2, -1])}, bytes(8)), "dimension outside 0 to 2147483647"),
    # MLX wraps this shape to 32-bit negatives and SIGSEGVs evaluating it (0 bytes needed).
    (st({"w": entry(shape=[1 << 31, 1 << 31], offsets=[0, 0])}, bytes(8)),
     "dimension outside 0 to 2147483647"),
    (st({"w": entry(offsets=[0])}, bytes(8)), "data_offsets must be two integers"),
    (st({"w": entry(offsets=[8, 0])}, bytes(8)), "not an ascending pair"),
    (st({"w": entry(offsets=[-8, 0])}, bytes(8)), "not an ascending pair"),
    (st({"w": entry(shape=[1 << 20], offsets=[0, 4 << 20])}, bytes(8)),
     "run past the end of the file \\(its data section is 8 bytes\\): truncated"),
    (st({"w": entry(shape=[1 << 28], offsets=[0, 8])}, bytes(8)),
     "shape \\[268435456\\] of F32 needs 1073741824 bytes but its data_offsets hold 8 bytes"),
    (st({"w": entry(shape=[1 << 30, 1 << 30, 16], offsets=[0, 0])}, bytes(8)), "needs"),
    (st({"w": entry("F4", [3], [0, 2])}, bytes(2)), "needs 1.5 bytes"),
    (st({"a": entry(offsets=[0, 8]), "b": entry(offsets=[4, 12])}, bytes(12)),
     "tensors 'a' and 'b' overlap"),
    (st({"a": entry(offsets=[0, 8]), "b": entry(offsets=[0, 8])}, bytes(8)), "overlap"),
]


@pytest.mark.parametrize("data, message", HOSTILE_HEADERS,
                         ids=[m[:32] for _, m in HOSTILE_HEADERS])
def test_hostile_safetensors_headers(tmp_path, data, message):
    path = tmp_path / "model-00001.safetensors"
    path.write_bytes(data)
    with pytest.raises(InvalidModelFile, match=message) as info:
        read_safetensors_header(path)
    assert info.value.message.startswith("model-00001.safetensors")
    assert info.value.status == 400
    with pytest.raises(InvalidModelFile, match=message):
        safetensors_header_of("model-00001.safetensors", data)


def test_a_claimed_header_length_is_never_allocated(tmp_path):
    """A sparse 200 MB file claiming a 150 MB header (over the format's 100 MB cap), and a
    tiny one claiming 2**60 bytes: refused before any read sized by the claim."""
    big = tmp_path / "big.safetensors"
    with open(big, "wb") as f:
        f.write(struct.pack("<Q", 150_000_000))
        f.truncate(200_000_000)
    small = tmp_path / "small.safetensors"
    small.write_bytes(struct.pack("<Q", 1 << 60) + b"{}")
    tracemalloc.start()
    try:
        with pytest.raises(InvalidModelFile, match=f"over the format's limit of "
                                                   f"{MAX_HEADER_BYTES} bytes"):
            read_safetensors_header(big)
        with pytest.raises(InvalidModelFile, match="larger than the file"):
            read_safetensors_header(small)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


QWEN3 = {"model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
         "intermediate_size": 256, "vocab_size": 2048, "max_position_embeddings": 4096}


@pytest.mark.parametrize("config, message", [
    ({**QWEN3, "hidden_size": 10 ** 9}, "hidden_size 1000000000 is out of range \\(1 to 262,144"),
    ({**QWEN3, "num_hidden_layers": 10 ** 6}, "num_hidden_layers 1000000 is out of range"),
    ({**QWEN3, "vocab_size": -5}, "vocab_size -5 is out of range"),
    ({**QWEN3, "num_attention_heads": 0}, "num_attention_heads 0 is out of range"),
    ({**QWEN3, "intermediate_size": 10 ** 1000}, "a 3322-bit integer is out of range"),
    ({**QWEN3, "hidden_size": "4096"}, "hidden_size must be an integer, not \"4096\""),
    ({**QWEN3, "hidden_size": 4096.5}, "hidden_size must be an integer, not 4096.5"),
    ({**QWEN3, "num_hidden_layers": True}, "num_hidden_layers must be an integer, not true"),
    ({**QWEN3, "vocab_size": [2048]}, "vocab_size must be an integer, not \\[2048\\]"),
    ({**QWEN3, "max_position_embeddings": float("inf")}, "must be an integer, not inf"),
    ({k: v for k, v in QWEN3.items() if k != "model_type"}, "has no model_type"),
    ({**QWEN3, "model_type": "../../os"}, "model_type \"../../os\" is not a model type name"),
    ({**QWEN3, "model_type": ["qwen3"]}, "is not a model type name"),
    ({"model_type": "gemma3", "text_config": {"num_hidden_layers": 10 ** 6}},
     "config.json text_config: num_hidden_layers 1000000 is out of range"),
    ({**QWEN3, "quantization": "q4"}, "quantization must be an object"),
    ({**QWEN3, "quantization": {"bits": 4}}, "quantization has no group_size"),
    ({**QWEN3, "quantization": {"bits": 99, "group_size": 64}}, "bits 99 is out of range"),
    ({**QWEN3, "quantization": {"bits": 4, "group_size": 64, "lm_head": {"bits": "8"}}},
     "quantization 'lm_head': bits must be an integer"),
    ({**QWEN3, "quantization_config": {"bits": "four"}}, "quantization_config: bits must be"),
    ([QWEN3], "config.json is not a JSON object"),
])
def test_hostile_configs(config, message):
    with pytest.raises(InvalidModelFile, match=message):
        config_of(json.dumps(config).encode())


@pytest.mark.parametrize("data, message", [
    (b"{", "config.json is not valid JSON"),
    (b"\xff\xfe\x00", "config.json is not valid JSON"),
    (b"[" * 100_000, "config.json is not valid JSON"),
    (b'{"model_type": "qwen3", "hidden_size": NaN}', "hidden_size must be an integer, not nan"),
    (b'{"model_type": "qwen3", "vocab_size": 1' + b"0" * 5000 + b"}", "not valid JSON"),
])
def test_config_json_that_does_not_parse(data, message):
    with pytest.raises(InvalidModelFile, match=message):
        config_of(data)


def test_configs_that_pass():
    assert config_of(json.dumps({**QWEN3, "head_dim": None, "sliding_window": None,
                                 "quantization": {"bits": 4, "group_size": 64,
                                                  "lm_head": False}}).encode())["head_dim"] is None
    gemma3 = {"model_type": "gemma3", "text_config": {"model_type": "gemma3_text",
                                                      "hidden_size": 2560}}
    assert config_of(json.dumps(gemma3).encode()) == gemma3
    assert config_of(b'{"model_type": "xlm-roberta"}') == {"model_type": "xlm-roberta"}


def test_an_oversized_config_is_not_read(tmp_path):
    path = tmp_path / "config.json"
    with open(path, "wb") as f:
        f.write(b'{"model_type": "qwen3", "pad": "')
        f.truncate(MAX_CONFIG_BYTES + 1)
    with pytest.raises(InvalidModelFile, match="over the 16,777,216-byte limit"):
        read_config(path)


def test_model_directories(tmp_path):
    """Real random models pass; the checks cover config.json and every safetensors file,
    an adapter's under .adapter/ included, and leave other files alone."""
    model = write_random_model(tmp_path / "m", "qwen3", 0)
    (model / "tokenizer.json").write_text("not checked")
    check_model_dir(model)
    (model / ".adapter").mkdir()
    (model / ".adapter" / "adapters.safetensors").write_bytes(b"\x00" * 4)
    assert sorted(model_files(model)) == [".adapter/adapters.safetensors", "config.json",
                                          "model.safetensors"]
    with pytest.raises(InvalidModelFile, match="^.adapter/adapters.safetensors is not a "
                                               "safetensors file: truncated"):
        check_model_dir(model)
    with pytest.raises(InvalidModelFile, match="cannot read it"):
        check_model_files({"config.json": tmp_path / "absent.json"})
    with pytest.raises(InvalidModelFile, match="cannot list it"):
        check_model_dir(tmp_path / "absent")
    assert issubclass(InvalidModelFile, InvalidRequest)
