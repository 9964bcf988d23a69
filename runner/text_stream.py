"""Host-side text for one request: incremental detokenization and stop strings. Imports no mlx.

Invariants:
- Emitted text never ends inside a UTF-8 character: a window whose decoding ends in U+FFFD
  holds that last U+FFFD back until the next token completes it (or the request finishes).
  Only the last one can change: the decoder replaces each maximal invalid run of bytes with
  one U+FFFD, so adding bytes changes nothing before an incomplete tail. (Holding the whole
  window back held a random model's run of invalid bytes for 80 tokens, a second of silence.)
- Text that could still be the start of a stop string is held back; a stop string is never
  emitted, nor anything after it.
- Decoding works on a small window of tokens (prefix + new), so the cost per token is constant,
  and the result equals decoding all tokens at once.
- Generated text skips special tokens, except a chat format's structural ones (`output_decode`:
  gpt-oss's harmony channels and message boundaries), which the supervisor's parser reads.
"""

from __future__ import annotations

from typing import Callable

Decode = Callable[[list[int]], str]


class TextStream:
    def __init__(self, decode: Decode, stops: list[str] | None = None):
        self._decode = decode
        self._stops = [s for s in (stops or []) if s]
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self.tokens: list[int] = []
        self._prefix = 0  # start of the decode window
        self._read = 0  # tokens before this are already in the text
        self._pending = ""  # decoded, not yet emitted
        self._settled = 0  # characters of the window's new text already in `_pending`
        self.stopped = False

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def push(self, token: int) -> str:
        """Add a token; returns the text that can be emitted now."""
        if self.stopped:
            return ""
        self.tokens.append(token)
        before = self._decode(self.tokens[self._prefix:self._read])
        new = self._decode(self.tokens[self._prefix:])[len(before):]
        if new and not new.endswith("\ufffd"):
            self._pending += new[self._settled:]
            self._prefix, self._read, self._settled = self._read, len(self.tokens), 0
        elif len(new) - 1 > self._settled:  # all but an incomplete last character
            self._pending += new[self._settled:-1]
            self._settled = len(new) - 1
        return self._release(final=False)

    def flush(self) -> str:
        """The request ended without a stop string: emit what is held back."""
        if self.stopped:
            return ""
        if self._read < len(self.tokens):
            before = self._decode(self.tokens[self._prefix:self._read])
            self._pending += self._decode(self.tokens[self._prefix:])[len(before) + self._settled:]
            self._read, self._settled = len(self.tokens), 0
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        text = self._pending
        if self._stops:
            cut = min((i for i in (text.find(s) for s in self._stops) if i >= 0), default=-1)
            if cut >= 0:
                self.stopped = True
                self._pending = ""
                return text[:cut]
            if not final:
                keep = self._partial_stop_len(text)
                if keep:
                    self._pending = text[-keep:]
                    return text[:-keep]
        self._pending = ""
        return text

    def _partial_stop_len(self, text: str) -> int:
        for k in range(min(len(text), self._hold), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self._stops):
                return k
        return 0


def fast_decode(tokenizer, skip_special: bool) -> Decode:
    """The Rust tokenizer's decode when there is one (no Python overhead per call), keeping
    the leading space of generated text (`keep_leading_space`)."""
    inner = getattr(tokenizer, "backend", None)
    if inner is not None and hasattr(inner, "decode"):
        decode = lambda ids: inner.decode(ids, skip_special_tokens=skip_special)  # noqa: E731
    else:
        decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special)  # noqa: E731
    return keep_leading_space(decode, tokenizer)


def keep_leading_space(decode: Decode, tokenizer) -> Decode:
    """`decode` for text that continues other text. A SentencePiece tokenizer's decoder drops
    the space its first piece begins with (Hugging Face's `Strip` step: "▁in" alone is "in"),
    right for a whole document but not for a reply: after "Once upon a time in", the piece
    "▁in" is " in", as Ollama and llama.cpp give it (and a logprob's token text). So where the
    decoder drops it, decode after one lead piece whose text is "a" and cut that "a" off; a
    byte-level decoder drops nothing and keeps `decode` as it is."""
    try:
        lead = list(tokenizer.encode("a", add_special_tokens=False))
        if len(lead) != 1 or decode(lead) != "a" or decode(lead + lead) != "a a":
            return decode  # nothing dropped ("aa"), or a decoder this does not know
    except Exception:  # noqa: BLE001 (a tokenizer without a plain "a": decode as it is)
        return decode
    return lambda ids: decode(lead + list(ids))[1:]


# Chat formats whose structure is in special tokens the supervisor's parsers split output on:
# harmony (gpt-oss: thinking, tool calls and the answer; `<|return|>` and `<|call|>` end a
# reply, never text) and Gemma 4 (its thought channel, tool calls and their string marks).
STRUCTURAL_TOKENS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>")
GEMMA4_TOKENS = ("<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>", '<|"|>')


def structural_ids(tokenizer) -> set[int]:
    """Ids of a format's structural tokens when the tokenizer has them all, else none."""
    added_id = getattr(tokenizer, "added_id", None)  # an encoder's tokenizer has no chat format
    if added_id is None:
        return set()
    for tokens in (STRUCTURAL_TOKENS, GEMMA4_TOKENS):
        ids = {added_id(t) for t in tokens}
        if None not in ids:
            return ids
    return set()


def output_decode(tokenizer) -> Decode:
    """Text of generated ids: special tokens skipped but the structural ones."""
    keep = structural_ids(tokenizer)
    if not keep:
        return fast_decode(tokenizer, skip_special=True)
    drop = frozenset(tokenizer.special_ids() - keep)
    raw = fast_decode(tokenizer, skip_special=False)
    return lambda ids: raw([i for i in ids if i not in drop])
