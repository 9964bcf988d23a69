"""The split regexes of byte-level ("gpt2" kind) GGUF tokenizers, by `tokenizer.ggml.pre`
(the names llama.cpp's converter writes), in the form the models' own tokenizer.json files use.
Each pre-tokenizer applies its regexes in order, each piece split again by the next."""

from __future__ import annotations

GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_CASED_WORD = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+{suffix}"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*{suffix}"
)
TEKKEN_SPLIT = (
    _CASED_WORD.replace("{suffix}", "")
    + r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
GPT4O_SPLIT = (
    _CASED_WORD.replace("{suffix}", r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?")
    + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp's "default": punctuation runs first, then GPT-2's words, then digit groups.
DEFAULT_SPLITS = (r"[\p{P}\$\+<=>\^~\|]+", GPT2_SPLIT, r"\p{N}+", r"[0-9][0-9][0-9]")
DIGITS_THEN_GPT2 = (r"\p{N}", GPT2_SPLIT)


def _family(splits: tuple[str, ...], *names: str) -> dict[str, tuple[str, ...]]:
    return dict.fromkeys(names, splits)


# `tokenizer.ggml.pre` -> split regexes applied in order (each piece split again by the next).
PRE_TOKENIZER_SPLITS: dict[str, tuple[str, ...]] = {
    **_family(DEFAULT_SPLITS, "default", ""),
    **_family(
        (GPT2_SPLIT,),
        "gpt-2", "phi-2", "mpt", "olmo", "jais", "trillion", "granite-docling", "exaone4",
        "jina-es", "jina-de", "jina-v2-es", "jina-v2-de", "gigachat", "a.x-4.0", "mellum",
    ),
    **_family(
        DIGITS_THEN_GPT2,
        "refact", "starcoder", "smollm", "command-r", "codeshell", "exaone", "minerva-7b",
        "mellum2",
    ),
    **_family(
        (LLAMA3_SPLIT,),
        "llama-bpe", "llama3", "llama-v3", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
        "dbrx", "smaug-bpe", "glm4", "chatglm-bpe",
    ),
    **_family(
        (QWEN2_SPLIT,),
        "qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan",
        "solar-open", "grok-2",
    ),
    **_family((QWEN35_SPLIT,), "qwen35"),
    **_family((TEKKEN_SPLIT,), "tekken"),
    **_family((GPT4O_SPLIT,), "gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"),
}
# Whole pre-tokens found in the vocab are kept whole (llama.cpp's ignore_merges; Llama 3's
# tokenizer.json says the same), and BOS is added unless the file says otherwise.
WHOLE_WORD_PRES = {"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral",
                   "midm-2.0", "lfm2", "tekken"}
# The reference tokenizers of these NFC-normalize their input (Qwen's tokenizer.json does).
NFC_PRES = {"qwen2", "qwen35", "deepseek-r1-qwen"}
