"""Hostile GGUF files: every count, length, dimension and offset the header claims is bounded
by the file (and a cap) before anything is sized by it, and check_supported refuses absurd
hyperparameters and malformed tokenizer metadata with InvalidModelFile, never another
exception (which the converter process would turn into a 500)."""

from __future__ import annotations

import struct
import tracemalloc

import pytest

from mlxr.shared.errors import InvalidModelFile
from mlxr.supervisor.store.gguf.convert import check_supported, hf_config_of
from mlxr.supervisor.store.gguf.header import read_gguf

U32, F32, STRING, ARRAY, U64 = 4, 6, 8, 9, 10


def s(text: str | bytes) -> bytes:
    data = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(data)) + data


def kv(key: str, vtype: int, payload: bytes) -> bytes:
    return s(key) + struct.pack("<I", vtype) + payload


def u32(key: str, value: int) -> bytes:
    return kv(key, U32, struct.pack("<I", value))


def text(key: str, value: str) -> bytes:
    return kv(key, STRING, s(value))


def strings(key: str, values: list[str]) -> bytes:
    return kv(key, ARRAY, struct.pack("<IQ", STRING, len(values)) + b"".join(map(s, values)))


def f32(key: str, value: float) -> bytes:
    return kv(key, F32, struct.pack("<f", value))


def ints(key: str, values: list[int]) -> bytes:
    return kv(key, ARRAY, struct.pack("<IQ", 5, len(values)) +
              b"".join(struct.pack("<i", v) for v in values))


def tensor(name: str, ne: list[int], ggml_type: int = 0, offset: int = 0) -> bytes:
    return s(name) + struct.pack("<I", len(ne)) + b"".join(struct.pack("<Q", n) for n in ne) \
        + struct.pack("<IQ", ggml_type, offset)


def gguf(kvs: list[bytes], tensors: list[bytes] = (), data: bytes = b"",
         n_kv: int | None = None, n_tensors: int | None = None) -> bytes:
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors) if n_tensors is None else n_tensors,
                                 len(kvs) if n_kv is None else n_kv)
    head += b"".join(kvs) + b"".join(tensors)
    return head + bytes(-len(head) % 32) + data


TOKENS = ["a", "b", "ab", "<|eot_id|>"]
LLAMA = [text("general.architecture", "llama"), u32("llama.embedding_length", 32),
         u32("llama.block_count", 1), u32("llama.feed_forward_length", 64),
         u32("llama.attention.head_count", 2), u32("llama.attention.head_count_kv", 1),
         text("tokenizer.ggml.model", "gpt2"), strings("tokenizer.ggml.tokens", TOKENS),
         ints("tokenizer.ggml.token_type", [1, 1, 1, 3]),
         strings("tokenizer.ggml.merges", ["a b"]), u32("tokenizer.ggml.eos_token_id", 3)]
NORM = tensor("output_norm.weight", [32])


def write(tmp_path, data: bytes):
    path = tmp_path / "model.gguf"
    path.write_bytes(data)
    return path


def test_the_small_valid_file_passes(tmp_path):
    """...with keys the converter never reads, of any type, as real files have them."""
    unread = [text("llama.tensor_data_layout", "Meta AI original pth"),
              ints("llama.rope.dimension_sections", [8, 8]), text("general.name", "x")]
    path = write(tmp_path, gguf(LLAMA + unread,
                                [NORM, tensor("blk.0.attn_norm.weight", [32], 0, 128)],
                                bytes(256)))
    summary = check_supported(path)
    assert summary.architecture == "llama" and summary.parameter_count == 64
    config = hf_config_of(read_gguf(path), summary)
    assert (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]) == \
        (32, 1, 4)


HOSTILE_HEADERS = [
    (gguf([], n_kv=1 << 60), "claims 1152921504606846976 metadata entries, more than the 8 "
                             "bytes left"),
    (gguf(LLAMA, n_tensors=2 ** 64 - 1), "claims 18446744073709551615 tensors"),
    (gguf([s("k") + b"\x08\x00\x00\x00" + struct.pack("<Q", 1 << 20)]), "truncated header"),
    (gguf([s("k") + b"\x08\x00\x00\x00" + struct.pack("<Q", 1 << 40)]),
     "a GGUF string of 1099511627776 bytes is over"),
    (gguf([struct.pack("<Q", 1 << 20) + b"k"]), "metadata key of 1048576 bytes is over the "
                                                 "65536-byte limit"),
    (gguf([kv("a", ARRAY, struct.pack("<IQ", STRING, 1 << 61))]), "claims 2305843009213693952 "
                                                                   "strings in an array"),
    (gguf([kv("a", ARRAY, struct.pack("<IQ", 6, 1 << 61))]), "truncated header"),
    (gguf([kv("a", ARRAY, struct.pack("<IQ", ARRAY, 1 << 40))]), "claims 1099511627776 arrays"),
    (gguf([kv("a", ARRAY, struct.pack("<IQ", ARRAY, 1) * 4 + struct.pack("<IQ", 6, 0))]),
     "arrays nested over 4 deep"),
    (gguf([kv("a", ARRAY, struct.pack("<IQ", 77, 0))]), "metadata array of type 77"),
    (gguf([kv("a", 77, b"")]), "metadata type 77"),
    (gguf([u32("a", 1), u32("a", 2)]), "metadata key 'a' appears twice"),
    (gguf([], [tensor("t", [1] * 9)]), "tensor 't' has 9 dimensions"),
    # numpy's int64 product of these wrapped to 0 bytes: the file passed and failed later.
    (gguf([], [tensor("t", [1 << 32, 1 << 32])]), "has a dimension over 2147483647"),
    (gguf([], [tensor("t", [0, 4])]), "tensor 't' has no elements"),
    (gguf([], [tensor("t", [31, 2], 8)], bytes(68)), "rows of 31 elements, not whole blocks "
                                                      "of 32"),
    (gguf([], [tensor("t", [32], 0, 1 << 40)], bytes(128)), "is truncated: tensor 't' runs past"),
    (gguf([], [tensor("t", [1 << 30, 4])], bytes(128)), "is truncated: tensor 't' runs past"),
    (gguf([], [tensor("t", [4], 0, 4)], bytes(64)), "starts at offset 4, not a multiple of the "
                                                    "alignment 32"),
    (gguf([], [tensor("a", [16]), tensor("b", [16], 0, 32)], bytes(128)), "tensors 'a' and "
                                                                          "'b' overlap"),
    (gguf([], [tensor("a", [8]), tensor("a", [8], 0, 32)], bytes(64)), "tensor 'a' appears "
                                                                       "twice"),
]


@pytest.mark.parametrize("data, message", HOSTILE_HEADERS,
                         ids=[m[:32] for _, m in HOSTILE_HEADERS])
def test_hostile_headers(tmp_path, data, message):
    path = write(tmp_path, data)
    for skip_arrays in (True, False):
        with pytest.raises(InvalidModelFile, match=message):
            read_gguf(path, skip_arrays=skip_arrays)


def test_claimed_counts_are_never_allocated(tmp_path):
    """2**61 float32s or strings claimed by an array in a 100-byte file: refused before
    anything is sized by the claim."""
    floats = write(tmp_path, gguf([kv("a", ARRAY, struct.pack("<IQ", F32, 1 << 61))]))
    tracemalloc.start()
    try:
        with pytest.raises(InvalidModelFile):
            read_gguf(floats)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


def replace(entries: list[bytes], key: str, new: bytes | None) -> list[bytes]:
    out = [e for e in entries if not e.startswith(s(key))]
    return out + ([new] if new is not None else [])


@pytest.mark.parametrize("kvs, message", [
    (replace(LLAMA, "llama.block_count", u32("llama.block_count", 10 ** 6)),
     "llama.block_count 1000000 is out of range \\(1 to 4,096\\)"),
    (replace(LLAMA, "llama.attention.head_count", u32("llama.attention.head_count", 0)),
     "llama.attention.head_count 0 is out of range"),
    (replace(LLAMA, "llama.embedding_length", text("llama.embedding_length", "32")),
     "llama.embedding_length must be an integer, not \"32\""),
    (replace(LLAMA, "llama.attention.head_count_kv",
             ints("llama.attention.head_count_kv", [1, -1])),
     "llama.attention.head_count_kv -1 is out of range"),
    (replace(LLAMA, "tokenizer.ggml.tokens", None), "tokenizer.ggml.tokens is missing"),
    (replace(LLAMA, "tokenizer.ggml.tokens", ints("tokenizer.ggml.tokens", [1, 2, 3, 4])),
     "tokenizer.ggml.tokens must be strings"),
    (replace(LLAMA, "tokenizer.ggml.token_type", ints("tokenizer.ggml.token_type", [1])),
     "token_type must be a list of one value per token \\(4\\)"),
    (replace(LLAMA, "tokenizer.ggml.merges", ints("tokenizer.ggml.merges", [1])),
     "merges must be a list of strings"),
    (replace(LLAMA, "tokenizer.ggml.eos_token_id", text("tokenizer.ggml.eos_token_id", "x")),
     "eos_token_id must be an integer"),
    (replace(LLAMA, "tokenizer.ggml.pre", strings("tokenizer.ggml.pre", ["a"])),
     "tokenizer.ggml.pre must be a string"),
    # found by fuzzing (scripts/fuzz_headers.py gguf-meta): each was an exception in
    # arch.hf_config, a 500 from the converter
    (replace(LLAMA, "llama.rope.dimension_count", text("llama.rope.dimension_count", "x")),
     "llama.rope.dimension_count must be an integer from 1 to 16,384"),
    (replace(LLAMA, "llama.attention.value_length",
             ints("llama.attention.value_length", [16, 16])),
     "llama.attention.value_length must be one value, not a list"),
    (replace(LLAMA, "llama.rope.freq_scale", f32("llama.rope.freq_scale", 0.0)),
     "llama.rope.freq_scale must be a positive number"),
    (replace(LLAMA, "llama.rope.freq_base", f32("llama.rope.freq_base", float("nan"))),
     "llama.rope.freq_base must be a positive number, not 'nan'"),
    (replace(LLAMA, "llama.attention.sliding_window", u32("llama.attention.sliding_window",
                                                          1 << 31)),
     "llama.attention.sliding_window must be an integer from 0 to 67,108,864"),
])
def test_hostile_metadata_is_refused_by_check_supported(tmp_path, kvs, message):
    path = write(tmp_path, gguf(kvs, [NORM], bytes(128)))
    with pytest.raises(InvalidModelFile, match=message):
        check_supported(path)
    with pytest.raises(InvalidModelFile, match=message):
        check_supported(path, read_gguf(path))


@pytest.mark.parametrize("info, message", [
    # found by fuzzing: a 1-D embedding was an IndexError reading the vocabulary size
    (tensor("token_embd.weight", [32]), 'tensor "token_embd.weight" has shape \\(32,\\): a '
                                        "matrix expected"),
    (tensor("blk.0.attn_q.weight", [32, 1, 1]), "1 or 2 dimensions expected"),
])
def test_tensors_need_the_dimensions_of_their_role(tmp_path, info, message):
    path = write(tmp_path, gguf(LLAMA, [info], bytes(128)))
    with pytest.raises(InvalidModelFile, match=message):
        check_supported(path)


def test_a_tensor_past_the_layer_count_is_refused(tmp_path):
    path = write(tmp_path, gguf(LLAMA, [NORM, tensor("blk.7.attn_norm.weight", [32], 0, 128)],
                                bytes(256)))
    with pytest.raises(InvalidModelFile, match="tensor \"blk.7.attn_norm.weight\" is past the "
                                               "file's 1 layers"):
        check_supported(path)
