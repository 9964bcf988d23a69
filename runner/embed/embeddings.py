"""Embeddings for the runner: tokenization with truncation, length-sorted padded sub-batches,
the forward pass on the engine thread, pooling, normalization and `dimensions`.

Invariants:
- `Embedder.forward` runs only on the engine thread (through `Engine.call`), one sub-batch
  per call, so the decode steps of a language model's other requests interleave with a large
  embedding request instead of waiting for all of it.
- Inputs are right-padded. Padded keys are masked out of attention (encoder) or come after
  every real token (causal language model), and padded positions are masked out of pooling,
  so a vector does not depend on the batch it was computed in (up to float rounding).
- mlx is imported inside the engine-thread functions only: the rest is testable without it.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

import numpy as np

from mlxr.shared.errors import ContextOverflow, InvalidModelFile, InvalidRequest
from mlxr.shared.protocol import EmbedRequest, EmbedResponse
from mlxr.runner.embed.pooling import l2_normalize, pool, truncate_dimensions
from mlxr.shared.sentence_transformers import PoolingConfig, read_pooling_config

log = logging.getLogger("mlxr.runner")

SUB_BATCH = 32
SUB_BATCH_TOKENS = 16384  # padded tokens per sub-batch: bounds activation memory
LM_CHUNK = 512  # a language model reads long inputs in chunks through a KV cache
OVERFLOW = "input length exceeds maximum context length"
# served by runner/embed's encoders, not mlx_lm (XLM-RoBERTa as BERT: encoder.load_bert)
ENCODER_TYPES = ("bert", "xlm-roberta", "nomic_bert")


class Embedder(Protocol):
    dim: int
    max_length: int
    vocab_size: int

    def encode(self, texts: list[str], truncate: bool) -> list[list[int]]:
        """Token ids per text (any thread); over `max_length` it cuts or raises ContextOverflow."""

    def forward(self, batch: list[list[int]]) -> np.ndarray:
        """(len(batch), dim) float32 vectors; engine thread only."""


def is_encoder_dir(model_dir: str | Path) -> bool:
    """An encoder (BERT or Nomic BERT, served by runner/embed) rather than a causal LM (mlx_lm)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    archs = config.get("architectures") or []
    return config.get("model_type") in ENCODER_TYPES or \
        any(str(a).startswith(("Bert", "XLMRoberta", "NomicBert")) for a in archs)


def plan_batches(lengths: list[int], max_batch: int = SUB_BATCH,
                 max_tokens: int = SUB_BATCH_TOKENS) -> list[list[int]]:
    """Input indices grouped into sub-batches, longest first. A sub-batch holds at most
    `max_batch` inputs and `max_tokens` padded tokens (a longer input goes alone), and no input
    shorter than half its longest, so padding never more than doubles an input's work."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for i in order:
        group = groups[-1] if groups else None
        longest = lengths[group[0]] if group else 0
        if (group and len(group) < max_batch and (len(group) + 1) * longest <= max_tokens
                and 2 * lengths[i] >= longest):
            group.append(i)
        else:
            groups.append([i])
    return groups


def pad_batch(batch: list[list[int]], pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Right-padded ids (B, L) and the 0/1 mask of real tokens."""
    length = max(len(ids) for ids in batch)
    ids = np.full((len(batch), length), pad_id, dtype=np.int32)
    mask = np.zeros((len(batch), length), dtype=np.int32)
    for row, tokens in enumerate(batch):
        ids[row, :len(tokens)] = tokens
        mask[row, :len(tokens)] = 1
    return ids, mask


async def embed(req: EmbedRequest, embedder: Embedder,
                call: Callable[[Callable[[], Any]], Any]) -> EmbedResponse:
    """Serve one request: validate, tokenize off the event loop, run each sub-batch through
    `call` (Engine.call: runs a function on the engine thread, returns a Future)."""
    start = time.perf_counter_ns()
    if req.dimensions is not None and req.dimensions > embedder.dim:
        raise InvalidRequest(f"dimensions ({req.dimensions}) exceeds the model's embedding "
                             f"size ({embedder.dim})")
    inputs: list[list[int] | None] = [None] * len(req.input)
    text_at = [i for i, item in enumerate(req.input) if isinstance(item, str)]
    if text_at:
        encoded = await asyncio.get_running_loop().run_in_executor(
            None, embedder.encode, [req.input[i] for i in text_at], req.truncate)
        for i, ids in zip(text_at, encoded):
            inputs[i] = ids
    for i, item in enumerate(req.input):
        if isinstance(item, list):
            inputs[i] = _checked_tokens(item, embedder, req.truncate)
    if any(not ids for ids in inputs):
        raise InvalidRequest("an input has no tokens")
    vectors = np.zeros((len(inputs), embedder.dim), dtype=np.float32)
    for group in plan_batches([len(ids) for ids in inputs]):
        batch = [inputs[i] for i in group]
        vectors[group] = await asyncio.wrap_future(call(functools.partial(embedder.forward, batch)))
    vectors = truncate_dimensions(vectors, req.dimensions)
    return EmbedResponse(embeddings=np.ascontiguousarray(vectors, dtype=np.float32),
                         prompt_eval_count=sum(len(ids) for ids in inputs),
                         total_duration=time.perf_counter_ns() - start)


def _checked_tokens(ids: list[int], embedder: Embedder, truncate: bool) -> list[int]:
    """Token arrays are used as given; truncation keeps the first `max_length` ids."""
    bad = next((t for t in ids if not 0 <= t < embedder.vocab_size), None)
    if bad is not None:
        raise InvalidRequest(f"token id {bad} is out of range (vocabulary size "
                             f"{embedder.vocab_size})")
    return _fit(ids, embedder.max_length, truncate)


def _fit(ids: list[int], max_length: int, truncate: bool) -> list[int]:
    if len(ids) <= max_length:
        return ids
    if not truncate:
        raise ContextOverflow(f"{OVERFLOW} ({len(ids)} > {max_length} tokens)")
    return ids[:max_length]


def finish(vectors: np.ndarray, pooling: PoolingConfig, dense: list) -> np.ndarray:
    """Pooled (B, width) float32 vectors through the Dense modules, then normalized where
    the sentence-transformers files say so."""
    from mlxr.runner.embed.dense import apply_dense

    vectors = apply_dense(dense, np.asarray(vectors, dtype=np.float32))
    return l2_normalize(vectors) if pooling.normalize else vectors


def out_width(dense: list, width: int) -> int:
    """The vector size: the last Dense module's outputs, else the pooled width."""
    return dense[-1].weight.shape[0] if dense else width


# -- the encoder (BERT) ---------------------------------------------------------------------
class EncoderTokenizer:
    """tokenizer.json through `tokenizers`, with the padding and truncation that some
    tokenizer.json files carry (all-MiniLM-L6-v2's: pad and cut to 128) switched off: we cut
    at the model's own maximum and pad per sub-batch. Also what /v1/tokenize uses."""

    def __init__(self, path: Path, max_length: int):
        from tokenizers import Tokenizer

        self.plain = Tokenizer.from_file(str(path))
        self.plain.no_padding()
        self.plain.no_truncation()
        # A second instance cuts the way sentence-transformers does (the text is cut, then
        # [CLS]/[SEP] are added), configured once here because settings are not per call.
        self.cutting = Tokenizer.from_file(str(path))
        self.cutting.no_padding()
        self.cutting.enable_truncation(max_length)
        self.max_length = max_length

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.plain.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.plain.decode(ids, skip_special_tokens=skip_special_tokens)

    def encode_for_embedding(self, texts: list[str], truncate: bool) -> list[list[int]]:
        out = []
        for enc in self.cutting.encode_batch(texts, add_special_tokens=True):
            if enc.overflowing and not truncate:
                raise ContextOverflow(f"{OVERFLOW} ({self.max_length} tokens)")
            out.append(enc.ids)
        return out


@dataclass(slots=True)
class EncoderEmbedder:
    model: Any  # runner/embed: encoder.BertEncoder or nomic.NomicEncoder; None with `host`
    tokenizer: EncoderTokenizer
    pooling: PoolingConfig
    max_length: int
    dim: int
    vocab_size: int
    host: Any = None  # runner/embed/host_encoder.py's HostEncoder: the forward pass in numpy
    dense: list = field(default_factory=list)  # runner/embed/dense.py's layers, after pooling

    def encode(self, texts: list[str], truncate: bool) -> list[list[int]]:
        return self.tokenizer.encode_for_embedding(texts, truncate)

    def forward(self, batch: list[list[int]]) -> np.ndarray:
        import mlx.core as mx

        ids, mask = pad_batch(batch)
        if self.host is not None:
            vectors = pool(self.host(ids, mask), mask, self.pooling.modes)
        else:
            mask_mx = mx.array(mask)
            hidden = self.model(mx.array(ids), mask_mx).astype(mx.float32)
            vectors = np.array(pool(hidden, mask_mx, self.pooling.modes))
        return finish(vectors, self.pooling, self.dense)


def load_encoder_embedder(model_dir: str | Path, context_length: int,
                          host: bool = False) -> EncoderEmbedder:
    """Load an encoder directory (BERT or Nomic BERT): weights, tokenizer.json and the
    sentence-transformers files. The maximum input is max_seq_length
    (sentence_bert_config.json), else the position table's size, else the tokenizer's
    model_max_length, whichever is least. `host`: run the forward pass in numpy (a CPU)."""
    from mlxr.runner.embed.dense import load_dense
    from mlxr.runner.embed.host_encoder import HostEncoder
    from mlxr.runner.embed.encoder import load_bert
    from mlxr.runner.embed.nomic import load_nomic

    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    nomic = config.get("model_type") == "nomic_bert" or \
        any(str(a).startswith("NomicBert") for a in config.get("architectures") or [])
    model = load_nomic(model_dir) if nomic else load_bert(model_dir)
    cfg = model.config
    pooling = read_pooling_config(model_dir)
    limits = [cfg.max_position_embeddings, context_length]
    if pooling.max_seq_length:
        limits.append(pooling.max_seq_length)
    else:
        tok_cfg = model_dir / "tokenizer_config.json"
        model_max = json.loads(tok_cfg.read_text()).get("model_max_length") \
            if tok_cfg.exists() else None
        if isinstance(model_max, int) and model_max > 0:
            limits.append(model_max)
    max_length = min(limits)
    tokenizer = EncoderTokenizer(model_dir / "tokenizer.json", max_length)
    host_encoder = HostEncoder.of(model) if host else None
    dense = load_dense(model_dir, pooling.dense, cfg.hidden_size * len(pooling.modes))
    # (with the numpy pass the MLX module goes: its weights live on in the views that pass
    # holds, BERT's separate q/k/v arrays are freed)
    return EncoderEmbedder(model=None if host_encoder else model, tokenizer=tokenizer,
                           pooling=pooling, max_length=max_length,
                           dim=out_width(dense, cfg.hidden_size * len(pooling.modes)),
                           vocab_size=cfg.vocab_size, host=host_encoder, dense=dense)


# -- causal language models (mlx_lm) ---------------------------------------------------------
@dataclass(slots=True)
class LMEmbedder:
    """The body's last hidden states (after the final norm) pooled over the input, L2
    normalized: their mean, or for an embedding model whose sentence-transformers files say
    so (Qwen3-Embedding), the last token's (or the first's), normalized if they say so.
    `body` is the model without its head (runner.model_step.split_model).
    `host`: a numpy prefill body (runner/host_prefill.py) that reads the inputs instead, for
    a model on the quantized kernel, whose MLX body runs MLX's quantized CPU products (a
    128-token input through the 147M 8-bit model: 7.2 s, against 0.24 s widened)."""

    model: Any
    body: Any
    tokenizer: Any  # runner/tokenizer.py's Tokenizer
    max_length: int
    dim: int
    vocab_size: int
    host: Any = None
    pooling: PoolingConfig = field(default_factory=PoolingConfig)
    dense: list = field(default_factory=list)  # runner/embed/dense.py's layers

    @classmethod
    def make(cls, model: Any, body: Any, tokenizer: Any, max_length: int,
             vocab_size: int, host: Any = None, pooling: PoolingConfig | None = None,
             model_dir: str | None = None) -> "LMEmbedder | None":
        """None when the body does not run as expected, or `pooling` (the directory's
        sentence-transformers files: an embedding model such as Qwen3-Embedding pools the
        last token) asks for what a language model cannot give: the model then serves
        completions only, rather than failing to load over a side feature."""
        import mlx.core as mx
        from mlx_lm.models.cache import make_prompt_cache

        pooling = pooling or PoolingConfig()
        if len(pooling.modes) != 1 or pooling.modes[0] not in LM_POOLING:
            log.error("no embeddings for this model: pooling %s (a language model pools by "
                      "%s)", pooling.modes, ", ".join(LM_POOLING))
            return None
        try:
            hidden = body(mx.array([[0]]), cache=make_prompt_cache(model))
        except Exception:
            log.exception("no embeddings for this model: its body does not run alone")
            return None
        width = hidden.shape[-1]  # the hidden size, whatever the config calls it
        dense = []
        if pooling.dense:
            from mlxr.runner.embed.dense import load_dense

            try:
                dense = load_dense(model_dir or ".", pooling.dense, width)
            except InvalidModelFile as exc:
                log.error("no embeddings for this model: %s", exc)
                return None
        return cls(model, body, tokenizer, max_length, out_width(dense, width), vocab_size,
                   host, pooling, dense)

    @property
    def mode(self) -> str:
        return self.pooling.modes[0]

    def encode(self, texts: list[str], truncate: bool) -> list[list[int]]:
        # The tokenizer's own special tokens (a BOS where the model has one), as a prompt gets.
        return [_fit(self.tokenizer.encode(text), self.max_length, truncate) for text in texts]

    def forward(self, batch: list[list[int]]) -> np.ndarray:
        import mlx.core as mx
        from mlx_lm.models.cache import make_prompt_cache

        weights = position_weights(batch, self.mode)
        if self.host is not None:
            pooled = np.stack([w[:len(tokens)] @ self.host.hidden_states(tokens, LM_CHUNK)
                               for tokens, w in zip(batch, weights)])
            return finish(pooled, self.pooling, self.dense)

        ids, _ = pad_batch(batch)
        ids_mx, weights_mx = mx.array(ids), mx.array(weights)
        cache = make_prompt_cache(self.model)
        total = mx.zeros((len(batch), self.dim), dtype=mx.float32)
        for start in range(0, ids.shape[1], LM_CHUNK):
            hidden = self.body(ids_mx[:, start:start + LM_CHUNK], cache=cache)
            part = weights_mx[:, start:start + LM_CHUNK, None]
            total = total + (hidden.astype(mx.float32) * part).sum(axis=1)
            mx.eval(total)  # lets this chunk's activations go before the next one
        return finish(np.array(total), self.pooling, self.dense)


LM_POOLING = ("mean", "lasttoken", "cls")  # cls: a causal model's first token


def position_weights(batch: list[list[int]], mode: str) -> np.ndarray:
    """(B, L) float32 weights whose sum over a row's hidden states pools it: 1/n over its real
    tokens (mean), 1 on its last real token or on its first; 0 on padding."""
    weights = np.zeros((len(batch), max(len(ids) for ids in batch)), dtype=np.float32)
    for row, ids in enumerate(batch):
        if mode == "mean":
            weights[row, :len(ids)] = 1.0 / len(ids)
        else:
            weights[row, len(ids) - 1 if mode == "lasttoken" else 0] = 1.0
    return weights
