"""Loading what a runner serves, on the engine thread: a language model (mlx_lm) with its model
step, prefix cache and scheduler, or an encoder that only embeds.

mlx and mlx_lm are imported inside the functions, so importing this module (the server does,
for the types) loads no MLX on the event loop thread.

A model directory with an `.adapter/adapter_config.json` (the store links a model's LoRA adapter
there, in mlx-lm's format) is loaded with mlx_lm's own `adapter_path`, so the adapter is applied
exactly as mlx-lm applies it; a model is never served without its adapter.

Before MLX reads a file, shared/model_checks.py checks config.json and every safetensors header
(the adapter's too): a hostile or damaged file fails the load with a message naming it, never
a crash inside MLX.
"""

from __future__ import annotations

import contextlib
import gc
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import psutil

from mlxr.shared.config import RunnerConfig, rows_layout
from mlxr.shared.errors import UnsupportedModel
from mlxr.shared.model_checks import check_model_dir
from mlxr.runner.kv.pool import BLOCK_SIZE, KVPool
from mlxr.runner.request import Sequence
from mlxr.runner.scheduler import Scheduler, SchedulerConfig
from mlxr.runner.text_stream import fast_decode

if TYPE_CHECKING:
    from mlxr.runner.model_step import ModelStep

log = logging.getLogger("mlxr.runner")
ADAPTER_DIR = ".adapter"  # the store's ADAPTER_DIR (the runner imports nothing of the supervisor)
GPU_CHUNK = 256  # a GPU's least prefill chunk and its alignment (`scheduler_config`)


@dataclass(slots=True)
class LoadedModel:
    model: Any
    tokenizer: Any  # runner/tokenizer.py's Tokenizer, or the encoder's tokenizer
    max_context: int
    bytes_per_token: int
    vocab_size: int
    capabilities: list[str] = field(default_factory=lambda: ["completion"])
    embedder: Any = None  # runner.embed.embeddings.Embedder, or None: no embeddings
    # A language model's machinery; None for an encoder, which the engine serves through
    # Engine.call only.
    model_step: ModelStep | None = None
    vision: Any = None  # runner.vision.model.VisionModel: the model takes images
    sharding: str = ""  # over a distributed group: "tensor" or "pipeline"
    weights: str = ""  # what the weights are held as (runner/weights.py's float32_on_cpu)
    kv_scale: float = 1.0  # the KV budget's factor: 2 where 16-bit weights were widened


def freeze_heap() -> None:
    """Put everything loading made (the tokenizer's tables, the model's modules) out of the
    garbage collector's reach. Python's full collections scan every tracked object; in a
    runner serving the 30M Qwen3 one took 72 ms, a pause every stream saw as one long
    inter-token gap. Requests' own objects are still collected."""
    gc.collect()
    gc.freeze()


def load_model(config: RunnerConfig, blas: str, on_progress: Callable[[float], None],
               group: Any = None) -> LoadedModel:
    """Load `config.model_dir`; `blas` describes the BLAS in use (for the log). With a
    distributed `group`, this rank's shard of it (every rank runs this same code: the forward
    passes made while loading are collectives too)."""
    # A file changed since create (or never checked: pulled) fails here, before MLX reads it.
    check_model_dir(Path(config.model_dir))
    import mlx.core as mx
    from mlx_lm.utils import load_adapters
    from mlx_lm.utils import load_model as read_model

    from mlxr.runner.architectures import fix_model
    from mlxr.runner.embed.bidirectional import is_bidirectional_dir, load_bidirectional_embedder
    from mlxr.runner.embed.embeddings import is_encoder_dir, load_encoder_embedder
    from mlxr.runner.probe_reference import kernel_reference
    from mlxr.runner.probe_verdicts import Verdicts, key as verdict_key, using as using_verdicts
    from mlxr.runner.tokenizer import load_tokenizer
    from mlxr.runner.vision.model import load_vision
    from mlxr.runner.weights import EXPERTS_WIDE, ON_KERNEL, float32_on_cpu
    from mlxr.shared.vision import vision_family

    if is_encoder_dir(config.model_dir):
        emb = load_encoder_embedder(config.model_dir, config.context_length,
                                    host=config.host_attention and mx.default_device() == mx.cpu)
        return LoadedModel(emb.model, emb.tokenizer, emb.max_length, 1, emb.vocab_size,
                           ["embedding"], emb)
    if is_bidirectional_dir(config.model_dir):  # EmbeddingGemma
        on_cpu = mx.default_device() == mx.cpu
        emb = load_bidirectional_embedder(config.model_dir, config.context_length,
                                          widen=on_cpu, host=on_cpu and config.host_attention)
        return LoadedModel(emb.model, emb.tokenizer, emb.max_length, 1, emb.vocab_size,
                           ["embedding"], emb)
    adapter = Path(config.model_dir) / ADAPTER_DIR
    adapter_path = str(adapter) if (adapter / "adapter_config.json").is_file() else None
    model, model_config = read_model(Path(config.model_dir), lazy=group is not None)
    if adapter_path:
        model = load_adapters(model, adapter_path)
        model.eval()
        log.info("applied the LoRA adapter in %s", adapter_path)
    tokenizer = load_tokenizer(config.model_dir, model_config, model)
    vision = None
    how = ""
    if group is not None:
        from mlxr.runner.distributed.lockstep import shard

        if vision_family(model_config):
            raise UnsupportedModel("a vision model cannot be sharded over several ranks")
        how = shard(model, group, config.sharding)
        mx.eval(model.parameters())  # only this rank's slices are read
        log.info("distributed: %s parallel over %d ranks", how, group.size())
    elif vision_family(model_config):
        # mlx-lm serves the language part; the image tower comes from mlx-vlm beside it.
        model = getattr(model, "language_model", model)
    # Widened weights make float32 keys and values: the same number of tokens then needs
    # kv_scale times the bytes the supervisor budgeted from config.json's dtype.
    kv_scale = 4 / _kv_figures(model)[1]
    weights = float32_on_cpu(model, config.float32_weights,
                             int(config.kv_cache_bytes * kv_scale),
                             int(psutil.virtual_memory().available),
                             agree=None if group is None else _all_ranks(group),
                             host_kernel=config.host_attention and group is None
                             and not vision_family(model_config))
    widened = weights.startswith("float32 from")
    # (float32 experts make the layers after them float32: their keys and values too)
    kv_scale = kv_scale if widened or weights.endswith((ON_KERNEL, EXPERTS_WIDE)) else 1.0
    if vision_family(model_config):
        vision = load_vision(config.model_dir, model, config.host_attention)
        if widened:
            vision.widen()
    fix_model(model, model_config)
    verdicts = None
    if config.probe_cache_dir and group is None:
        context = {"weights": weights, "kv_layout": config.kv_layout,
                   "host_attention": config.host_attention,
                   "attention_buckets": config.attention_buckets, "vision": vision is not None}
        verdicts = Verdicts.open(config.probe_cache_dir, verdict_key(config.model_dir, context))
    # The probes below run the model's own forward passes: on a CPU, quantized layers on the
    # quantized kernel (MLX's own CPU product re-reads the weight for every row).
    with contextlib.nullcontext() if group is not None else kernel_reference(), \
            using_verdicts(verdicts):
        loaded = _with_step(config, model, model_config, tokenizer, vision, weights, kv_scale,
                            how, group, blas, on_progress)
    if verdicts is not None:
        verdicts.save()
        if verdicts.read:
            log.info("probes: %d verdicts kept from an earlier load of these files (%s)",
                     verdicts.read, verdicts.path)
    return loaded


def _lm_pooling(model_dir: str):
    """How a language model's embeddings pool: its directory's sentence-transformers files
    (an embedding model's, e.g. Qwen3-Embedding's last token), else the mean. Modules we do
    not implement leave the model without embeddings (LMEmbedder.make refuses no modes)."""
    from mlxr.shared.sentence_transformers import PoolingConfig, read_pooling_config

    try:
        return read_pooling_config(model_dir)
    except ValueError as exc:
        log.error("%s", exc)
        return PoolingConfig(modes=[])


def _with_step(config: RunnerConfig, model, model_config: dict, tokenizer, vision,
               weights: str, kv_scale: float, how: str, group: Any, blas: str,
               on_progress: Callable[[float], None]) -> LoadedModel:
    """The rest of `load_model`: the host paths' probes, the model step and the embedder."""
    import mlx.core as mx

    from mlxr.runner import kernel_layers, mxfp4_kernel
    from mlxr.runner.embed.embeddings import LMEmbedder
    from mlxr.runner.host_body import HostBody
    from mlxr.runner.model_step import ModelStep
    from mlxr.runner.weights import ON_KERNEL, float32_on_cpu

    body = HostBody.find(model) if weights.endswith(ON_KERNEL) else None
    if weights.endswith(ON_KERNEL) and body is None and not mxfp4_kernel.serves(model) \
            and not kernel_layers.install(model):
        # The numpy body does not serve this architecture (nor does the mxfp4 kernel serve
        # gpt-oss's experts), and its quantized layers could not go on the kernel one by one,
        # so MLX's quantized CPU products would: 5-44x float32's time. Widen after all, where
        # it fits.
        weights = float32_on_cpu(model, config.float32_weights,
                                 int(config.kv_cache_bytes * kv_scale),
                                 int(psutil.virtual_memory().available))
    on_progress(0.9)
    max_context = int(model_config.get("max_position_embeddings")
                      or tokenizer.model_max_length or 1 << 20)
    token_text = fast_decode(tokenizer, skip_special=False)
    step = ModelStep(model, config.prefix_cache_bytes, lambda token: token_text([token]),
                     rows=rows_layout(config.kv_layout, mx.default_device() == mx.cpu),
                     vision=vision,
                     host_attention=config.host_attention, distributed=group is not None,
                     attention_buckets=config.attention_buckets, host_body=body)
    log.info("blas: %s", blas)
    log.info("kv cache: %s", "rows over the block pool" if step.uses_rows
             else "padded batch (MLXR_KV_LAYOUT, the device, or an architecture the rows "
                  "do not fit)")
    log.info("decode head: %s", "BLAS matrix-vector products for 1-2 rows"
             if step.host_head is not None else "MLX")
    log.info("decode body: %s", "numpy for 1-2 rows" if step.host_body is not None else "MLX")
    bytes_per_token = _kv_figures(model)[0]
    vocab_size = int(model_config.get("vocab_size") or len(tokenizer))
    if group is not None and step.split.body is None:
        raise UnsupportedModel("a sharded model must split into body and head")
    # (a sharded model has no embeddings: only the step's forward passes reach every rank)
    embedder = None if step.split.body is None or group is not None else LMEmbedder.make(
        model, step.split.body, tokenizer, min(config.context_length, max_context), vocab_size,
        host=step.host_prefill if step.host_body is not None and step.host_body.quantized
        else None, pooling=_lm_pooling(config.model_dir), model_dir=config.model_dir)
    capabilities = ["completion"] + (["vision"] if vision is not None else [])
    return LoadedModel(model, tokenizer, max_context, bytes_per_token, vocab_size,
                       capabilities, embedder=embedder, model_step=step, vision=vision,
                       sharding=how, weights=weights, kv_scale=kv_scale)


def scheduler_config(config: RunnerConfig, on_gpu: bool) -> SchedulerConfig:
    """The scheduler's settings. On a GPU a chunk's cost is mostly fixed (its kernel
    launches and, for a new shape, a cuDNN graph of about 49 ms on an H200), so the
    throttle's floor of 16 tokens read a 2,000-token prompt beside 8 streams in 125 steps of
    70 ms: 8.9 s. There it reads at least GPU_CHUNK tokens a step, in chunks aligned to
    GPU_CHUNK positions (mlx-lm's KV buffer step), whose shapes repeat from prompt to prompt
    (docs/PERFORMANCE.md, "On a GPU", session 22)."""
    gpu = {"min_prefill_chunk": GPU_CHUNK, "chunk_align": GPU_CHUNK} if on_gpu else {}
    return SchedulerConfig(max_running=config.num_parallel,
                           prefill_chunk=max(config.prefill_chunk, GPU_CHUNK) if on_gpu
                           else config.prefill_chunk,
                           step_token_budget=config.step_token_budget, **gpu)


def make_scheduler(config: RunnerConfig, loaded: LoadedModel,
                   stop_matched: Callable[[Sequence], bool], leader: Any = None) -> Scheduler:
    """The scheduler for `loaded`, its block pool sized from the config's KV budget or half
    the free memory. With a distributed `leader` (rank 0), the scheduler's pool calls and
    cache admissions are recorded for the other ranks, which make a pool of the same size."""
    import mlx.core as mx

    if loaded.model_step is None:
        # Never fed: the server refuses completions for an embedding-only model.
        return Scheduler(SchedulerConfig(), KVPool(1), admit=lambda seq, adm: 0,
                         eos_token_ids=set())
    budget_bytes = (int(config.kv_cache_bytes * loaded.kv_scale)
                    or int(psutil.virtual_memory().available * 0.5))
    num_blocks = max(budget_bytes // (max(loaded.bytes_per_token, 1) * BLOCK_SIZE), 1)
    pool = loaded.model_step.make_pool(num_blocks, BLOCK_SIZE)
    admit = loaded.model_step.admit
    if leader is not None:
        pool, admit = leader.setup(pool), leader.admit
    return Scheduler(
        scheduler_config(config, on_gpu=mx.default_device() != mx.cpu),
        pool, admit=admit,
        eos_token_ids=set(loaded.tokenizer.eos_token_ids), stop_matched=stop_matched)


def _all_ranks(group) -> Callable[[bool], bool]:
    """True on every rank when every rank says True (a collective: each rank loads through
    the same code, so each one calls it once, at the same point)."""
    import mlx.core as mx

    def agree(ok: bool) -> bool:
        total = mx.distributed.all_sum(mx.array(int(ok)), group=group)
        return int(total.item()) == group.size()

    return agree


def _kv_figures(model) -> tuple[int, int]:
    """Bytes of keys and values one token takes over every layer, and their item size."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    caches = make_prompt_cache(model)
    model(mx.array([[1]]), cache=caches)
    total, itemsize = 0, 4
    for c in caches:
        state = c.state
        if isinstance(state, tuple) and len(state) >= 2 and hasattr(state[0], "shape"):
            keys, values = state[0], state[1]
            total += (keys.nbytes + values.nbytes) // max(keys.shape[2], 1)
            itemsize = keys.itemsize
    return max(total, 1), itemsize
