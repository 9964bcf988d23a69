from mlxr.runner.text_stream import TextStream

# A byte-level toy vocabulary: each token is some bytes; decoding replaces broken UTF-8.
VOCAB = {1: b"Hel", 2: b"lo", 3: b" wor", 4: b"ld", 5: "é".encode()[:1], 6: "é".encode()[1:],
         7: b"<", 8: b"/s", 9: b">", 10: b"!", 11: "😀".encode()[:2], 12: "😀".encode()[2:],
         13: b"\x80", 14: b"\xff\xfe", 15: "中".encode()[:1], 16: "中".encode()[1:2],
         17: "中".encode()[2:]}


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


def test_invalid_bytes_go_out_as_they_come_and_only_an_incomplete_tail_waits():
    # A random model's run of bytes that are no UTF-8 at all: each token's U+FFFD goes out one
    # token later, not when the run ends (it held 80 tokens back, a second of silence).
    parts, _ = run([1] + [13, 14] * 20 + [10])
    assert parts[0] == "Hel"
    assert all(p for p in parts[2:-1]), "nothing held for more than one token"
    assert "".join(parts) == decode([1] + [13, 14] * 20 + [10])


def test_a_character_completed_after_invalid_bytes_is_whole():
    tokens = [13, 15, 16, 14, 15, 16, 17, 2]
    parts, _ = run(tokens)
    assert "".join(parts) == decode(tokens) == "\ufffd\ufffd\ufffd\ufffd中lo"
    # the incomplete 中 (two of its three bytes) is never emitted as U+FFFD
    assert parts[5] == "" and parts[6] == "中"


def test_a_request_ending_inside_a_character_flushes_what_it_has():
    tokens = [1, 13, 15, 16]
    parts, _ = run(tokens)
    assert "".join(parts) == decode(tokens) == "Hel\ufffd\ufffd"
    assert parts[-1] == "\ufffd", "the incomplete tail waits for the flush"
