"""Checks of a GGUF header's content, made before the converter reads it (`convert.
check_supported`, at create): what the converter divides by, sizes by, indexes or iterates is
the type and in the range it assumes, so a hostile file is an InvalidModelFile (a 400) rather
than an exception inside the conversion (a 500). header.py has already bounded the structure
(counts, lengths, offsets); these are about meaning.

Long metadata arrays left unread (`ArrayStub`, the store's quick read) are checked by length
only; the converter reads the whole header and checks again.
"""

from __future__ import annotations

import math
import re
from typing import Any

from mlxr.shared.errors import InvalidModelFile
from mlxr.shared.model_checks import DIMENSION_CAPS, check_dimension

from .arch import ROPE_TENSORS
from .header import ArrayStub, TensorInfo

# The `{arch}.KEY` metadata arch.hf_config reads, and what each must be. Other keys are left
# alone: real files carry many the converter never reads (strings and arrays among them).
# Integers that become config.json dimensions, checked as config.json's are:
_HPARAMS = {"block_count": "num_hidden_layers", "embedding_length": "hidden_size",
            "feed_forward_length": "intermediate_size",
            "attention.head_count": "num_attention_heads",
            "attention.head_count_kv": "num_key_value_heads",
            "attention.key_length": "head_dim", "attention.value_length": "head_dim",
            "attention.head_dim": "head_dim",
            "attention.key_length_swa": "head_dim", "attention.value_length_swa": "head_dim",
            "context_length": "max_position_embeddings", "vocab_size": "vocab_size",
            "expert_feed_forward_length": "moe_intermediate_size",
            "expert_count": "num_experts", "expert_used_count": "num_experts_per_tok"}
# Other integers, and their ranges (a sliding window of 0 is none):
_COUNTS = {"rope.dimension_count": (1, 1 << 14), "rope.dimension_count_swa": (1, 1 << 14),
           "attention.shared_kv_layers": (0, 1 << 12),
           "embedding_length_per_layer_input": (0, 1 << 18),
           "rope.scaling.original_context_length": (1, 1 << 26),
           "attention.sliding_window": (0, 1 << 26),
           "attention.sliding_window_pattern": (1, 1 << 12),
           "pooling_type": (0, 1 << 8)}
# Finite numbers; the first three also positive (divided by, or raised to a power):
_POSITIVE = ("rope.freq_base", "rope.freq_scale", "rope.scaling.factor")
_NUMBERS = (*_POSITIVE, "expert_weights_scale", "rope.global.freq_base", "rope.freq_base_swa",
            "rope.local.freq_base",
            "rope.scaling.yarn_beta_fast", "rope.scaling.yarn_beta_slow",
            "rope.scaling.beta_fast", "rope.scaling.beta_slow",
            "attention.layer_norm_rms_epsilon", "attention.layer_norm_epsilon",
            "attention.scale", "embedding_scale",
            "residual_scale", "logit_scale", "attn_logit_softcapping", "final_logit_softcapping")
_STRINGS = ("rope.scaling.type",)
# Those a file may give per layer (hf_config takes a list whose values all agree, but gemma4's,
# which vary by kind of layer; gemma4 and Ollama's gemma3 give the sliding window pattern as one
# bool a layer).
_PER_LAYER = ("feed_forward_length", "attention.head_count", "attention.head_count_kv",
              "attention.layer_norm_rms_epsilon", "attention.sliding_window_pattern")
MAX_TOKEN_CHARS = 4096  # a vocabulary entry (real ones are at most a few hundred)
_MATRICES = ("token_embd.weight", "output.weight")  # (vocab, hidden)
# In the mlx_lm name of a mixture's stacked experts (qwen3_moe's switch_mlp, gpt_oss's experts):
# their weights have 3 dimensions, their biases (gpt_oss) 2.
_EXPERTS = re.compile(r"\.(switch_mlp|experts)\.[\w.]*\.weight$")
_BLOCK_INDEX = re.compile(r"blk\.(\d+)\.")


def check_tensor(file_name: str, t: TensorInfo, hf_name: str | None,
                 layers: int | None) -> None:
    """A tensor has the dimensions its role needs (the embedding and output: a matrix; a
    mixture's experts: 3; any other weight or rope table: 1 or 2) and, in a block, a layer
    index under the layer count."""
    if layers and (m := _BLOCK_INDEX.match(t.name)) and int(m.group(1)) >= layers:
        raise InvalidModelFile(f'{file_name}: tensor "{t.name}" is past the file\'s {layers} '
                               "layers (block_count)")
    if t.name in _MATRICES and len(t.shape) != 2:
        raise InvalidModelFile(f'{file_name}: tensor "{t.name}" has shape {t.shape}: a matrix '
                               "expected")
    if hf_name and _EXPERTS.search(hf_name):
        if len(t.shape) != 3:
            raise InvalidModelFile(f'{file_name}: tensor "{t.name}" has shape {t.shape}: 3 '
                                   "dimensions (experts, rows, columns) expected")
    elif (hf_name or t.name in ROPE_TENSORS) and len(t.shape) not in (1, 2):
        raise InvalidModelFile(f'{file_name}: tensor "{t.name}" has shape {t.shape}: 1 or 2 '
                               "dimensions expected")


def check_hparams(file_name: str, kv: dict[str, Any], prefix: str) -> int | None:
    """The `{prefix}.*` metadata arch.hf_config reads have the types and ranges it assumes (one
    value, or one per layer where _PER_LAYER allows). Returns the layer count, if given."""
    for sub in (*_HPARAMS, *_COUNTS, *_NUMBERS, *_STRINGS):
        key = f"{prefix}.{sub}"
        value = kv.get(key)
        if value is None or isinstance(value, ArrayStub):
            continue  # (a long per-layer array: unread here, checked when the converter reads it)
        if sub in _STRINGS:
            if not isinstance(value, str):
                raise InvalidModelFile(f"{file_name}: {key} must be a string")
            continue
        if isinstance(value, list) and sub not in _PER_LAYER:
            raise InvalidModelFile(f"{file_name}: {key} must be one value, not a list")
        for v in value if isinstance(value, list) else [value]:
            if sub in _HPARAMS:
                check_dimension(v, key, DIMENSION_CAPS[_HPARAMS[sub]], file_name)
            elif sub in _COUNTS:
                if isinstance(v, bool) and sub == "attention.sliding_window_pattern":
                    continue  # one per layer: sliding or not
                low, high = _COUNTS[sub]
                if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high:
                    raise InvalidModelFile(f"{file_name}: {key} must be an integer from {low} "
                                           f"to {high:,}, not {str(v)[:40]}")
            elif isinstance(v, bool) or not isinstance(v, (int, float)) or \
                    not math.isfinite(v) or (sub in _POSITIVE and v <= 0):
                what = "a positive" if sub in _POSITIVE else "a finite"
                raise InvalidModelFile(f"{file_name}: {key} must be {what} number, not "
                                       f"{str(v)[:40]!r}")
    layers = kv.get(f"{prefix}.block_count")
    return layers if isinstance(layers, int) else None


def check_tokenizer_kv(file_name: str, kv: dict[str, Any]) -> None:
    """The tokenizer metadata has the types and lengths tokenizer.py reads it with: a
    vocabulary of strings, token types and scores one per token, merges as strings, integer
    special ids (long arrays left unread are checked by length only)."""
    def bad(key: str, what: str) -> InvalidModelFile:
        return InvalidModelFile(f"{file_name}: GGUF tokenizer metadata {key} {what}")

    for key in ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.chat_template"):
        if key in kv and not isinstance(kv[key], str):
            raise bad(key, "must be a string")
    tokens = kv.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise bad("tokenizer.ggml.tokens", "is missing: the file has no vocabulary")
    if not isinstance(tokens, (list, ArrayStub)) or not tokens:
        raise bad("tokenizer.ggml.tokens", "must be a non-empty list of strings")
    check_dimension(len(tokens) if isinstance(tokens, list) else int(tokens),
                    "tokenizer.ggml.tokens count", DIMENSION_CAPS["vocab_size"], file_name)
    if isinstance(tokens, list) and not all(isinstance(t, str) and len(t) <= MAX_TOKEN_CHARS
                                            for t in tokens):
        raise bad("tokenizer.ggml.tokens", f"must be strings of at most {MAX_TOKEN_CHARS} "
                  "characters")
    for key, kinds in (("tokenizer.ggml.token_type", (int,)),
                       ("tokenizer.ggml.scores", (int, float))):
        value = kv.get(key)
        if value is None:
            continue
        if not isinstance(value, (list, ArrayStub)) or len_of(value) != len_of(tokens):
            raise bad(key, f"must be a list of one value per token ({len_of(tokens)})")
        if isinstance(value, list) and not all(isinstance(v, kinds) for v in value):
            raise bad(key, "must hold numbers")
    merges = kv.get("tokenizer.ggml.merges")
    if merges is not None and not isinstance(merges, ArrayStub) and not (
            isinstance(merges, list) and all(isinstance(m, str) for m in merges)):
        raise bad("tokenizer.ggml.merges", "must be a list of strings")
    for key, value in kv.items():
        if key.startswith("tokenizer.ggml.") and key.endswith("_token_id") and \
                value is not None and not isinstance(value, int):
            raise bad(key, "must be an integer")


def len_of(value: list | ArrayStub) -> int:
    """The length of a metadata array, read or left unread."""
    return len(value) if isinstance(value, list) else int(value)
