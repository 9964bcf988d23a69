"""The model's tokenizer, as the runner uses it: encode a prompt, decode ids, the end-of-sequence
ids, its added tokens, and the Rust `tokenizers` object under it (text streaming and llguidance
read that).

The supervisor renders chat templates itself, so the runner needs none of what mlx-lm's
`TokenizerWrapper` adds (a streaming detokenizer, thinking and tool-call markers, template
hooks). mlx-lm loads transformers' `AutoTokenizer`, and importing transformers alone took 2.7 s
of a tiny model's 5.6 s load on the 2-core EPYC (Zen 3). So where transformers would use
tokenizer.json as it is written, the runner reads it with `tokenizers` itself and applies what
transformers adds from tokenizer_config.json (`_lean`):
- every named special token (`bos_token`, `eos_token`, ..., `additional_special_tokens`) an
  added special token;
- `clean_up_tokenization_spaces` on decode (transformers skips it for BPE models).
That is the case for `PreTrainedTokenizerFast` (every GGUF import, Llama 3, the store's random
models) and for `Qwen2Tokenizer` whose tokenizer.json is the pipeline transformers' class
builds (Qwen2, 2.5, 3), where `add_bos_token` and `add_eos_token` agree with tokenizer.json's
post-processor. Anything else (SentencePiece classes transformers rebuilds in code, tokens the
config adds that tokenizer.json lacks, flags that disagree, a slow-only tokenizer) loads through
transformers' `AutoTokenizer` as before (`_transformers`); both give the same ids
(tests/mlx/test_tokenizer.py).

End-of-sequence ids follow mlx-lm's `load`: config.json's `eos_token_id` (one or a list), else
the model module's `TOKENIZER_DEFAULTS`, plus the tokenizer's own `eos_token_id`."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# transformers' `model_max_length` when tokenizer_config.json names none.
UNBOUNDED = int(1e30)
SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                "mask_token")
LEAN_CLASSES = {"PreTrainedTokenizerFast", "TokenizersBackend"}
QWEN2_CLASSES = {"Qwen2Tokenizer", "Qwen2TokenizerFast"}
# The pre-tokenizer split Qwen2's tokenizer.json holds and transformers' Qwen2Tokenizer builds.
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
               r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
CLEANUPS = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
            (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))


@dataclass(eq=False)  # hashed by identity: llguidance's compilers are cached by it
class Tokenizer:
    backend: Any  # the Rust `tokenizers.Tokenizer`; None for a slow transformers tokenizer
    eos_token_ids: set[int]
    bos_token: str | None
    model_max_length: int
    added_tokens: dict[int, tuple[str, bool]]  # id -> (content, special)
    eos_token_id: int | None
    eos_token: str | None
    hf: Any = None  # transformers' tokenizer, where it loaded through transformers
    clean_up_spaces: bool = False

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self.hf is not None:
            return list(self.hf.encode(text, add_special_tokens=add_special_tokens))
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        if self.hf is not None:
            return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)
        text = self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        if self.clean_up_spaces:
            for before, after in CLEANUPS:
                text = text.replace(before, after)
        return text

    def special_ids(self) -> set[int]:
        return {i for i, (_, special) in self.added_tokens.items() if special}

    def added_id(self, content: str) -> int | None:
        for i, (text, _) in self.added_tokens.items():
            if text == content:
                return i
        return None

    def __len__(self) -> int:
        if self.hf is not None:
            return len(self.hf)
        return self.backend.get_vocab_size(with_added_tokens=True)


def load_tokenizer(model_dir: str | Path, config: dict, model: Any = None) -> Tokenizer:
    """The tokenizer in `model_dir`; `config` is its config.json, `model` the loaded model
    (its module may name default end-of-sequence ids)."""
    tokenizer = _lean(Path(model_dir)) or _transformers(Path(model_dir))
    eos = config.get("eos_token_id")
    if eos is None and model is not None:
        defaults = getattr(sys.modules.get(type(model).__module__), "TOKENIZER_DEFAULTS", None)
        eos = (defaults or {}).get("eos_token_ids")
    ids = {eos} if isinstance(eos, int) else set(eos or [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    tokenizer.eos_token_ids = ids
    return tokenizer


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _named_specials(settings: dict) -> list[str]:
    names = [_token_text(settings.get(key)) for key in SPECIAL_KEYS]
    extra = settings.get("additional_special_tokens") or settings.get("extra_special_tokens") or []
    if isinstance(extra, dict):  # v5 also writes {name: token}
        extra = list(extra.values())
    names += [_token_text(token) for token in extra]
    return [name for name in names if name]


def _state(component: Any) -> dict:
    """A `tokenizers` component as its tokenizer.json entry ({} for none)."""
    return {} if component is None else json.loads(component.__getstate__())


def _qwen2_pipeline(backend: Any, settings: dict) -> bool:
    """Whether tokenizer.json is the pipeline transformers' Qwen2Tokenizer builds in code."""
    pre = _state(backend.pre_tokenizer)
    parts = pre.get("pretokenizers") or []
    model = backend.model
    return (
        _state(backend.normalizer) == {"type": "NFC"}
        and pre.get("type") == "Sequence" and len(parts) == 2
        and parts[0].get("type") == "Split"
        and parts[0].get("pattern") == {"Regex": QWEN2_SPLIT}
        and parts[0].get("behavior") == "Isolated" and not parts[0].get("invert")
        and parts[1].get("type") == "ByteLevel" and not parts[1].get("use_regex")
        and bool(parts[1].get("add_prefix_space")) == bool(settings.get("add_prefix_space"))
        and _state(backend.decoder).get("type") == "ByteLevel"
        and type(model).__name__ == "BPE" and not model.byte_fallback
        and not model.continuing_subword_prefix and not model.end_of_word_suffix
        and model.dropout is None and not model.fuse_unk
    )


def _flags_agree(backend: Any, settings: dict, bos: str | None, eos: str | None) -> bool:
    """Whether tokenizer.json's post-processor adds BOS and EOS as tokenizer_config.json's
    `add_bos_token` and `add_eos_token` say, where it says. Where they disagree, what
    transformers does depends on the class and on whether tokenizer.json has a
    post-processor at all (measured with 5.24), so such a tokenizer loads through it."""
    ids = backend.encode("a", add_special_tokens=True).ids
    for key, token, at in (("add_bos_token", bos, 0), ("add_eos_token", eos, -1)):
        if key not in settings:
            continue
        token_id = None if token is None else backend.token_to_id(token)
        wanted = bool(settings[key]) and token_id is not None
        if wanted != (bool(ids) and ids[at] == token_id):
            return False
    return True


def _lean(model_dir: Path) -> Tokenizer | None:
    """The tokenizer through `tokenizers` alone, or None where transformers would build it
    differently from tokenizer.json (see the module's docstring)."""
    path, settings_path = model_dir / "tokenizer.json", model_dir / "tokenizer_config.json"
    if not path.is_file() or not settings_path.is_file():
        return None
    try:
        settings = json.loads(settings_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    kind = settings.get("tokenizer_class")
    if settings.get("auto_map") or settings.get("split_special_tokens") \
            or kind not in LEAN_CLASSES | QWEN2_CLASSES:
        return None
    from tokenizers import AddedToken, Tokenizer as Backend

    try:
        backend = Backend.from_file(str(path))
    except Exception:  # noqa: BLE001 (a file `tokenizers` cannot read: transformers says why)
        return None
    if kind in QWEN2_CLASSES and not _qwen2_pipeline(backend, settings):
        return None
    backend.no_truncation()
    backend.no_padding()
    added = backend.get_added_tokens_decoder()
    by_text = {token.content: token for token in added.values()}
    for key, entry in (settings.get("added_tokens_decoder") or {}).items():
        have = added.get(int(key))
        if have is None or have.content != entry.get("content") \
                or have.special != bool(entry.get("special")):
            return None  # transformers would add or change it: its ids are its own
    missing = []
    for name in _named_specials(settings):
        if name in by_text:
            if not by_text[name].special:
                return None
        elif backend.token_to_id(name) is None:
            return None  # transformers appends it to the vocabulary
        else:
            missing.append(AddedToken(name, special=True, normalized=False))
    if missing:
        backend.add_special_tokens(missing)
    bos, eos = _token_text(settings.get("bos_token")), _token_text(settings.get("eos_token"))
    if not _flags_agree(backend, settings, bos, eos):
        return None
    return Tokenizer(
        backend=backend, eos_token_ids=set(), bos_token=bos,
        model_max_length=int(settings.get("model_max_length") or UNBOUNDED),
        added_tokens={i: (t.content, t.special)
                      for i, t in backend.get_added_tokens_decoder().items()},
        eos_token_id=None if eos is None else backend.token_to_id(eos), eos_token=eos,
        clean_up_spaces=bool(settings.get("clean_up_tokenization_spaces"))
        and type(backend.model).__name__ != "BPE")


def _transformers(model_dir: Path) -> Tokenizer:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(model_dir))
    return Tokenizer(
        backend=getattr(hf, "backend_tokenizer", None), eos_token_ids=set(),
        bos_token=hf.bos_token, model_max_length=int(getattr(hf, "model_max_length", 0) or 0),
        added_tokens={i: (t.content, t.special) for i, t in hf.added_tokens_decoder.items()},
        eos_token_id=hf.eos_token_id, eos_token=hf.eos_token, hf=hf)
