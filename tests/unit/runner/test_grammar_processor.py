"""Grammar compilation and the per-request mask logic, on the real Qwen3 tokenizer; no model and
no MLX (the processor's host side: `prepare` and its mask)."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest
import tokenizers

from mlxr.runner.grammar import (GrammarCompiler, GrammarProcessor, llama_cpp_reading,
                                 compiler_for, grammar_text)
from mlxr.runner.tokenizer import Tokenizer
from mlxr.shared.assets import write_qwen3_tokenizer
from mlxr.shared.errors import InvalidRequest

VOCAB = 151680  # the Qwen3 models' logits width (the tokenizer has 151,669 tokens)
EOS = (151643, 151645)
PROMPT = [9707, 11, 1879, 0, 151644, 77091]  # any ids: the matcher never sees the prompt

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "role": {"enum": ["admin", "user"]},
        "tags": {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
    },
    "required": ["name", "role", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def backend(tmp_path_factory) -> tokenizers.Tokenizer:
    path = tmp_path_factory.mktemp("qwen3")
    write_qwen3_tokenizer(path)
    return tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))


@pytest.fixture(scope="module")
def compiler(backend) -> GrammarCompiler:
    return GrammarCompiler.from_hf(backend, VOCAB, list(EOS))


def encode(backend, text: str) -> list[int]:
    return backend.encode(text, add_special_tokens=False).ids


def walk(processor: GrammarProcessor, tokens: list[int]) -> list[np.ndarray]:
    """Feed `tokens` one by one as the engine does; returns the mask seen before each token."""
    masks = []
    for i in range(len(tokens) + 1):
        processor.prepare(PROMPT + tokens[:i])
        masks.append(processor.allowed_now())
    return masks


def test_a_valid_document_is_allowed_token_by_token_then_only_eos(compiler, backend):
    doc = json.dumps({"name": "Ada", "role": "admin", "tags": [1, 22]}, separators=(",", ":"))
    tokens = encode(backend, doc)
    processor = GrammarProcessor(compiler.matcher(SCHEMA), len(PROMPT), VOCAB)
    masks = walk(processor, tokens)
    for token, mask in zip(tokens, masks):
        assert mask.shape == (VOCAB,) and mask[token]
        assert not mask[list(EOS)].any(), "EOS only once the object is complete"
    assert processor.is_complete and processor.num_consumed == len(tokens)
    assert sorted(np.nonzero(masks[-1])[0].tolist()) == list(EOS)


def test_disallowed_tokens_are_masked(compiler, backend):
    processor = GrammarProcessor(compiler.matcher(SCHEMA), len(PROMPT), VOCAB)
    walk(processor, encode(backend, '{"name":"x","role":"'))
    allowed = np.nonzero(processor.allowed_now())[0].tolist()
    texts = {backend.decode([t]) for t in allowed}
    assert texts and all("admin".startswith(t) or "user".startswith(t) or
                          t.startswith(("admin", "user")) for t in texts), texts
    assert backend.encode("guest", add_special_tokens=False).ids[0] not in allowed
    assert not any(t >= 151669 for t in allowed), "rows past the tokenizer stay masked"


def test_repeated_history_is_not_consumed_twice(compiler, backend):
    """A preempted sequence is recomputed with the same history: the state must not move."""
    tokens = encode(backend, '{"name":"ab')
    processor = GrammarProcessor(compiler.matcher(SCHEMA), len(PROMPT), VOCAB)
    walk(processor, tokens)
    before = processor.allowed_now().copy()
    processor.prepare(PROMPT + tokens)
    processor.prepare(PROMPT + tokens)
    assert processor.num_consumed == len(tokens)
    assert np.array_equal(processor.allowed_now(), before)


def test_several_new_tokens_at_once_are_all_consumed(compiler, backend):
    tokens = encode(backend, '{"name":"ab","role":"user","tags":[]}')
    processor = GrammarProcessor(compiler.matcher(SCHEMA), len(PROMPT), VOCAB)
    processor.prepare(PROMPT + tokens)
    assert processor.is_complete and processor.num_consumed == len(tokens)


def test_a_rejected_token_leaves_only_eos(compiler, backend):
    processor = GrammarProcessor(compiler.matcher(SCHEMA), len(PROMPT), VOCAB)
    processor.prepare(PROMPT + encode(backend, "hello"))
    assert sorted(np.nonzero(processor.allowed_now())[0].tolist()) == list(EOS)


def test_any_json_object_and_bounded_whitespace(compiler, backend):
    processor = GrammarProcessor(compiler.matcher("json"), len(PROMPT), VOCAB)
    first = np.nonzero(walk(processor, [])[0])[0]
    assert all(backend.decode([t]).startswith("{") for t in first)
    walk(processor, encode(backend, "{\n" + " " * 32))
    allowed = np.nonzero(processor.allowed_now())[0]
    assert not any(backend.decode([t]).startswith((" ", "\t", "\n")) for t in allowed), \
        "at most one line break and 32 columns of indentation per gap"
    walk(processor, encode(backend, '{\n  "a": [1, {"b": null}],\n  "c": "d"\n}'))
    assert processor.is_complete


def test_objects_and_integers_are_read_as_llama_cpp_reads_them(
        compiler, backend):
    # Ollama constrains GGUF models with llama.cpp's reading of the schema: listed properties
    # and no word of additionalProperties means no other keys (the JSON Schema default admits
    # any, and a small model wrote {"a": 1, "oc": ...})
    schema = {"type": "object", "properties": {"a": {"type": "integer"},
                                               "b": {"type": "object",
                                                     "properties": {"c": {"type": "string"}}}},
              "required": ["a"]}

    def accepts(fmt, text: str) -> bool:
        processor = GrammarProcessor(compiler.matcher(fmt), len(PROMPT), VOCAB)
        tokens = encode(backend, text)
        for i, token in enumerate(tokens):
            processor.prepare(PROMPT + tokens[:i])
            if not processor.allowed_now()[token]:
                return False
        return True

    assert accepts(schema, '{"a": 1, "b": {"c": "x"}}')
    assert not accepts(schema, '{"a": 1, "z": 2}')
    assert not accepts(schema, '{"a": 1, "b": {"c": "x", "z": 2}}')  # nested objects too
    assert accepts({**schema, "additionalProperties": True}, '{"a": 1, "z": 2}')
    assert accepts({"type": "object"}, '{"z": 2}')  # no properties listed: any object
    assert "additionalProperties" not in schema  # the request's schema is not changed
    closed = llama_cpp_reading({"$defs": {"p": {"properties": {}}}, "anyOf": [{"properties": {}}],
                             "items": {"properties": {}}, "allOf": [{"properties": {}}],
                             "properties": {"e": {"enum": [{"properties": 1}]}}})
    assert [closed["$defs"]["p"], closed["anyOf"][0], closed["items"]] == \
        [{"properties": {}, "additionalProperties": False}] * 3
    assert closed["allOf"] == [{"properties": {}}]  # each would refuse the others' keys
    assert closed["properties"]["e"] == {"enum": [{"properties": 1}]}  # values, not schemas
    # integers: at most 16 digits, as llama.cpp's grammar has them, unless bounded otherwise
    numbers = {"type": "object", "properties": {"n": {"type": "integer"}}}
    assert accepts(numbers, '{"n": -9999999999999999}')
    assert not accepts(numbers, '{"n": 12345678901234567}')
    assert accepts({"type": "object", "properties": {"n": {"type": "integer", "minimum": 0}}},
                   '{"n": 1234567890123456}')
    assert not accepts({"type": "object", "properties": {"n": {"type": "integer", "minimum": 0}}},
                       '{"n": -1}')


def test_regex_allows_eos_when_accepting_and_forces_it_when_complete(compiler, backend):
    processor = GrammarProcessor(compiler.matcher({"type": "regex", "pattern": "[a-z]{2,3}"}),
                                 len(PROMPT), VOCAB)
    walk(processor, encode(backend, "ab"))
    mask = processor.allowed_now()
    assert mask[list(EOS)].all() and mask.sum() > len(EOS)
    processor = GrammarProcessor(compiler.matcher({"type": "regex", "pattern": "[a-z]{2,3}"}),
                                 len(PROMPT), VOCAB)
    walk(processor, encode(backend, "abc"))
    assert processor.is_complete
    assert sorted(np.nonzero(processor.allowed_now())[0].tolist()) == list(EOS)


@pytest.mark.parametrize("fmt, reason", [
    ({"type": "foo"}, "Invalid type: foo"),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}, "does not exist"),
    ({"type": "array", "uniqueItems": True}, "Unimplemented keys"),
    ({"type": "string", "minLength": 5, "maxLength": 2}, "Unsatisfiable"),
    ({"type": "regex", "pattern": "(abc"}, "unclosed group"),
])
def test_formats_that_do_not_compile_give_the_engines_reason(compiler, fmt, reason):
    with pytest.raises(InvalidRequest) as err:
        compiler.matcher(fmt)
    assert err.value.status == 400 and reason in err.value.message


@pytest.mark.parametrize("fmt", ["yaml", 3, [], {"type": "regex"}, {"type": "regex", "pattern": ""}])
def test_malformed_formats_are_invalid_requests(fmt):
    with pytest.raises(InvalidRequest):
        grammar_text(fmt)


def test_compiled_grammars_are_cached_and_copied(compiler, backend):
    fmt = {"type": "object", "properties": {"k": {"type": "integer"}}, "required": ["k"]}
    first, second = compiler.matcher(fmt), compiler.matcher(fmt)
    assert first is not second and grammar_text(fmt) in compiler._cache
    a = GrammarProcessor(first, 0, VOCAB)
    walk(a, encode(backend, '{"k":1}'))
    b = GrammarProcessor(second, 0, VOCAB)
    assert a.is_complete and not b.is_complete, "requests do not share matcher state"


def test_compiler_is_built_once_per_tokenizer(backend):
    wrapper = Tokenizer(backend=backend, eos_token_ids={151645, 151643}, bos_token=None,
                        model_max_length=0, added_tokens={}, eos_token_id=None, eos_token=None)
    built: list[GrammarCompiler] = []
    threads = [threading.Thread(target=lambda: built.append(compiler_for(wrapper, VOCAB)))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(built) == 3 and all(c is built[0] for c in built)
    assert built[0].eos_ids == EOS


THINK_OPEN, THINK_CLOSE = 151667, 151668  # <think>, </think>


def thinking_processor(compiler, open_with: int | None = THINK_OPEN) -> GrammarProcessor:
    return GrammarProcessor(compiler.matcher(SCHEMA), len(PROMPT), VOCAB, [THINK_CLOSE],
                            open_with)


def test_output_that_opens_no_thinking_is_held_to_the_format_from_its_first_token(
        compiler, backend):
    processor = thinking_processor(compiler)
    first = processor.mask(PROMPT)
    grammar = GrammarProcessor(compiler.matcher(SCHEMA), len(PROMPT), VOCAB)
    want = grammar.mask(PROMPT).copy()
    want[THINK_OPEN] = True  # the first token may open the thinking instead
    assert np.array_equal(first, want)
    tokens = encode(backend, '{"name":"')
    assert np.array_equal(processor.mask(PROMPT + tokens), grammar.mask(PROMPT + tokens))
    assert processor.active and not processor.mask(PROMPT + tokens)[THINK_OPEN]


def test_output_that_opens_its_thinking_is_free_until_it_closes(compiler, backend):
    processor = thinking_processor(compiler)
    thought = [THINK_OPEN] + encode(backend, "Let me think. {not json")
    assert processor.mask(PROMPT + thought) is None and not processor.active
    answer = encode(backend, '{"name":"')
    mask = processor.mask(PROMPT + thought + [THINK_CLOSE] + answer)
    grammar = GrammarProcessor(compiler.matcher(SCHEMA), len(PROMPT), VOCAB)
    assert processor.active and np.array_equal(mask, grammar.mask(PROMPT + answer))


def test_without_an_opening_token_the_output_is_free_until_the_thinking_closes(compiler, backend):
    processor = thinking_processor(compiler, open_with=None)  # the prompt opened it
    assert processor.mask(PROMPT) is None
    assert processor.mask(PROMPT + encode(backend, "plain words")) is None
