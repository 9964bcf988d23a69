"""Small-vocabulary tokenizers for random-weight test models, cut from the vendored Qwen3 tokenizer.

The real Qwen3 vocabulary has 151,680 rows, far too many for dozens of tiny test models; these
keep a few thousand and still encode every text. Nothing is trained and nothing is random.

Invariants:
- The same (kind, vocab_size) writes the same bytes, and ids are dense: 0..vocab_size-1.
- Qwen3's first 256 ids are its byte symbols and merge i makes id 256 + i, so its first n ids
  together with its first n - 256 merges are a complete byte-level BPE ("bpe"): every text
  encodes, and decodes back to itself.
- "spm" keeps the 256 byte tokens <0x00>..<0xFF> (byte fallback), so every text encodes too. Its
  merges are every split of a piece into two pieces, ranked by the piece's rank: SentencePiece's
  own rule, which a GGUF holding only tokens and scores (score = -rank) rebuilds exactly.
- Only the head of the vendored file is decompressed and read (~0.2 s), once per process and size.
"""

from __future__ import annotations

import functools
import json
import lzma
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from mlxr.shared.assets import QWEN3_DIR
from mlxr.supervisor.store.gguf.tokenizer import (
    GEMMA4_SPLIT,
    SPACE,
    added_token,
    bpe_model,
    sentencepiece_merges,
    spm_decoder,
    spm_normalizer,
    template_post_processor,
)

KINDS = ("bpe", "spm", "harmony", "gemma4")
QWEN3_NUM_TOKENS = 151643  # its BPE vocab; the added tokens follow
MODEL_MAX_LENGTH = 32768
BPE_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# gpt-oss's: its BPE is byte-level too; its chat format ("harmony") lives in these tokens.
HARMONY_SPECIALS = ("<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>",
                    "<|channel|>", "<|start|>", "<|end|>", "<|message|>", "<|call|>")
HARMONY_TEMPLATE = "harmony_template.jinja"
SPM_CONTROLS = ("<unk>", "<s>", "</s>")
# Gemma 4's: SentencePiece-style BPE with its controls at Gemma's ids, split at newlines, no
# space prepended; its chat format lives in these tokens (gemma4_template.jinja).
GEMMA4_CONTROLS = ("<pad>", "<eos>", "<bos>", "<unk>")
GEMMA4_SPECIALS = ("<|turn>", "<turn|>", "<|think|>", "<|channel>", "<channel|>", "<|tool>",
                   "<tool|>", "<|tool_call>", "<tool_call|>", "<|tool_response>",
                   "<tool_response|>", '<|"|>')
GEMMA4_TEMPLATE = "gemma4_template.jinja"
SPM_CHAT_SPECIALS = ("<|im_start|>", "<|im_end|>")
_JSON_STRING = r'"(?:[^"\\]|\\.)*"'
_VOCAB_ENTRY = re.compile(rf"({_JSON_STRING})\s*:\s*(\d+)")
_MERGE_ENTRY = re.compile(rf"\[\s*({_JSON_STRING})\s*,\s*({_JSON_STRING})\s*\]")


@dataclass(frozen=True, slots=True)
class SmallTokenizer:
    kind: str  # "bpe" (byte-level, GGUF "gpt2") or "spm" (SentencePiece-style BPE, GGUF "llama")
    vocab_size: int  # total ids, special tokens included
    bos_id: int | None
    eos_ids: tuple[int, ...]
    pad_id: int | None


def write_small_tokenizer(dest: Path, kind: str, vocab_size: int = 2048) -> SmallTokenizer:
    """Write tokenizer.json and tokenizer_config.json (ChatML template; gpt-oss's harmony
    format for "harmony") into `dest`."""
    if kind not in KINDS:
        raise ValueError(f"unknown small tokenizer kind {kind!r} (expected one of {KINDS})")
    build = {"bpe": _bpe_files, "spm": _spm_files, "harmony": _harmony_files,
             "gemma4": _gemma4_files}[kind]
    tokenizer_json, config, info = build(vocab_size)
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "tokenizer.json").write_bytes(_dump(tokenizer_json))
    (dest / "tokenizer_config.json").write_bytes(_dump(config))
    return info


# --- the vendored Qwen3 tokenizer, head only ---------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Qwen3Head:
    sections: dict  # the tokenizer.json keys before "model": normalizer, pre_tokenizer, decoder...
    tokens: tuple[str, ...]  # ids 0..n-1, byte-level spelling
    merges: tuple[tuple[str, str], ...]  # the first n - 256 merges (merge i makes id 256 + i)


@functools.cache
def _qwen3_head(num_tokens: int) -> _Qwen3Head:
    """Qwen3's first `num_tokens` ids and their merges, decompressing no more than needed."""
    num_merges = num_tokens - 256
    text = _qwen3_text(num_merges)
    model_at = text.index('"model"')
    sections = json.loads(text[: text.rindex(",", 0, model_at)] + "}")
    vocab_at = text.index('"vocab"', model_at)
    merges_at = text.index('"merges"', vocab_at)
    tokens = _first_vocab_entries(text[vocab_at:merges_at], num_tokens)
    pairs = _take(_MERGE_ENTRY.finditer(text, merges_at), num_merges)
    halves = _json_strings(half for match in pairs for half in (match[1], match[2]))
    merges = tuple(zip(halves[0::2], halves[1::2]))
    for i, (left, right) in enumerate(merges):  # the invariant the cut relies on
        assert left + right == tokens[256 + i], (i, left, right)
    return _Qwen3Head(sections, tokens, merges)


def _qwen3_text(num_merges: int) -> str:
    """The head of Qwen3's tokenizer.json, through at least its first `num_merges` merges (the
    vocab comes first, in id order; a merge entry that matches is whole, being closed by "])."""
    decompressor = lzma.LZMADecompressor()
    data = bytearray()
    with open(QWEN3_DIR / "tokenizer.json.xz", "rb") as src:
        while block := src.read(1 << 18):
            data += decompressor.decompress(block)
            if b'"merges"' not in data:
                continue
            text = data.decode("utf-8", errors="ignore")  # may end inside a character
            entries = _MERGE_ENTRY.finditer(text, text.index('"merges"'))
            if sum(1 for _ in _take(entries, num_merges)) == num_merges:
                return text
    raise ValueError(f"Qwen3 has fewer than {num_merges} merges")


def _first_vocab_entries(section: str, count: int) -> tuple[str, ...]:
    matches = list(_take(_VOCAB_ENTRY.finditer(section), count))
    assert [int(m[2]) for m in matches] == list(range(count)), "Qwen3's vocab is in id order"
    return _json_strings(m[1] for m in matches)


def _json_strings(literals: Iterable[str]) -> tuple[str, ...]:
    return tuple(json.loads("[" + ",".join(literals) + "]"))


def _take(iterator, count: int):
    for index, item in enumerate(iterator):
        if index >= count:
            return
        yield item


# --- "bpe": Qwen3's byte-level BPE, cut ---------------------------------------------------------


def _bpe_files(vocab_size: int) -> tuple[dict, dict, SmallTokenizer]:
    tokenizer_json, ids = _byte_level(vocab_size, BPE_SPECIALS)
    info = SmallTokenizer(
        kind="bpe",
        vocab_size=vocab_size,
        bos_id=None,
        eos_ids=(ids["<|im_end|>"], ids["<|endoftext|>"]),
        pad_id=ids["<|endoftext|>"],
    )
    config = _tokenizer_config(
        BPE_SPECIALS, bos=None, eos="<|im_end|>", pad="<|endoftext|>", unk=None, add_bos=False
    )
    return tokenizer_json, config, info


def _byte_level(vocab_size: int, specials: tuple[str, ...]) -> tuple[dict, dict[str, int]]:
    num_normal = vocab_size - len(specials)
    if num_normal < 256:
        raise ValueError(f"a byte-level tokenizer needs vocab_size >= {256 + len(specials)}")
    head = _qwen3_head(num_normal)
    ids = {name: num_normal + i for i, name in enumerate(specials)}
    sections = head.sections
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [added_token(ids[name], name) for name in specials],
        "normalizer": sections["normalizer"],
        "pre_tokenizer": sections["pre_tokenizer"],
        "post_processor": sections["post_processor"],
        "decoder": sections["decoder"],
        "model": bpe_model({t: i for i, t in enumerate(head.tokens)}, head.merges),
    }, ids


def _harmony_files(vocab_size: int) -> tuple[dict, dict, SmallTokenizer]:
    tokenizer_json, ids = _byte_level(vocab_size, HARMONY_SPECIALS)
    # gpt-oss's generation config: <|return|>, <|endoftext|>, <|call|> end a reply
    info = SmallTokenizer(kind="harmony", vocab_size=vocab_size, bos_id=ids["<|startoftext|>"],
                          eos_ids=(ids["<|return|>"], ids["<|endoftext|>"], ids["<|call|>"]),
                          pad_id=ids["<|endoftext|>"])
    config = _tokenizer_config(HARMONY_SPECIALS, bos="<|startoftext|>", eos="<|return|>",
                               pad="<|endoftext|>", unk=None, add_bos=False)
    config["chat_template"] = (Path(__file__).parent / HARMONY_TEMPLATE).read_text()
    return tokenizer_json, config, info


# --- "spm": SentencePiece-style BPE with byte fallback, derived from the same cut --------------


def _spm_files(vocab_size: int) -> tuple[dict, dict, SmallTokenizer]:
    tokenizer_json, vocab, specials = _spm_tokenizer(
        SPM_CONTROLS, SPM_CHAT_SPECIALS, vocab_size, "<s>", add_space_prefix=True)
    info = SmallTokenizer(
        kind="spm",
        vocab_size=vocab_size,
        bos_id=vocab["<s>"],
        eos_ids=(vocab["</s>"], vocab["<|im_end|>"]),
        pad_id=None,
    )
    config = _tokenizer_config(specials, bos="<s>", eos="</s>", pad=None, unk="<unk>", add_bos=True)
    return tokenizer_json, config, info


def _gemma4_files(vocab_size: int) -> tuple[dict, dict, SmallTokenizer]:
    split = {"type": "Split", "pattern": {"Regex": GEMMA4_SPLIT}, "behavior": "Isolated",
             "invert": False}
    tokenizer_json, vocab, specials = _spm_tokenizer(
        GEMMA4_CONTROLS, GEMMA4_SPECIALS, vocab_size, "<bos>", add_space_prefix=False,
        pre_tokenizer=split, ignore_merges=True)
    # a reply ends at <turn|>, or at <|tool_response> after its calls
    info = SmallTokenizer(kind="gemma4", vocab_size=vocab_size, bos_id=vocab["<bos>"],
                          eos_ids=(vocab["<eos>"], vocab["<turn|>"], vocab["<|tool_response>"]),
                          pad_id=vocab["<pad>"])
    config = _tokenizer_config(specials, bos="<bos>", eos="<eos>", pad="<pad>", unk="<unk>",
                               add_bos=True)
    config["chat_template"] = (Path(__file__).parent / GEMMA4_TEMPLATE).read_text()
    return tokenizer_json, config, info


def _spm_tokenizer(controls: tuple[str, ...], chat: tuple[str, ...], vocab_size: int, bos: str,
                   *, add_space_prefix: bool, pre_tokenizer: dict | None = None,
                   ignore_merges: bool = False) -> tuple[dict, dict[str, int], tuple[str, ...]]:
    """tokenizer.json of a SentencePiece-style BPE: `controls`, the 256 byte tokens, text
    pieces, then the `chat` tokens; BOS added in front. Also its vocabulary and specials."""
    num_fixed = len(controls) + 256 + len(chat)
    num_pieces = vocab_size - num_fixed
    if num_pieces < 128:
        raise ValueError(f"an spm tokenizer needs vocab_size >= {num_fixed + 128}")
    fixed = [*controls, *(f"<0x{b:02X}>" for b in range(256))]
    pieces = _spm_pieces(num_pieces, taken=set(fixed) | set(chat))
    tokens = [*fixed, *pieces, *chat]
    vocab = {token: i for i, token in enumerate(tokens)}
    model = bpe_model(vocab, sentencepiece_merges(pieces), ignore_merges)
    model.update(unk_token="<unk>", fuse_unk=True, byte_fallback=True)
    specials = (*controls, *chat)
    tokenizer_json = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [added_token(vocab[name], name) for name in specials],
        "normalizer": spm_normalizer(add_space_prefix=add_space_prefix),
        "pre_tokenizer": pre_tokenizer,
        "post_processor": template_post_processor(bos=(bos, vocab[bos]), eos=None),
        "decoder": spm_decoder(add_space_prefix=add_space_prefix),
        "model": model,
    }
    return tokenizer_json, vocab, specials


def _spm_pieces(count: int, taken: set[str]) -> list[str]:
    """The first `count` Qwen3 tokens, in id order, that are whole UTF-8 text; spaces as "▁"."""
    num_tokens = 256 + count + count // 2  # most Qwen3 tokens are whole UTF-8 text
    while True:
        head = _qwen3_head(min(num_tokens, QWEN3_NUM_TOKENS))
        pieces = list(_take(_text_pieces(head.tokens, taken), count))
        if len(pieces) == count:
            return pieces
        if num_tokens >= QWEN3_NUM_TOKENS:
            raise ValueError(f"Qwen3 has fewer than {count} text pieces")
        num_tokens *= 2


def _text_pieces(tokens: Iterable[str], taken: set[str]) -> Iterator[str]:
    seen = set(taken)
    for token in tokens:
        piece = _byte_level_text(token)
        if piece is not None and piece not in seen:
            seen.add(piece)
            yield piece


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: printable bytes stand for themselves, the other 68
    bytes take the code points from 256 up, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    shifted = [b for b in range(256) if b not in printable]
    table = {chr(b): b for b in printable}
    table.update({chr(256 + i): b for i, b in enumerate(shifted)})
    return table


def _byte_level_text(token: str) -> str | None:
    table = _byte_decoder()
    try:
        text = bytes(table[ch] for ch in token).decode("utf-8")
    except (KeyError, UnicodeDecodeError):
        return None
    return text.replace(" ", SPACE)


# --- tokenizer.json and tokenizer_config.json pieces ---------------------------------------


def _tokenizer_config(specials, *, bos, eos, pad, unk, add_bos: bool) -> dict:
    qwen3 = json.loads((QWEN3_DIR / "tokenizer_config.json").read_text(encoding="utf-8"))
    return {
        "add_bos_token": add_bos,
        "add_eos_token": False,
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": pad,
        "unk_token": unk,
        "additional_special_tokens": [s for s in specials if s not in (bos, eos, pad, unk)],
        "chat_template": qwen3["chat_template"],
        "clean_up_tokenization_spaces": False,
        "model_max_length": MODEL_MAX_LENGTH,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


def _dump(value: dict) -> bytes:
    # No indent: the C encoder only serves compact output, and a 150k-token vocab is 10x faster.
    return (json.dumps(value, ensure_ascii=False) + "\n").encode("utf-8")
