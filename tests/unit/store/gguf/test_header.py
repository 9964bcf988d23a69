"""Our GGUF header reader gives what gguf's GGUFReader gives (metadata values, tensor table,
tensor bytes and shapes), and a clear 400 for files that are not whole GGUF files."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from mlxr.shared.errors import InvalidRequest
from mlxr.supervisor.store.gguf import quants
from mlxr.supervisor.store.gguf.header import ArrayStub, read_gguf

T = gguf.GGMLQuantizationType


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "m.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint32("llama.context_length", 4096)
    w.add_float32("llama.rope.freq_base", 500000.0)
    w.add_bool("tokenizer.ggml.add_bos_token", True)
    w.add_string("tokenizer.chat_template", "{{ messages }} ✓")
    w.add_array("tokenizer.ggml.tokens", [f"tok{i}" for i in range(100)] + ["▁的", "🙂"])
    w.add_array("tokenizer.ggml.scores", [float(-i) for i in range(102)])
    w.add_int64("general.big", -(1 << 40))
    x = np.random.default_rng(0).standard_normal((4, 256)).astype(np.float32)
    w.add_tensor("f32", x)
    w.add_tensor("f16", x.astype(np.float16))
    w.add_tensor("bf16", gguf.quants.quantize(x, T.BF16), raw_dtype=T.BF16)
    w.add_tensor("q8", gguf.quants.quantize(x, T.Q8_0), raw_dtype=T.Q8_0)
    w.add_tensor("q4k", quants.quantize_q4_k(x), raw_dtype=T.Q4_K)
    w.add_tensor("norm", np.ones(256, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_matches_ggufs_reader(gguf_file):
    ours, theirs = read_gguf(gguf_file), gguf.GGUFReader(str(gguf_file))
    expected = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert ours.kv == expected
    assert [(t.name, t.ggml_type) for t in ours.tensors] == \
        [(t.name, int(t.tensor_type)) for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        data = ours.data(a)
        assert data.dtype == b.data.dtype and data.shape == b.data.shape
        assert np.array_equal(data, b.data)
        assert a.shape == tuple(int(n) for n in reversed(b.shape))
        assert a.n_bytes == int(b.n_bytes) and a.n_elements == int(b.n_elements)


def test_skip_arrays_keeps_only_lengths(gguf_file):
    kv = read_gguf(gguf_file, skip_arrays=True).kv
    assert isinstance(kv["tokenizer.ggml.tokens"], ArrayStub)
    assert kv["tokenizer.ggml.tokens"] == 102
    assert kv["tokenizer.chat_template"] == "{{ messages }} ✓"


def test_bad_files_are_a_400(gguf_file, tmp_path):
    data = gguf_file.read_bytes()
    for name, content, message in (
            ("empty", b"", "not a GGUF file"),
            ("text", b"hello world, not a model", "not a GGUF file"),
            ("header", data[:200], "truncated"),
            ("tensors", data[:-100], "truncated")):
        path = tmp_path / name
        path.write_bytes(content)
        with pytest.raises(InvalidRequest, match=message):
            read_gguf(path)
