"""Structured output: constrain a request's tokens to a JSON schema, any JSON object, or a regex.

llguidance compiles the request's `format` against the model's tokenizer. Each constrained
request gets a `GrammarProcessor`, a logits processor on its own row: it feeds the matcher the
tokens chosen since its last call, then sets every token the grammar does not allow to -inf.
When the grammar is complete only the EOS tokens stay allowed, so the request stops with "stop".

Invariants:
- `num_consumed` counts the output tokens the matcher has seen; the history it is handed is
  prompt + outputs, so a preempted and recomputed sequence resumes at the same grammar state.
- The mask for a position is computed once: by `prepare` while the device runs the forward
  pass (see ModelStep.run), by `make_grammar` for the first position, or on first use.
- Nothing here touches MLX except `__call__` (on the engine thread); compiling runs on any
  thread, so the completions handler compiles in an executor and rejects bad formats with 400.
- With `start_after` (the token ids of a request's `format_after`, the end of its thinking
  section) the processor is dormant: it masks nothing until those ids appear in the output,
  then the grammar starts at the token after them (`num_prompt` moves there, so the invariant
  above holds from then on). Output that never closes its thinking is never constrained.
- With `open_with` too (the one token that opens a thinking section, where the prompt did not
  open it): the output's first token decides. Its mask is the grammar's first one plus that
  token; the token opens the thinking (dormant, as above), anything else is the grammar's
  first token and the grammar holds from there. So output that does not think is constrained
  from its start (Ollama applies the format once the content begins, thinking or not).
"""

from __future__ import annotations

import copy
import logging
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import llguidance as llg
import numpy as np

from mlxr.shared.errors import InvalidRequest

log = logging.getLogger("mlxr.runner")

# "json" means any JSON object, as in Ollama.
ANY_JSON_OBJECT: dict[str, Any] = {"type": "object"}
# Whitespace allowed at each place JSON allows it: one space or tab, or a line break and up to
# 32 columns of indentation. Enough for pretty-printed output, but bounded, so a model cannot
# loop on whitespace (llguidance's default allows any amount).
JSON_WHITESPACE = r"[\x20\x09]|\x0D?\x0A[\x20\x09]{0,32}"
JSON_DEFAULTS = {"whitespace_pattern": JSON_WHITESPACE}
MAX_CACHED_GRAMMARS = 64
# Short errors: the verbose ones dump parser state and the whole grammar into a 400's text.
LIMITS = llg.LLParserLimits(verbose_errors=False)
MAX_REASON_CHARS = 800


def grammar_text(fmt: Any) -> str:
    """The llguidance grammar for a wire `format`; InvalidRequest for a malformed one."""
    if fmt == "json":
        fmt = ANY_JSON_OBJECT
    if not isinstance(fmt, dict):
        raise InvalidRequest('format must be "json", a JSON schema object, '
                             'or {"type": "regex", "pattern": "..."}')
    if fmt.get("type") == "regex":
        pattern = fmt.get("pattern")
        if not isinstance(pattern, str) or not pattern:
            raise InvalidRequest("a regex format needs a non-empty string pattern")
        return llg.LLMatcher.grammar_from_regex(pattern)
    try:
        return llg.LLMatcher.grammar_from_json_schema(llama_cpp_reading(fmt),
                                                      defaults=JSON_DEFAULTS)
    except ValueError as exc:
        raise InvalidRequest(f"invalid JSON schema: {exc}") from None


# Keywords whose value is a schema, a list of schemas, or a map of names to schemas.
_SCHEMA = ("items", "additionalProperties", "not", "if", "then", "else", "contains",
           "additionalItems", "propertyNames", "unevaluatedItems", "unevaluatedProperties")
_SCHEMAS = ("prefixItems", "anyOf", "oneOf")
_NAMED = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


LARGEST_INTEGER = 10**16 - 1  # llama.cpp's integers: at most 16 digits


def llama_cpp_reading(schema: Any) -> Any:
    """A copy of `schema` read as llama.cpp reads one (what Ollama constrains a GGUF model's
    `format` with, on both its APIs), where JSON Schema's own defaults differ:
    - an object that lists `properties` and says nothing of `additionalProperties` takes no
      other keys (the default admits any: a small model filled a `{"a": ...}` object with
      keys of its own);
    - an integer without bounds has at most 16 digits (a small model wrote 9999... until its
      token limit).
    `allOf` branches are left as they are (each closed object would refuse the others' keys)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key, value in schema.items():
        if key in _SCHEMA:
            out[key] = llama_cpp_reading(value)
        elif key in _SCHEMAS and isinstance(value, list):
            out[key] = [llama_cpp_reading(v) for v in value]
        elif key in _NAMED and isinstance(value, dict):
            out[key] = {name: llama_cpp_reading(v) for name, v in value.items()}
    if "properties" in schema and "additionalProperties" not in schema:
        out["additionalProperties"] = False
    if schema.get("type") == "integer":
        if "minimum" not in schema and "exclusiveMinimum" not in schema:
            out["minimum"] = -LARGEST_INTEGER
        if "maximum" not in schema and "exclusiveMaximum" not in schema:
            out["maximum"] = LARGEST_INTEGER
    return out


@dataclass(slots=True)
class GrammarCompiler:
    """One per loaded model: the llguidance view of its tokenizer (about 1 s to build) and an
    LRU of compiled grammars, copied per request (microseconds, against milliseconds to
    compile)."""

    tokenizer: Any  # llguidance.LLTokenizer
    vocab_size: int  # the width of the model's logits
    eos_ids: tuple[int, ...]
    _cache: OrderedDict = field(default_factory=OrderedDict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def from_hf(cls, backend: Any, vocab_size: int, eos_ids: list[int]) -> "GrammarCompiler":
        """`backend` is a `tokenizers.Tokenizer` (a fast HF tokenizer's backend_tokenizer)."""
        backend = copy.copy(backend)  # padding/truncation would change what to_str() encodes
        backend.no_padding()
        backend.no_truncation()
        n_vocab = max(vocab_size, backend.get_vocab_size(with_added_tokens=True))
        lltok = llg.LLTokenizer(backend.to_str(), n_vocab=n_vocab, eos_token=sorted(eos_ids))
        return cls(lltok, vocab_size, tuple(sorted(eos_ids)))

    def matcher(self, fmt: Any) -> Any:
        """A fresh matcher for `fmt`; InvalidRequest with llguidance's reason if it does not
        compile."""
        text = grammar_text(fmt)
        with self._lock:
            cached = self._cache.get(text)
            if cached is not None:
                self._cache.move_to_end(text)
                return cached.deep_copy()
        compiled = llg.LLMatcher(self.tokenizer, text, log_level=0, limits=LIMITS)
        if compiled.is_error():
            reason = compiled.get_error().strip()[:MAX_REASON_CHARS]
            raise InvalidRequest(f"invalid format: {reason}")
        with self._lock:
            self._cache[text] = compiled
            while len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
            return compiled.deep_copy()


class GrammarProcessor:
    """The `LogitsProcessor` of one constrained request (see the module docstring)."""

    __slots__ = ("matcher", "num_prompt", "num_consumed", "vocab_size", "_allowed", "_warned",
                 "start_after", "open_with")

    def __init__(self, matcher: Any, num_prompt: int, vocab_size: int,
                 start_after: list[int] | None = None, open_with: int | None = None):
        self.matcher = matcher
        self.num_prompt = num_prompt
        self.num_consumed = 0
        self.vocab_size = vocab_size
        self._allowed: np.ndarray | None = None
        self._warned = False
        self.start_after = start_after or None
        self.open_with = open_with if self.start_after else None

    @property
    def active(self) -> bool:
        return self.start_after is None

    def _wake(self, tokens: list[int]) -> None:
        """Start the grammar if the output now holds `start_after` (searched in the output only)."""
        tag, out = self.start_after, tokens[self.num_prompt:]
        for i in range(len(out) - len(tag), -1, -1):
            if out[i:i + len(tag)] == tag:
                self.num_prompt += i + len(tag)
                self.start_after = None
                return

    def _choose(self, tokens: list[int]) -> None:
        """The output's first token, once there is one: the thinking's opening (dormant until
        `start_after`) or the grammar's first token (active now)."""
        out = tokens[self.num_prompt:self.num_prompt + 1]
        if out:
            if out[0] != self.open_with:
                self.start_after = None
            self.open_with, self._allowed = None, None

    def prepare(self, tokens: list[int]) -> None:
        """Advance past the tokens chosen since the last call and compute the next mask (host
        work, done while the device runs the forward pass)."""
        if self.open_with is not None:
            self._choose(tokens)
            if self.open_with is not None:  # no output yet: the grammar's mask or the opening
                if self._allowed is None:
                    self._allowed = self.allowed_now()
                    self._allowed[self.open_with] = True
                return
        if not self.active:
            self._wake(tokens)
            if not self.active:
                return
        start = self.num_prompt + self.num_consumed
        if len(tokens) > start:
            for token in tokens[start:]:
                if not self.matcher.consume_token(token) and not self._warned:
                    self._warned = True  # its mask is then EOS only: the request ends
                    log.warning("grammar rejected token %d: %s", token,
                                self.matcher.get_error()[:MAX_REASON_CHARS])
            self.num_consumed = len(tokens) - self.num_prompt
            self._allowed = None
        if self._allowed is None:
            self._allowed = self.allowed_now()

    def allowed_now(self) -> np.ndarray:
        """The bool mask (vocab_size,) of tokens allowed at the matcher's current state."""
        packed = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        bits = np.unpackbits(packed, bitorder="little")[:self.vocab_size]
        return bits.view(np.bool_)

    @property
    def is_complete(self) -> bool:
        """True when only EOS can follow (the grammar is satisfied and cannot grow)."""
        return self.active and self.matcher.is_stopped()

    def __call__(self, tokens: list[int], row: Any) -> Any:
        import mlx.core as mx  # here only, so the host-side logic needs no MLX

        mask = self.mask(tokens)
        return row if mask is None else mx.where(mx.array(mask), row, float("-inf"))

    def mask(self, tokens: list[int]) -> np.ndarray | None:
        """`prepare(tokens)`, then the bool mask (vocab_size,) for the next token, or None
        while the output is free (dormant)."""
        self.prepare(tokens)
        return self._allowed if self.active or self.open_with is not None else None


_COMPILERS: "weakref.WeakKeyDictionary[Any, GrammarCompiler]" = weakref.WeakKeyDictionary()
_COMPILERS_LOCK = threading.Lock()


def compiler_for(tokenizer: Any, vocab_size: int) -> GrammarCompiler:
    """The cached compiler for a model's tokenizer (runner/tokenizer.py; built on first
    use)."""
    with _COMPILERS_LOCK:
        compiler = _COMPILERS.get(tokenizer)
        if compiler is None:
            backend = tokenizer.backend
            if backend is None:
                raise InvalidRequest("structured output needs a fast (tokenizers) tokenizer")
            compiler = GrammarCompiler.from_hf(backend, vocab_size, list(tokenizer.eos_token_ids))
            _COMPILERS[tokenizer] = compiler
        return compiler


def make_grammar(tokenizer: Any, vocab_size: int, fmt: Any, num_prompt: int,
                 format_after: str | None = None,
                 open_with: int | None = None) -> GrammarProcessor:
    """Compile `fmt` for a request whose prompt has `num_prompt` tokens, with its first mask
    ready (or dormant until the output holds `format_after`'s tokens; with `open_with`, the
    token that opens a thinking section, dormant only if the output opens with it).
    Blocking (milliseconds; about 1 s the first time per model): call it off the event
    loop. Raises InvalidRequest for a format that does not compile."""
    start_after = tokenizer.encode(format_after, add_special_tokens=False) if format_after \
        else None
    processor = GrammarProcessor(compiler_for(tokenizer, vocab_size).matcher(fmt), num_prompt,
                                 vocab_size, start_after, open_with)
    processor.prepare([])
    return processor
