from mlxr.runner.text_stream import TextStream

# A byte-level toy vocabulary: each token is some bytes; decoding replaces broken UTF-8.
VOCAB = {1: b"Hel", 2: b"lo", 3: b" wor", 4: b"ld", 5: "é".encode()[:1], 6: "é".encode()[1:],
         7: b"<", 8: b"/s", 9: b">", 10: b"!", 11: "😀".encode()[:2], 12: "😀".encode()[2:]}


def decode(ids):
    return b"".join(VOCAB[i] for i in ids).decode("utf-8", "replace")


def run(tokens, stops=None):
    stream = TextStream(decode, stops)
    parts = [stream.push(t) for t in tokens]
    if not stream.stopped:
        parts.append(stream.flush())
    return parts, stream


def test_text_equals_full_decode():
    parts, _ = run([1, 2, 3, 4, 10])
    assert "".join(parts) == "Hello world!"


def test_never_splits_utf8():
    parts, _ = run([1, 5, 6, 11, 12])
    assert all("\ufffd" not in p for p in parts)
    assert "".join(parts) == "Helé😀"


def test_stop_string_split_across_tokens_is_not_emitted():
    parts, stream = run([1, 2, 7, 8, 9, 10], stops=["</s>"])
    assert stream.stopped
    assert "".join(parts) == "Hello"


def test_partial_stop_that_does_not_complete_is_released():
    parts, stream = run([1, 7, 10, 2], stops=["</s>"])
    assert not stream.stopped
    assert "".join(parts) == "Hel<!lo"
    assert parts[1] == "", "a possible stop start is held back"
