"""GGUF's "t5" tokenizer (a SentencePiece Unigram model, as llama.cpp stores XLM-RoBERTa's:
bge-m3, snowflake-arctic-embed2, paraphrase-multilingual) <-> a Hugging Face tokenizer.json
and tokenizer_config.json.

The file holds every piece with its score and type, SentencePiece's normalization table
(`precompiled_charsmap`, NFKC-like) and its whitespace settings. Reading rebuilds what
SentencePiece (and llama.cpp's UGM tokenizer, which follows it) does with them:
- normalize with the charsmap; with `remove_extra_whitespaces` (the default), strip both ends
  and collapse runs of spaces;
- replace spaces with "▁", with one in front when `add_space_prefix` (the default);
- the Viterbi split over the pieces' scores, a word at a time (SentencePiece splits at
  whitespace; no piece holds "▁" past its start);
- `<s> A </s>` around every input (BOS and EOS), as XLM-RoBERTa's tokenizers do.

Invariants:
- Ids are kept: token i of `tokenizer.ggml.tokens` is id i of the Unigram vocab, with its score.
- CONTROL, UNKNOWN and USER_DEFINED tokens are added tokens (special but for USER_DEFINED), so
  their text in an input is that token, as in llama.cpp.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gguf import Keys, TokenType

from mlxr.shared.errors import InvalidModelFile

from .tokenizer import added_token
from .wordpiece import cls_sep

K = Keys.Tokenizer
KIND = "t5"
SPACE = "\u2581"
_SPECIAL_TYPES = (TokenType.CONTROL, TokenType.UNKNOWN)


def hf_files(kv: Mapping[str, Any]) -> dict[str, bytes]:
    """{"tokenizer.json": ..., "tokenizer_config.json": ...} from GGUF metadata values."""
    tokens = list(kv[K.LIST])
    scores = [float(s) for s in kv.get(K.SCORES) or [0.0] * len(tokens)]
    types = [int(t) for t in kv.get(K.TOKEN_TYPE) or [TokenType.NORMAL] * len(tokens)]
    if not (len(tokens) == len(scores) == len(types)):
        raise InvalidModelFile("the GGUF Unigram vocabulary's tokens, scores and types differ "
                               "in length")
    unk = _id(kv, K.UNK_ID) if _id(kv, K.UNK_ID) is not None else next(
        (i for i, t in enumerate(types) if t == TokenType.UNKNOWN), None)
    bos, eos = _id(kv, K.BOS_ID), _id(kv, K.EOS_ID)
    if unk is None or bos is None or eos is None:
        raise InvalidModelFile("the GGUF Unigram vocabulary names no unknown, BOS or EOS token")
    normalizers: list[dict] = []
    charsmap = kv.get(K.PRECOMPILED_CHARSMAP)
    if charsmap:
        data = bytes(int(b) & 0xFF for b in charsmap)
        normalizers.append({"type": "Precompiled",
                            "precompiled_charsmap": base64.b64encode(data).decode("ascii")})
    if kv.get(K.REMOVE_EXTRA_WS, True):
        normalizers += [{"type": "Strip", "strip_left": True, "strip_right": True},
                        {"type": "Replace", "pattern": {"Regex": " {2,}"}, "content": " "}]
    scheme = "always" if kv.get(K.ADD_PREFIX, True) else "never"
    metaspace = {"replacement": SPACE, "prepend_scheme": scheme, "split": True}
    added = [added_token(i, tokens[i], special=kind in _SPECIAL_TYPES)
             for i, kind in enumerate(types)
             if kind in _SPECIAL_TYPES or kind == TokenType.USER_DEFINED]
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "Sequence", "normalizers": normalizers},
        "pre_tokenizer": {"type": "Metaspace", **metaspace},
        "post_processor": cls_sep((tokens[bos], bos), (tokens[eos], eos)),
        "decoder": {"type": "Metaspace", **metaspace},
        "model": {"type": "Unigram", "unk_id": unk, "byte_fallback": False,
                  "vocab": [[t, s] for t, s in zip(tokens, scores)]},
    }
    pad = _id(kv, K.PAD_ID)
    config = {"bos_token": tokens[bos], "eos_token": tokens[eos], "unk_token": tokens[unk],
              "cls_token": tokens[bos], "sep_token": tokens[eos],
              "pad_token": None if pad is None else tokens[pad],
              "clean_up_tokenization_spaces": True,
              "tokenizer_class": "PreTrainedTokenizerFast"}
    return {"tokenizer.json": _dump(tokenizer), "tokenizer_config.json": _dump(config)}


def _id(kv: Mapping[str, Any], key: str) -> int | None:
    value = kv.get(key)
    tokens = kv.get(K.LIST) or ()
    return value if isinstance(value, int) and 0 <= value < len(tokens) else None


def _dump(value: dict) -> bytes:
    return (json.dumps(value, ensure_ascii=False) + "\n").encode("utf-8")


# --- Hugging Face -> GGUF (for writing test files) ----------------------------------------------


def gguf_fields(model_dir: Path) -> dict[str, Any]:
    """`tokenizer.*` GGUF fields for the Unigram tokenizer.json in `model_dir`, as llama.cpp's
    converter writes XLM-RoBERTa's from it (pieces, scores; special tokens CONTROL, the
    unknown token UNKNOWN; the charsmap and whitespace settings)."""
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text(encoding="utf-8"))
    model = tokenizer["model"]
    if model.get("type") != "Unigram":
        raise ValueError(f'not a Unigram tokenizer: "{model.get("type")}"')
    tokens = [piece for piece, _ in model["vocab"]]
    scores = [float(score) for _, score in model["vocab"]]
    special = {a["id"] for a in tokenizer.get("added_tokens", ()) if a.get("special")}
    unk = int(model.get("unk_id") or 0)
    types = [TokenType.UNKNOWN if i == unk else TokenType.CONTROL if i in special
             else TokenType.NORMAL for i in range(len(tokens))]
    charsmap = _precompiled(tokenizer.get("normalizer"))
    config = json.loads((model_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    ids = {t: i for i, t in enumerate(tokens)}
    fields: dict[str, Any] = {
        K.MODEL: KIND, K.PRE: "default", K.LIST: tokens, K.SCORES: scores,
        K.TOKEN_TYPE: [int(t) for t in types], K.ADD_PREFIX: True, K.REMOVE_EXTRA_WS: True,
        K.BOS_ID: ids[config.get("bos_token") or "<s>"],
        K.EOS_ID: ids[config.get("eos_token") or "</s>"], K.UNK_ID: unk,
        K.ADD_BOS: True, K.ADD_EOS: True,
    }
    fields[K.SEP_ID], fields["tokenizer.ggml.add_sep_token"] = fields[K.EOS_ID], True
    for key, name in ((K.PAD_ID, "pad_token"), (K.MASK_ID, "mask_token")):
        if config.get(name) in ids:
            fields[key] = ids[config[name]]
    if charsmap:
        fields[K.PRECOMPILED_CHARSMAP] = list(charsmap)
    return fields


def _precompiled(normalizer: Any) -> bytes:
    """The charsmap of a Precompiled normalizer, alone or in a Sequence."""
    if not isinstance(normalizer, dict):
        return b""
    if normalizer.get("type") == "Precompiled":
        return base64.b64decode(normalizer.get("precompiled_charsmap") or "")
    for inner in normalizer.get("normalizers") or ():
        if found := _precompiled(inner):
            return found
    return b""
