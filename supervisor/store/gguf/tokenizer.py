"""GGUF tokenizer metadata (`tokenizer.ggml.*`) <-> a Hugging Face tokenizer.json and
tokenizer_config.json, for the two kinds of tokenizer llama.cpp's converter writes for chat models:
"gpt2" (byte-level BPE: GPT-2, Llama 3, Qwen, SmolLM, Granite...) and "llama" (SentencePiece BPE
with byte fallback: Llama 2, Mistral, Gemma, Phi-3...). Anything else is UnsupportedTokenizer.
`kv` holds plain values keyed by GGUF key, as `GGUFReader.fields[key].contents()` returns them.

Invariants:
- Ids are kept: token i of `tokenizer.ggml.tokens` is id i of the written vocabulary, and every
  token, padding and control ones included, is in the BPE model's vocab at its id (so the ids
  `added_tokens` name are the ones the tokenizers library assigns on load).
- CONTROL and UNKNOWN tokens, and the tokens at the special ids (bos, eos, eot, eom, pad, unk),
  are special added tokens; USER_DEFINED ones are plain added tokens. Both are matched whole in
  the raw text before any normalization, as llama.cpp does.
- "gpt2": the merges come from `tokenizer.ggml.merges`; `tokenizer.ggml.pre` names the split
  regexes (PRE_TOKENIZER_SPLITS, after llama.cpp's table), written in the form the models' own
  tokenizer.json uses; an unknown name falls back to GPT-2's regex with a warning.
- "llama": the merges come from `tokenizer.ggml.merges` when present, else from the vocabulary:
  every split of a normal token into two normal tokens, ranked best-first by the joined token's
  score (ties: lower id, then shorter left part). That is SentencePiece's own encoding rule (and
  llama.cpp's), so the recovered tokenizer encodes as llama.cpp does. "▁" stands for a space;
  `add_space_prefix` (default true; Gemma false) prepends one to each text run between special
  tokens (llama.cpp's and Llama 2's "legacy" behaviour), and the decoder strips it.
- BOS/EOS are added by a post-processor when `add_bos_token`/`add_eos_token` say so; absent,
  llama.cpp's defaults apply (BOS on for "llama" and for Llama 3's "gpt2" pre-tokenizers).
- The inverse, `gguf_tokenizer_fields`, names the `pre` whose regexes match the tokenizer.json
  and writes scores consistent with merge order (a merge result scores minus the rank of its
  first merge), so the recovery above rebuilds the same merges for SentencePiece-style merges.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gguf import Keys, TokenType

from mlxr.shared.errors import InvalidRequest, UnsupportedModel

from .pretokenizers import (GPT2_SPLIT, PRE_TOKENIZER_SPLITS, WHOLE_WORD_PRES, NFC_PRES)

log = logging.getLogger(__name__)

K = Keys.Tokenizer
SPACE = "\u2581"  # "▁", SentencePiece's visible space


class UnsupportedTokenizer(UnsupportedModel):
    """A GGUF tokenizer kind mlxr cannot rebuild (the message names it)."""


# Turn-ending tokens llama.cpp recognizes by their text; extra eos ids when typed CONTROL.
END_OF_TURN_TEXTS = {
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
    "<|eom_id|>", "<EOT>", "<|return|>", "<|call|>", "<｜end▁of▁sentence｜>",
}
# gpt-oss's harmony format ends a reply with <|return|> or <|call|>; its <|end|> closes one
# message of several (thinking, then the answer), so there it does not end the turn.
HARMONY_END = "<|return|>"
EOS_IDS_KEY = "tokenizer.ggml.eos_token_ids"  # Ollama's list of end-of-sequence ids
SPECIAL_ID_KEYS = {
    "bos_token": K.BOS_ID,
    "eos_token": K.EOS_ID,
    "pad_token": K.PAD_ID,
    "unk_token": K.UNK_ID,
}


# --- GGUF -> Hugging Face -----------------------------------------------------------------------


KINDS = ("gpt2", "llama", "gemma4")  # byte-level BPE, SentencePiece, Gemma 4's BPE
GEMMA4 = "gemma4"  # llama.cpp's tokenizer model, and Ollama's pre-tokenizer for it
# Gemma 4's BPE splits text only at newlines (a run of them is one word).
GEMMA4_SPLIT = "[^\n]+|[\n]+"


def check_tokenizer(kv: Mapping[str, Any]) -> str:
    """The tokenizer kind of GGUF metadata; UnsupportedTokenizer unless one of KINDS."""
    kind = kv.get(K.MODEL)
    if kind not in KINDS:
        raise UnsupportedTokenizer(f'unsupported GGUF tokenizer "{kind}"; mlxr reads the '
                                   'BPE ("gpt2"), SentencePiece ("llama") and Gemma 4 '
                                   '("gemma4") kinds')
    return kind


def is_gemma4(kv: Mapping[str, Any]) -> bool:
    """Gemma 4's tokenizer: llama.cpp's files name the model "gemma4", Ollama's "llama" with
    pre-tokenizer "gemma4"."""
    return kv.get(K.MODEL) == GEMMA4 or (kv.get(K.MODEL) == "llama" and kv.get(K.PRE) == GEMMA4)


def hf_tokenizer_files(kv: Mapping[str, Any]) -> dict[str, bytes]:
    """{"tokenizer.json": ..., "tokenizer_config.json": ...} from GGUF metadata values."""
    kind = check_tokenizer(kv)
    vocab = _Vocab.read(kv)
    if is_gemma4(kv):
        build = _gemma4_tokenizer
    else:
        build = _byte_level_tokenizer if kind == "gpt2" else _sentencepiece_tokenizer
    return {
        "tokenizer.json": _dump(build(kv, vocab)),
        "tokenizer_config.json": _dump(_tokenizer_config(kv, vocab)),
    }


def special_token_ids(kv: Mapping[str, Any]) -> dict[str, Any]:
    """bos/eos/pad ids for config.json; eot, eom and turn-ending control tokens join eos."""
    eos = [int(kv[key]) for key in (K.EOS_ID, K.EOT_ID, K.EOM_ID) if kv.get(key) is not None]
    listed = kv.get(EOS_IDS_KEY)
    eos += [int(i) for i in listed] if isinstance(listed, (list, tuple)) else []
    types = kv.get(K.TOKEN_TYPE) or ()
    tokens = kv.get(K.LIST) or ()
    texts = END_OF_TURN_TEXTS - ({"<|end|>"} if HARMONY_END in tokens else set())
    for token_id, token in enumerate(tokens):
        if token in texts and (not types or types[token_id] == TokenType.CONTROL):
            eos.append(token_id)
    eos = list(dict.fromkeys(eos))
    return {
        "bos_token_id": _optional_int(kv.get(K.BOS_ID)),
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        "pad_token_id": _optional_int(kv.get(K.PAD_ID)),
    }


@dataclass(slots=True)
class _Vocab:
    """The file's tokens as BPE vocab keys, their types, and which ids are special."""

    keys: list[str]
    types: list[int]
    respelled: set[int]  # user-defined whitespace tokens, stored with spaces, keyed with "▁"
    special_ids: set[int]

    @classmethod
    def read(cls, kv: Mapping[str, Any]) -> _Vocab:
        keys = list(kv[K.LIST])
        types = [int(t) for t in kv.get(K.TOKEN_TYPE) or [TokenType.NORMAL] * len(keys)]
        respelled = set()
        if kv.get(K.MODEL) == "llama":  # llama.cpp stores these "pre-normalized"
            for i, token in enumerate(keys):
                if types[i] == TokenType.USER_DEFINED and token and not token.strip(" "):
                    keys[i] = token.replace(" ", SPACE)
                    respelled.add(i)
        vocab = cls(keys, types, respelled, set())
        vocab.special_ids = {token[1] for key in _SPECIAL_KEYS if (token := vocab.token(kv, key))}
        return vocab

    def token(self, kv: Mapping[str, Any], key: str) -> tuple[str, int] | None:
        """(token, id) at the id `key` names; None when absent or out of range (as llama.cpp)."""
        token_id = kv.get(key)
        if token_id is None or not 0 <= int(token_id) < len(self.keys):
            return None
        return self.keys[int(token_id)], int(token_id)


_SPECIAL_KEYS = (K.BOS_ID, K.EOS_ID, K.EOT_ID, K.EOM_ID, K.PAD_ID, K.UNK_ID)


def _byte_level_tokenizer(kv: Mapping[str, Any], vocab: _Vocab) -> dict:
    pre = kv.get(K.PRE) or ""
    splits = PRE_TOKENIZER_SPLITS.get(pre)
    if splits is None:
        log.warning('unknown GGUF pre-tokenizer "%s": splitting text with GPT-2\'s regex', pre)
        splits = (GPT2_SPLIT,)
    merges = _given_merges(kv)
    if merges is None:
        raise UnsupportedTokenizer('GGUF tokenizer "gpt2" without tokenizer.ggml.merges')
    byte_level = {"add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    split_steps = [
        {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False}
        for regex in splits
    ]
    return _tokenizer_json(
        vocab,
        normalizer={"type": "NFC"} if pre in NFC_PRES else None,
        pre_tokenizer={"type": "Sequence", "pretokenizers": [*split_steps,
                                                             {"type": "ByteLevel", **byte_level}]},
        post_processor=_post_processor(kv, vocab) or {"type": "ByteLevel", **byte_level},
        decoder={"type": "ByteLevel", **byte_level},
        model=_bpe_model(vocab, merges, ignore_merges=pre in WHOLE_WORD_PRES),
    )


def _sentencepiece_tokenizer(kv: Mapping[str, Any], vocab: _Vocab) -> dict:
    add_space_prefix = bool(kv.get(K.ADD_PREFIX, True))
    merges = _given_merges(kv)
    if merges is None:
        mergeable = [
            token_type == TokenType.NORMAL or i in vocab.respelled
            for i, token_type in enumerate(vocab.types)
        ]
        merges = recover_merges(vocab.keys, kv.get(K.SCORES), mergeable)
    model = _bpe_model(vocab, merges)
    unk = vocab.token(kv, K.UNK_ID)
    model.update(unk_token=unk[0] if unk else None, fuse_unk=True, byte_fallback=True)
    return _tokenizer_json(
        vocab,
        normalizer=spm_normalizer(add_space_prefix),
        pre_tokenizer=None,
        post_processor=_post_processor(kv, vocab),
        decoder=spm_decoder(add_space_prefix),
        model=model,
    )


def _gemma4_tokenizer(kv: Mapping[str, Any], vocab: _Vocab) -> dict:
    """Gemma 4's BPE (what llama.cpp does for it): spaces are "▁" and no space is prepended;
    the text is split only at newlines; each piece is merged by the file's merges over raw
    UTF-8, a piece the vocabulary holds whole staying whole (a run of newlines); what no token
    covers falls back to <0xHH> bytes."""
    merges = _given_merges(kv)
    if merges is None:
        raise UnsupportedTokenizer("Gemma 4 GGUF tokenizer without tokenizer.ggml.merges")
    model = _bpe_model(vocab, merges, ignore_merges=True)
    unk = vocab.token(kv, K.UNK_ID)
    model.update(unk_token=unk[0] if unk else None, fuse_unk=True, byte_fallback=True)
    split = {"type": "Split", "pattern": {"Regex": GEMMA4_SPLIT}, "behavior": "Isolated",
             "invert": False}
    return _tokenizer_json(
        vocab,
        normalizer=spm_normalizer(add_space_prefix=False),
        pre_tokenizer=split,
        post_processor=_post_processor(kv, vocab),
        decoder=spm_decoder(add_space_prefix=False),
        model=model,
    )


def _tokenizer_json(vocab: _Vocab, **components: dict | None) -> dict:
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": _added_tokens(vocab),
        **components,
    }


def _bpe_model(vocab: _Vocab, merges: Sequence[Sequence[str]], ignore_merges=False) -> dict:
    ids: dict[str, int] = {}
    for token_id, token in enumerate(vocab.keys):
        first = ids.setdefault(token, token_id)
        if first != token_id:
            log.warning("GGUF token %d repeats token %d (%r); keeping the first",
                        token_id, first, token)
    return bpe_model(ids, merges, ignore_merges)


def bpe_model(ids: Mapping[str, int], merges: Sequence[Sequence[str]],
              ignore_merges: bool = False) -> dict:
    """tokenizer.json's `model` for a BPE vocabulary (token -> id) and its merges."""
    return {
        "type": "BPE",
        "dropout": None,
        "unk_token": None,
        "continuing_subword_prefix": "",
        "end_of_word_suffix": "",
        "fuse_unk": False,
        "byte_fallback": False,
        "ignore_merges": ignore_merges,
        "vocab": dict(ids),
        "merges": [list(pair) for pair in merges],
    }


def _given_merges(kv: Mapping[str, Any]) -> list[list[str]] | None:
    if kv.get(K.MERGES) is None:
        return None
    pairs = [merge.split(" ", 1) for merge in kv[K.MERGES]]
    for merge in (m for m, pair in zip(kv[K.MERGES], pairs) if len(pair) != 2):
        raise UnsupportedTokenizer(f"malformed GGUF merge {merge!r}")
    return pairs


def recover_merges(
    tokens: Sequence[str], scores: Sequence[float] | None, mergeable: Sequence[bool]
) -> list[tuple[str, str]]:
    """SentencePiece BPE merges implied by a vocabulary: (a, b) for every mergeable token a + b
    whose parts are mergeable tokens, best score first (ties: lower id, then shorter left part).
    Without scores, position is rank (score = -id)."""
    ids: dict[str, int] = {}
    for token_id, token in enumerate(tokens):
        if mergeable[token_id]:
            ids.setdefault(token, token_id)
    ranked = []
    for token, token_id in ids.items():
        score = float(scores[token_id]) if scores is not None else -float(token_id)
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ids and right in ids:
                ranked.append((-score, token_id, cut, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def sentencepiece_merges(pieces: Sequence[str]) -> list[tuple[str, str]]:
    """The merges of pieces listed best first: `recover_merges` with score = -position."""
    return recover_merges(pieces, None, [True] * len(pieces))


def _added_tokens(vocab: _Vocab) -> list[dict]:
    maybe = {i for i, t in enumerate(vocab.types) if t != TokenType.NORMAL} | vocab.special_ids
    added = []
    for token_id in sorted(maybe):
        token_type = vocab.types[token_id]
        special = token_type in _SPECIAL_TYPES or token_id in vocab.special_ids
        user = token_type == TokenType.USER_DEFINED and token_id not in vocab.respelled
        if special or user:
            added.append(added_token(token_id, vocab.keys[token_id], special=special))
    return added


_SPECIAL_TYPES = (TokenType.CONTROL, TokenType.UNKNOWN)


def added_token(token_id: int, content: str, special: bool = True) -> dict:
    """An added token matched whole in the raw text, before normalization."""
    return {
        "id": token_id,
        "content": content,
        "single_word": False,
        "lstrip": False,
        "rstrip": False,
        "normalized": False,
        "special": special,
    }


def _post_processor(kv: Mapping[str, Any], vocab: _Vocab) -> dict | None:
    """BOS before / EOS after each sequence, when the file asks for them; else None."""
    bos = vocab.token(kv, K.BOS_ID) if _adds_bos(kv) else None
    eos = vocab.token(kv, K.EOS_ID) if kv.get(K.ADD_EOS) else None
    return template_post_processor(bos, eos) if bos or eos else None


def _adds_bos(kv: Mapping[str, Any]) -> bool:
    """The file's flag; if absent, llama.cpp's default: on for SentencePiece and Llama 3."""
    default = kv.get(K.MODEL) in ("llama", GEMMA4) or kv.get(K.PRE) in WHOLE_WORD_PRES
    return bool(kv.get(K.ADD_BOS, default)) and kv.get(K.BOS_ID) is not None


def template_post_processor(bos: tuple[str, int] | None, eos: tuple[str, int] | None) -> dict:
    """tokenizers' TemplateProcessing adding (token, id) `bos` before and `eos` after."""

    def sequence(name: str, type_id: int) -> list[dict]:
        text = [{"Sequence": {"id": name, "type_id": type_id}}]
        before = [{"SpecialToken": {"id": bos[0], "type_id": type_id}}] if bos else []
        after = [{"SpecialToken": {"id": eos[0], "type_id": type_id}}] if eos else []
        return before + text + after

    specials = {t: {"id": t, "ids": [i], "tokens": [t]} for t, i in filter(None, (bos, eos))}
    return {
        "type": "TemplateProcessing",
        "single": sequence("A", 0),
        "pair": sequence("A", 0) + sequence("B", 1),
        "special_tokens": specials,
    }


def spm_normalizer(add_space_prefix: bool) -> dict:
    """Spaces become "▁"; with `add_space_prefix`, each text run also gets one in front."""
    replace = {"type": "Replace", "pattern": {"String": " "}, "content": SPACE}
    if not add_space_prefix:
        return replace
    return {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": SPACE}, replace]}


def spm_decoder(add_space_prefix: bool) -> dict:
    """The decoders mlx_lm recognizes as SentencePiece's (its SPM streaming detokenizer)."""
    steps = [
        {"type": "Replace", "pattern": {"String": SPACE}, "content": " "},
        {"type": "ByteFallback"},
        {"type": "Fuse"},
    ]
    if add_space_prefix:
        steps.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
    return {"type": "Sequence", "decoders": steps}


def _tokenizer_config(kv: Mapping[str, Any], vocab: _Vocab) -> dict:
    config: dict[str, Any] = {}
    for name, key in SPECIAL_ID_KEYS.items():
        token = vocab.token(kv, key)
        config[name] = token[0] if token else None
    config.update(
        add_bos_token=_adds_bos(kv),
        add_eos_token=bool(kv.get(K.ADD_EOS, False)),
        clean_up_tokenization_spaces=False,
        tokenizer_class="PreTrainedTokenizerFast",  # tokenizer.json as written, no class rules
    )
    if kv.get(K.CHAT_TEMPLATE):
        config["chat_template"] = kv[K.CHAT_TEMPLATE]
    return config


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _dump(value: dict) -> bytes:
    # No indent: json's C encoder serves only compact output (10x faster on a 150k vocab).
    return (json.dumps(value, ensure_ascii=False) + "\n").encode("utf-8")


# --- Hugging Face -> GGUF (for writing test files) ----------------------------------------------


def gguf_tokenizer_fields(model_dir: Path, *, spm_merges: bool = False) -> dict[str, Any]:
    """`tokenizer.*` GGUF fields for the tokenizer in `model_dir`, as llama.cpp's converter writes
    them (padded with "[PADn]" tokens up to config.json's vocab_size). Merges are written for the
    "gpt2" kind, and for "llama" only when `spm_merges` (llama.cpp writes none there)."""
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text(encoding="utf-8"))
    config = _read_json(model_dir / "tokenizer_config.json")
    model_config = _read_json(model_dir / "config.json")
    model = tokenizer["model"]
    if model.get("type") != "BPE":
        raise UnsupportedTokenizer(f'unsupported tokenizer model "{model.get("type")}" for GGUF')
    kind = "llama" if model.get("byte_fallback") else "gpt2"
    gemma4 = model_config.get("model_type") == "gemma4_text"
    tokens, types = _gguf_vocab(tokenizer, kind, model_config.get("vocab_size"))
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", ())]
    fields: dict[str, Any] = {
        K.MODEL: GEMMA4 if gemma4 else kind,
        K.PRE: _pre_name(tokenizer) if kind == "gpt2" else (GEMMA4 if gemma4 else "default"),
        K.LIST: tokens,
        K.TOKEN_TYPE: types,
    }
    if kind == "llama":
        fields[K.SCORES] = _merge_rank_scores(tokens, types, merges)
        fields[K.ADD_PREFIX] = _adds_space_prefix(tokenizer)
    if kind == "gpt2" or spm_merges or gemma4:  # (llama.cpp's gemma4 files hold merges)
        fields[K.MERGES] = merges
    fields.update(_gguf_special_ids(tokens, config, model_config))
    fields.update(_gguf_add_flags(tokenizer, config))
    last = ((tokenizer.get("post_processor") or {}).get("single") or [{}])[-1]
    if "SpecialToken" in last and last["SpecialToken"]["id"] in tokens:
        # the token the template appends is the EOS it adds (gguf's SpecialVocab: an
        # embedding model's "<|endoftext|>" where its chat EOS is another)
        fields[K.EOS_ID] = tokens.index(last["SpecialToken"]["id"])
    if config.get("chat_template"):
        fields[K.CHAT_TEMPLATE] = config["chat_template"]
    return fields


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}


def _gguf_vocab(tokenizer: dict, kind: str, vocab_size: int | None) -> tuple[list[str], list[int]]:
    """Every id's token and type; user-defined SentencePiece tokens spelled with real spaces."""
    by_id = {i: (token, TokenType.NORMAL) for token, i in tokenizer["model"]["vocab"].items()}
    for added in tokenizer.get("added_tokens", ()):
        control = added["special"] or _looks_special(added["content"])
        by_id[added["id"]] = (added["content"],
                              TokenType.CONTROL if control else TokenType.USER_DEFINED)
    unk = tokenizer["model"].get("unk_token")
    tokens, types = [], []
    for i in range(max(max(by_id) + 1, vocab_size or 0)):
        token, token_type = by_id.get(i, (f"[PAD{i}]", TokenType.UNUSED))
        if kind == "llama" and token == unk:
            token_type = TokenType.UNKNOWN
        elif kind == "llama" and token_type == TokenType.NORMAL and _is_byte_token(token):
            token_type = TokenType.BYTE
        elif kind == "llama" and token_type == TokenType.USER_DEFINED:
            token = token.replace(SPACE, " ")
        tokens.append(token)
        types.append(int(token_type))
    return tokens, types


def _looks_special(token: str) -> bool:
    return (token.startswith("<|") and token.endswith("|>")) or token in ("<pad>", "<mask>")


def _is_byte_token(token: str) -> bool:
    return re.fullmatch(r"<0x[0-9A-F]{2}>", token) is not None


def _merge_rank_scores(tokens: list[str], types: list[int], merges: list[str]) -> list[float]:
    """Minus the rank of the first merge that makes a token; tokens no merge makes rank after
    all merges, by id; non-normal tokens score 0 (as SentencePiece's control and byte pieces)."""
    rank: dict[str, int] = {}
    for index, merge in enumerate(merges):
        rank.setdefault(merge.replace(" ", "", 1), index)
    return [
        -float(rank.get(token, len(merges) + i)) if types[i] == TokenType.NORMAL else 0.0
        for i, token in enumerate(tokens)
    ]


def _steps(component: dict | None) -> Iterator[dict]:
    """A normalizer's or pre-tokenizer's steps, Sequences flattened."""
    if not component:
        return
    inner = component.get("normalizers") or component.get("pretokenizers")
    if component["type"] == "Sequence":
        for step in inner or ():
            yield from _steps(step)
    else:
        yield component


def _adds_space_prefix(tokenizer: dict) -> bool:
    steps = [*_steps(tokenizer.get("normalizer")), *_steps(tokenizer.get("pre_tokenizer"))]
    return any(
        step["type"] == "Prepend"
        or (step["type"] == "Metaspace" and step.get("prepend_scheme", "always") != "never")
        for step in steps
    )


def _pre_name(tokenizer: dict) -> str:
    """The `tokenizer.ggml.pre` whose split regexes are this tokenizer.json's."""
    splits = []
    for step in _steps(tokenizer.get("pre_tokenizer")):
        if step["type"] == "Split":
            splits.append(step["pattern"].get("Regex") or re.escape(step["pattern"]["String"]))
        elif step["type"] == "ByteLevel" and step.get("use_regex", True):
            splits.append(GPT2_SPLIT)
    for name, known in PRE_TOKENIZER_SPLITS.items():
        if name and known == tuple(splits):
            return name
    raise UnsupportedTokenizer(f"no GGUF pre-tokenizer splits text like {splits!r}")


def _gguf_special_ids(tokens: list[str], config: dict, model_config: dict) -> dict[str, int]:
    """From tokenizer_config.json's token strings, else config.json's ids (the first of a list)."""
    ids = {token: i for i, token in enumerate(tokens)}
    fields = {}
    for name, key in SPECIAL_ID_KEYS.items():
        token = config.get(name)
        token = token.get("content") if isinstance(token, dict) else token
        token_id = ids.get(token) if token else model_config.get(f"{name}_id")
        if isinstance(token_id, list):
            token_id = token_id[0] if token_id else None
        if token_id is not None:
            fields[key] = int(token_id)
    return fields


def _gguf_add_flags(tokenizer: dict, config: dict) -> dict[str, bool]:
    """tokenizer_config.json's add_bos/eos_token, else what the post-processor's template adds."""
    template = (tokenizer.get("post_processor") or {}).get("single") or [{}]
    return {
        K.ADD_BOS: bool(config.get("add_bos_token", "SpecialToken" in template[0])),
        K.ADD_EOS: bool(config.get("add_eos_token", "SpecialToken" in template[-1])),
    }
