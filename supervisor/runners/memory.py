"""Memory figures for placement: what a model will need, what the system has, and which loaded
runners to evict so a new one fits.

The budget is `available (psutil) + live memory of our runners - margin`: psutil's figure
already excludes what our runners hold, so their live memory is added back, and each runner is
then charged `max(estimate, live)` so a runner still growing its KV cache keeps its room. A
loaded runner's estimate has its KV part replaced by the pool it reports (manager.Slot), which
is measured on the model rather than read from config.json.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

import psutil

WEIGHT_OVERHEAD = 1.2  # activations, temporaries and allocator slack on top of the weights
WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".npz", ".bin")
_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
GIB = float(1 << 30)


@dataclass(slots=True)
class MemoryEstimate:
    """What loading takes on this host. For a distributed runner the figures are this host's
    ranks' shares, and `kv_bytes` is still one rank's KV budget times the local ranks."""
    weights_bytes: int
    kv_bytes: int  # num_parallel full contexts
    min_kv_bytes: int = 0  # one full context: the least a runner can work with
    local_ranks: int = 1  # a distributed runner's ranks on this host (each gets kv/local)

    @property
    def total_bytes(self) -> int:
        return int(self.weights_bytes * WEIGHT_OVERHEAD) + self.kv_bytes

    @property
    def rank_kv_bytes(self) -> int:
        """The KV budget each local rank's pool is sized from."""
        return self.kv_bytes // max(self.local_ranks, 1)


def available_bytes() -> int:
    return int(psutil.virtual_memory().available)


def weights_bytes(model_dir: Path) -> int:
    """Bytes of weight files in a model directory (symlinks followed)."""
    total = 0
    for path in Path(model_dir).iterdir():
        if path.name.endswith(WEIGHT_SUFFIXES):
            try:
                total += path.stat().st_size
            except OSError:
                pass
    return total


def kv_bytes_per_token(config: dict) -> int:
    """K and V for one token across all layers, from a Hugging Face config.json."""
    cfg = config.get("text_config", config)
    layers = int(cfg.get("num_hidden_layers") or 0)
    heads = int(cfg.get("num_attention_heads") or 0)
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    hidden = int(cfg.get("hidden_size") or 0)
    head_dim = int(cfg.get("head_dim") or (hidden // heads if heads else 0))
    dtype = _DTYPE_BYTES.get(str(cfg.get("torch_dtype") or config.get("torch_dtype")), 2)
    return 2 * layers * kv_heads * head_dim * dtype


def embedding_bytes(config: dict, weights: int) -> int:
    """The token embedding (and an untied output head): what every rank of a sharded model
    holds whole (mlx-lm shards the layers, not these). At most the weights themselves (a
    quantized model's are smaller than vocab x hidden x dtype)."""
    cfg = config.get("text_config", config)
    vocab, hidden = int(cfg.get("vocab_size") or 0), int(cfg.get("hidden_size") or 0)
    dtype = _DTYPE_BYTES.get(str(cfg.get("torch_dtype") or config.get("torch_dtype")), 2)
    tied = cfg.get("tie_word_embeddings", config.get("tie_word_embeddings", True))
    return min(vocab * hidden * dtype * (1 if tied else 2), weights)


def estimate(model_dir: Path, context_length: int, num_parallel: int, *, ranks: int = 1,
             local_ranks: int = 1) -> MemoryEstimate:
    """What loading `model_dir` will take here: weights with overhead, and a KV cache big
    enough for `num_parallel` full contexts (the budget handed to the runner as
    kv_cache_bytes). Sharded over `ranks` ranks, `local_ranks` of them on this host, each
    rank holds the embedding whole and 1/ranks of the layers and of the KV cache."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    weights = weights_bytes(model_dir)
    per_context = kv_bytes_per_token(config) * context_length
    if ranks <= 1:
        return MemoryEstimate(weights, per_context * max(1, num_parallel), per_context)
    whole = embedding_bytes(config, weights)
    rank_weights = whole + (weights - whole) // ranks
    rank_context = per_context // ranks
    return MemoryEstimate(rank_weights * local_ranks,
                          rank_context * max(1, num_parallel) * local_ranks,
                          rank_context * local_ranks, local_ranks)


class Placed(Protocol):
    """What the eviction plan needs to know about a loaded runner."""
    estimate_bytes: int
    memory_bytes: int
    refs: int
    last_used: float


def reserve(p: Placed) -> int:
    return max(p.estimate_bytes, p.memory_bytes)


def usable_bytes(loaded: Sequence[Placed], available: int, margin: int) -> int:
    return available + sum(p.memory_bytes for p in loaded) - margin


def plan_eviction(need: int, loaded: Sequence[Placed], *, available: int, margin: int,
                  max_loaded: int, busy: Callable[[Any], bool] = lambda p: p.refs > 0
                  ) -> list | None:
    """The runners to evict (idle ones least recently used first, then busy ones) so that a
    model needing `need` bytes fits, or None if it cannot fit even with all of them gone."""
    usable = usable_bytes(loaded, available, margin)
    remaining = list(loaded)

    def fits() -> bool:
        count_ok = max_loaded <= 0 or len(remaining) + 1 <= max_loaded
        return count_ok and sum(reserve(p) for p in remaining) + need <= usable

    victims = []
    for p in sorted(loaded, key=lambda p: (busy(p), p.last_used)):
        if fits():
            break
        victims.append(p)
        remaining.remove(p)
    return victims if fits() else None


def insufficient_message(need: int, usable: int) -> str:
    return (f"model requires more system memory ({need / GIB:.1f} GiB) than is available "
            f"({max(usable, 0) / GIB:.1f} GiB)")
