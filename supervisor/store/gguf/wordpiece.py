"""GGUF's "bert" tokenizer (BERT's WordPiece, as llama.cpp's converter stores it) <-> a Hugging
Face tokenizer.json and tokenizer_config.json, for the encoder models of GGUF embedding files
(all-minilm, mxbai-embed-large, nomic-embed-text, snowflake-arctic-embed...).

llama.cpp stores WordPiece in "phantom space" form: a piece that starts a word gets "▁" in front,
a continuation piece loses its "##", and control tokens ([CLS], [SEP], ...) stay as they are.
Reading reverses that exactly (the map is one-to-one on a WordPiece vocabulary).

Invariants:
- Ids are kept: token i of `tokenizer.ggml.tokens` is id i of the WordPiece vocab.
- Text is normalized as BERT's uncased tokenizers do (clean control characters, split CJK
  characters, strip accents, lowercase) unless `tokenizer.ggml.normalizer.lowercase` is false;
  llama.cpp lowercased every file before that key existed, so its absence means true.
- Every input is wrapped [CLS] ... [SEP] (BOS and separator ids, else the tokens of those
  names), as llama.cpp and sentence-transformers both do.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gguf import Keys, TokenType

from mlxr.shared.errors import InvalidModelFile

from .tokenizer import UnsupportedTokenizer, added_token

K = Keys.Tokenizer
KIND = "bert"
SPACE = "\u2581"
LOWERCASE_KEY = "tokenizer.ggml.normalizer.lowercase"
_CLS_KEY = "tokenizer.ggml.cls_token_id"  # older files; newer ones give the BOS id
_SPECIAL_TYPES = (TokenType.CONTROL, TokenType.UNKNOWN)


def check_tokenizer(kv: Mapping[str, Any]) -> None:
    """An encoder's tokenizer must be WordPiece or SentencePiece Unigram (XLM-RoBERTa's,
    unigram.py); else UnsupportedTokenizer naming it."""
    if kv.get(K.MODEL) not in (KIND, "t5"):
        raise UnsupportedTokenizer(f'unsupported GGUF tokenizer "{kv.get(K.MODEL)}" for an '
                                   'encoder; mlxr reads the WordPiece ("bert") and '
                                   'SentencePiece Unigram ("t5") kinds')


def encoder_files(kv: Mapping[str, Any]) -> dict[str, bytes]:
    """tokenizer.json and tokenizer_config.json of an encoder, of either kind."""
    from . import unigram

    return hf_files(kv) if kv.get(K.MODEL) == KIND else unigram.hf_files(kv)


def hf_files(kv: Mapping[str, Any]) -> dict[str, bytes]:
    """{"tokenizer.json": ..., "tokenizer_config.json": ...} from GGUF metadata values."""
    tokens = list(kv[K.LIST])
    types = [int(t) for t in kv.get(K.TOKEN_TYPE) or [TokenType.NORMAL] * len(tokens)]
    vocab: dict[str, int] = {}
    for token_id, (token, kind) in enumerate(zip(tokens, types)):
        vocab.setdefault(_wordpiece(token, kind), token_id)
    if len(vocab) != len(tokens):
        raise InvalidModelFile(f"the GGUF WordPiece vocabulary repeats {len(tokens) - len(vocab)} "
                               "tokens")
    cls = _special(kv, tokens, (_CLS_KEY, K.BOS_ID), "[CLS]")
    sep = _special(kv, tokens, (K.SEP_ID, K.EOS_ID), "[SEP]")
    unk = _special(kv, tokens, (K.UNK_ID,), "[UNK]")
    pad = _special(kv, tokens, (K.PAD_ID,), "[PAD]")
    mask = _special(kv, tokens, (K.MASK_ID,), "[MASK]")
    if cls is None or sep is None:
        raise InvalidModelFile("the GGUF WordPiece vocabulary has no [CLS] or [SEP] token")
    lowercase = bool(kv.get(LOWERCASE_KEY, True))
    special_ids = {t[1] for t in (cls, sep, unk, pad, mask) if t}
    added = [added_token(i, tokens[i]) for i, kind in enumerate(types)
             if kind in _SPECIAL_TYPES or i in special_ids]
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "BertNormalizer", "clean_text": True,
                       "handle_chinese_chars": True, "strip_accents": None,
                       "lowercase": lowercase},
        "pre_tokenizer": {"type": "BertPreTokenizer"},
        "post_processor": cls_sep(cls, sep),
        "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": True},
        "model": {"type": "WordPiece", "unk_token": unk[0] if unk else "[UNK]",
                  "continuing_subword_prefix": "##", "max_input_chars_per_word": 100,
                  "vocab": vocab},
    }
    config = {"cls_token": cls[0], "sep_token": sep[0], "unk_token": unk and unk[0],
              "pad_token": pad and pad[0], "mask_token": mask and mask[0],
              "do_lower_case": lowercase, "clean_up_tokenization_spaces": True,
              "tokenizer_class": "PreTrainedTokenizerFast"}
    return {"tokenizer.json": _dump(tokenizer), "tokenizer_config.json": _dump(config)}


def cls_sep(cls: tuple[str, int], sep: tuple[str, int]) -> dict:
    """BERT's template: [CLS] A [SEP], and [CLS] A [SEP] B [SEP] for pairs."""
    def token(t: tuple[str, int], type_id: int) -> dict:
        return {"SpecialToken": {"id": t[0], "type_id": type_id}}

    def text(name: str, type_id: int) -> dict:
        return {"Sequence": {"id": name, "type_id": type_id}}

    return {"type": "TemplateProcessing",
            "single": [token(cls, 0), text("A", 0), token(sep, 0)],
            "pair": [token(cls, 0), text("A", 0), token(sep, 0), text("B", 1), token(sep, 1)],
            "special_tokens": {t: {"id": t, "ids": [i], "tokens": [t]} for t, i in (cls, sep)}}


def _wordpiece(token: str, kind: int) -> str:
    if kind in _SPECIAL_TYPES:
        return token
    return token[1:] if token.startswith(SPACE) else "##" + token


def _special(kv: Mapping[str, Any], tokens: list[str], keys: tuple[str, ...],
             name: str) -> tuple[str, int] | None:
    """(token, id) at the first of `keys` the file gives, else the token spelled `name`."""
    for key in keys:
        token_id = kv.get(key)
        if isinstance(token_id, int) and 0 <= token_id < len(tokens):
            return tokens[token_id], token_id
    return (name, tokens.index(name)) if name in tokens else None


def _dump(value: dict) -> bytes:
    return (json.dumps(value, ensure_ascii=False) + "\n").encode("utf-8")


# --- Hugging Face -> GGUF (for writing test files) ----------------------------------------------


def gguf_fields(model_dir: Path, vocab_size: int | None = None) -> dict[str, Any]:
    """`tokenizer.*` GGUF fields for the WordPiece tokenizer in `model_dir`, as llama.cpp's
    converter writes them (phantom-space tokens; special tokens CONTROL; padded with UNUSED
    "[PADn]" tokens up to the model's `vocab_size`)."""
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text(encoding="utf-8"))
    model = tokenizer["model"]
    if model.get("type") != "WordPiece":
        raise ValueError(f'not a WordPiece tokenizer: "{model.get("type")}"')
    by_id = {i: t for t, i in model["vocab"].items()}
    special = {a["id"] for a in tokenizer.get("added_tokens", ()) if a.get("special")}
    tokens, types = [], []
    for i in range(max(max(by_id) + 1, vocab_size or 0)):
        token = by_id.get(i)
        if token is None:
            tokens.append(f"{SPACE}[PAD{i}]")
            types.append(int(TokenType.UNUSED))
        elif i in special:
            tokens.append(token)
            types.append(int(TokenType.CONTROL))
        else:
            tokens.append(token[2:] if token.startswith("##") else SPACE + token)
            types.append(int(TokenType.NORMAL))
    ids = {t: i for i, t in enumerate(tokens)}
    normalizer = tokenizer.get("normalizer") or {}
    fields: dict[str, Any] = {
        K.MODEL: KIND, K.PRE: "default", K.LIST: tokens, K.TOKEN_TYPE: types,
        K.ADD_BOS: True, K.ADD_EOS: True, K.ADD_SEP: False,
        LOWERCASE_KEY: bool(normalizer.get("lowercase", True)),
    }
    for key, name in ((K.BOS_ID, "[CLS]"), (K.EOS_ID, "[SEP]"), (K.SEP_ID, "[SEP]"),
                      (K.UNK_ID, "[UNK]"), (K.PAD_ID, "[PAD]"), (K.MASK_ID, "[MASK]")):
        if name in ids:
            fields[key] = ids[name]
    return fields
