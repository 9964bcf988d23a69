"""Ollama's option type checks (api.Options.FromMap), applied to the merged Modelfile parameters
and request options before `Options.from_dict` reads the ones the runner uses.

Invariants:
- Every option Ollama knows is type-checked, including those mlxr accepts and ignores
  (`IGNORED`); a wrong type is a 400 in Ollama's words (Ollama answers 500 there).
- An integer option given as a float is truncated toward zero, as Go's int64(f) does
  (`num_predict: 2.9` is 2); a bool is never a number.
- Unknown names pass through untouched (Ollama warns and ignores them; mlxr's own extension,
  `logit_bias`, is checked by `Options.from_dict`).
"""

from __future__ import annotations

import math
from typing import Any

from mlxr.shared.errors import InvalidRequest

INTEGER = ("num_keep", "seed", "num_predict", "top_k", "repeat_last_n", "num_ctx", "num_batch",
           "num_gpu", "main_gpu", "num_thread", "draft_num_predict")
FLOAT = ("top_p", "min_p", "typical_p", "temperature", "repeat_penalty", "presence_penalty",
         "frequency_penalty")
BOOLEAN = ("use_mmap",)
# Accepted and type-checked, with no effect here: hardware placement is MLX's, and
# `typical_p` (locally typical sampling) is not one of mlxr's samplers.
IGNORED = ("typical_p", "num_batch", "num_gpu", "main_gpu", "num_thread",
           "use_mmap", "draft_num_predict")

# Go's int64, what Ollama's integer options are: a larger value is a 400 here rather than a
# number the runner protocol (orjson) cannot write.
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1


def check_options(options: dict[str, Any]) -> dict[str, Any]:
    """A copy of `options` with Ollama's types enforced and integer options truncated."""
    out = dict(options)
    for key, value in options.items():
        if value is None:
            continue
        if key in INTEGER:
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or (isinstance(value, float) and not math.isfinite(value)):
                raise InvalidRequest(f'option "{key}" must be of type integer')
            out[key] = int(value)
            if not INT64_MIN <= out[key] <= INT64_MAX:
                raise InvalidRequest(f'option "{key}" is out of range for a 64-bit integer')
        elif key in FLOAT:
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or (isinstance(value, float) and not math.isfinite(value)):
                raise InvalidRequest(f'option "{key}" must be of type float32')
        elif key in BOOLEAN and not isinstance(value, bool):
            raise InvalidRequest(f'option "{key}" must be of type boolean')
        elif key == "stop" and not isinstance(value, (list, str)):
            raise InvalidRequest('option "stop" must be of type array')
    return out
