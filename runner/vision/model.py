"""A vision model's image side, beside the mlx-lm text model the engine batches.

The text model (mlx-lm's class for the checkpoint's language part) runs in the continuous
batch like any other; this module gives an image prompt what the text model cannot make itself:
- `prepare` (any thread, no MLX evaluation): runs the checkpoint's processor (mlx-vlm's
  `prepare_inputs`, so tokens and pixels match mlx-vlm's own generation) on the prompt and
  the decoded images: the prompt's ids with each image placeholder expanded to the image's
  tokens, the pixel arrays, and `cache_tokens` for the KV pool (below).
- `encode_stages` (engine thread): the image tower, a stage at a time (on the CPU a piece of
  one block of the image tower, on a GPU a whole block), so the engine runs
  decode steps between stages and an image's encoding stalls running streams no longer than
  a stage (runner/engine.py runs it before the sequence reaches the scheduler). A prompt
  whose images are all in the reused KV prefix never runs it.
- `prefill_inputs` (engine thread): for one prefill chunk, the input embeddings (the vision
  tower's features at image positions, mlx-vlm's `get_input_embeddings`) and, for
  multimodal-RoPE families, the chunk's three position streams (runner/vision/mrope.py).
- `decode_rope`: the per-row RoPE deltas for a decode step.

Prefix sharing: the pool keys blocks by token ids, and every position of every image holds the
same placeholder id. `cache_tokens` replaces an image's positions with a negative key made from
the image's SHA-256, so two images never share KV, and a repeated image (a multi-turn chat that
resends it) does.

The mlx-vlm model is loaded lazily; its token embedding is pointed at the text model's, so the
language weights are read once (by mlx-lm) and only the vision tower's are read here.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from mlxr.runner.vision import mrope
from mlxr.shared.errors import InvalidRequest
from mlxr.shared.images import DecodedImage
from mlxr.shared.vision import FAMILIES, vision_family

log = logging.getLogger("mlxr.runner")


def image_key(digest: str) -> int:
    """The pool key of an image's positions: negative, so never a real token id."""
    return -1 - int(digest[:15], 16)


@dataclass(slots=True)
class VisionPrompt:
    tokens: list[int]
    cache_tokens: list[int]
    arrays: dict[str, np.ndarray]  # the processor's pixel_values, attention_mask, ...
    image_positions: list[int]  # indices of image tokens in `tokens`
    # Set on the engine thread, by `encode_stages` (or at the first prefill chunk).
    embeds: Any = None  # mx.array (1, T, D)
    positions: Any = None  # mx.array (3, 1, T), multimodal RoPE only
    delta: int = 0
    encoded: bool = field(default=False)

    def image_from(self, start: int) -> bool:
        return bool(self.image_positions) and self.image_positions[-1] >= start


class VisionModel:
    def __init__(self, model_dir: str, text_model, config: dict, host_attention: bool = True):
        from mlx_vlm.utils import load_model, load_processor

        self.host_attention = host_attention  # Settings.host_attention: the tower may use it
        self.family = vision_family(config)
        if self.family is None:
            raise ValueError(f"{model_dir} is not a vision model the runner serves")
        token_key, self.placeholder = FAMILIES[self.family]
        self.image_token_id = int(config[token_key])
        self.vlm = load_model(Path(model_dir), lazy=True)
        self.vlm.language_model.model.embed_tokens = text_model.model.embed_tokens
        self.processor = load_processor(Path(model_dir))
        self.rope = mrope.install(text_model, config)
        log.info("vision: %s image tower (mlx-vlm), %s", self.family,
                 "multimodal RoPE" if self.rope else "plain RoPE")

    def widen(self) -> None:
        """Widen the image tower and projector to float32, as the text model was
        (runner/weights.py): their matmuls are the image prefill's, and the text model now
        takes float32 embeddings."""
        from mlxr.runner.weights import widen

        for name, child in self.vlm.children().items():
            if name != "language_model" and hasattr(child, "named_modules"):
                widen(child)

    # -- any thread ------------------------------------------------------------------------
    def prepare(self, prompt: str, images: list[DecodedImage]) -> VisionPrompt:
        from mlx_vlm.utils import prepare_inputs

        found = prompt.count(self.placeholder)
        if found != len(images):
            raise InvalidRequest(f"the prompt has {found} image placeholders for "
                                 f"{len(images)} images")
        out = prepare_inputs(self.processor, images=[im.image for im in images],
                             prompts=[prompt], return_tensors="np")
        arrays = {k: np.asarray(v) for k, v in out.items()
                  if k != "input_ids" and v is not None}
        tokens = [int(t) for t in np.asarray(out["input_ids"])[0]]
        positions = [i for i, t in enumerate(tokens) if t == self.image_token_id]
        cache_tokens = list(tokens)
        # Runs of image tokens in order are the images in order.
        run, prev = -1, -2
        for i in positions:
            run += i != prev + 1
            prev = i
            cache_tokens[i] = image_key(images[min(run, len(images) - 1)].digest)
        return VisionPrompt(tokens, cache_tokens, arrays, positions)

    # -- engine thread ---------------------------------------------------------------------
    def encode_stages(self, vp: VisionPrompt) -> Iterator[None]:
        """Encode `vp`'s images a stage at a time (each `next` is one stage's MLX work), so
        the engine runs decode steps between stages: a stage is a piece of one block of the
        image tower on the CPU, a whole block on a GPU (`_qwen_tower_stages`,
        `_siglip_tower_stages`). The last stage merges the features into the prompt's input
        embeddings."""
        import mlx.core as mx

        on_gpu = mx.default_device() != mx.cpu
        if self.family == "gemma3":
            staged = _siglip_tower_stages(self.vlm, vp, self.host_attention, whole_layers=on_gpu)
        else:  # qwen2_5_vl, qwen2_vl
            staged = _qwen_tower_stages(self.vlm.vision_tower, vp, self.host_attention,
                                        whole_blocks=on_gpu)
        features = None
        for features in staged:
            if features is None:
                yield
        if features is not None:  # the merger: a stage of its own, apart from the merge
            mx.eval(features)
            yield
        ids = mx.array([vp.tokens], dtype=mx.int32)
        extra = {"mask" if k == "attention_mask" else k: mx.array(v)
                 for k, v in vp.arrays.items() if k != "pixel_values"}
        if features is not None:
            extra["cached_image_features"] = features
        out = self.vlm.get_input_embeddings(ids, mx.array(vp.arrays["pixel_values"]), **extra)
        vp.embeds = out.inputs_embeds
        if self.rope is not None:
            vp.positions = out.position_ids
            vp.delta = int(out.rope_deltas.reshape(-1)[0].item())
        mx.eval([a for a in (vp.embeds, vp.positions) if a is not None])
        vp.encoded = True

    def _encode(self, vp: VisionPrompt) -> None:
        for _ in self.encode_stages(vp):
            pass

    def _positions(self, vp: VisionPrompt) -> None:
        """Multimodal RoPE positions alone (the images are all in the reused prefix)."""
        import mlx.core as mx

        extra = {k: mx.array(v) for k, v in vp.arrays.items() if k == "image_grid_thw"}
        pos, delta = self.vlm.language_model.get_rope_index(
            mx.array([vp.tokens], dtype=mx.int32), extra.get("image_grid_thw"))
        vp.positions, vp.delta = pos, int(delta.reshape(-1)[0].item())

    def prefill_inputs(self, vp: VisionPrompt, start: int, end: int):
        """(keyword arguments for the text model's call, a context to run it in) for the
        chunk [start, end) of an image prompt."""
        if not vp.encoded and vp.image_from(start):
            self._encode(vp)
        if self.rope is not None and vp.positions is None:
            self._positions(vp)
        kwargs = {}
        if vp.embeds is not None:
            kwargs["input_embeddings"] = vp.embeds[:, start:end]
        rope = contextlib.nullcontext() if self.rope is None else \
            self.rope.use(positions=vp.positions[:, :, start:end])
        return kwargs, rope

    def decode_rope(self, seqs) -> contextlib.AbstractContextManager:
        """The context for a decode step over `seqs` (rows in batch order)."""
        deltas = [s.vision.delta if s.vision is not None else 0 for s in seqs]
        if self.rope is None or not any(deltas):
            return contextlib.nullcontext()
        import mlx.core as mx

        return self.rope.use(deltas=mx.array(deltas, dtype=mx.int32))


# Attention scores one encoding stage computes at most (query rows x keys): about 2.5 ms of
# softmax on the 2-core EPYC, where MLX's exp costs ~17 ns an element (docs/PERFORMANCE.md).
STAGE_SCORES = 128 * 1024


def _qwen_tower_stages(tower, vp: VisionPrompt, host: bool, whole_blocks: bool = False):
    """Qwen2.5-VL's or Qwen2-VL's image tower (mlx-vlm's modules, run in the order its forward
    pass runs them), yielding None between stages, then the features.

    Qwen2-VL's blocks each attend over each whole image (each frame). Qwen2.5-VL's attend
    within windows in most blocks and over each whole image in the blocks
    `fullatt_block_indexes` names; its patches are reordered into windows first (in units of
    one merged token, `spatial_merge_unit` patches) and the merger's output is put back in
    image order at the end.

    On the CPU a block's attention is split by query rows into stages of at most STAGE_SCORES
    scores, so one large image's full-attention block is no single long stall. With
    `whole_blocks` (a GPU) a stage is one block, its windows attended in one call under a
    block-diagonal mask (up to MASKED_PATCHES patches): there the cost of a stage is its
    kernel launches and the wait for its result, not its arithmetic. On an H200 the split
    tower's stages took 4-10 ms a turn against a 1.9 ms decode step (docs/PERFORMANCE.md, "On
    a GPU")."""
    import mlx.core as mx

    dtype = tower.patch_embed.proj.weight.dtype
    grid = mx.array(vp.arrays["image_grid_thw"])
    hidden = tower.patch_embed(mx.array(vp.arrays["pixel_values"]).astype(dtype))
    rotary = tower.rot_pos_emb(grid)
    frames = [(int(h) * int(w), int(t)) for t, h, w in grid.tolist()]
    images = [0] + list(itertools.accumulate(size for size, count in frames
                                             for _ in range(count)))
    order, windows, whole_image_blocks = None, images, range(len(tower.blocks))
    if hasattr(tower, "get_window_index"):  # Qwen2.5-VL
        order, window_bounds = tower.get_window_index(grid)
        windows = []
        for b in window_bounds.tolist():  # empty windows repeat a bound: keep each once
            if b not in windows:
                windows.append(b)
        unit, n = tower.spatial_merge_unit, hidden.shape[0]
        hidden = hidden.reshape(n // unit, unit, -1)[order].reshape(n, -1)
        rotary = rotary.reshape(n // unit, unit, -1)[order].reshape(n, -1)
        whole_image_blocks = tower.fullatt_block_indexes
    # A GPU's masks, made once for all the blocks that attend over the same segments.
    masks = {id(b): _segment_mask(b) for b in (images, windows)} if whole_blocks else {}
    mx.eval(hidden, rotary)
    yield None
    for i, block in enumerate(tower.blocks):
        bounds = images if i in whole_image_blocks else windows
        if whole_blocks:
            hidden = _whole_block(block, hidden, bounds, masks[id(bounds)], rotary)
            mx.eval(hidden)
            yield None
        else:
            hidden = yield from _block_stages(block, hidden, bounds, rotary, host)
    merged = tower.merger(hidden)
    yield merged if order is None else merged[mx.argsort(order, axis=0)]


# The most patches whose windows are attended in one call under a block-diagonal mask; past
# it each window gets its own call. A mask (and, where the attention does not fuse, the
# scores) grows with the square of the patches: a 16K-patch image's would be 268M entries a
# head.
MASKED_PATCHES = 2048


def _segment_mask(bounds: list[int]):
    """(n, n) booleans, True where two patches share a segment [bounds[i], bounds[i+1]);
    None when one segment covers them all, or past MASKED_PATCHES patches."""
    import mlx.core as mx

    if len(bounds) <= 2 or bounds[-1] > MASKED_PATCHES:
        return None
    starts = mx.array(bounds[1:-1], dtype=mx.int32)
    segment = (mx.arange(bounds[-1], dtype=mx.int32)[:, None] >= starts[None, :]).sum(axis=1)
    return segment[:, None] == segment[None, :]


def _qkv(block, hidden, rotary):
    """A block's queries, keys and values, (1, heads, n, dim) each, RoPE applied."""
    from mlx_vlm.models.qwen2_5_vl.vision import apply_rotary_pos_emb_vision

    attn, n = block.attn, hidden.shape[0]
    qkv = attn.qkv(block.norm1(hidden)).reshape(n, 3, attn.num_heads, -1)
    q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]  # (n, heads, dim)
    q = apply_rotary_pos_emb_vision(q[None], rotary)[0]
    k = apply_rotary_pos_emb_vision(k[None], rotary)[0]
    return tuple(t.transpose(1, 0, 2)[None] for t in (q, k, v))


def _finish_block(block, hidden, out):
    """The block's output from its attention's, `out` (1, heads, n, dim)."""
    out = out.transpose(0, 2, 1, 3).reshape(hidden.shape[0], -1)
    hidden = hidden + block.attn.proj(out)
    return hidden + block.mlp(block.norm2(hidden))


def _whole_block(block, hidden, bounds: list[int], mask, rotary):
    """One vision block in one graph, each segment [bounds[i], bounds[i+1]) of patches
    attending within itself: in one call (one segment, or several under `mask`, their
    `_segment_mask`), else a call a segment."""
    import mlx.core as mx

    q, k, v = _qkv(block, hidden, rotary)
    scale = block.attn.scale
    if len(bounds) <= 2 or mask is not None:
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
    else:
        out = mx.concatenate([
            mx.fast.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b],
                                                 scale=scale)
            for a, b in zip(bounds, bounds[1:])], axis=2)
    return _finish_block(block, hidden, out)


def _block_stages(block, hidden, bounds: list[int], rotary, host: bool):
    """One vision block (`x + attn(norm1(x))`, then `x + mlp(norm2(x))`) with each segment
    [bounds[i], bounds[i+1]) attending within itself, in stages; returns the block's output."""
    import mlx.core as mx

    q, k, v = _qkv(block, hidden, rotary)
    mx.eval(q, k, v)
    yield None
    outs, pending = [], 0
    heads, dim = q.shape[1], q.shape[3]
    for s, e, a, b, count in _attention_calls(bounds):
        if count == 1:
            outs.append(_attend(q[:, :, s:e], k[:, :, a:b], v[:, :, a:b], block.attn.scale,
                                host))
        else:  # `count` windows of one length: each (head, window) pair a head of one call
            width = (b - a) // count
            split = [t[:, :, a:b].reshape(1, heads * count, width, dim) for t in (q, k, v)]
            out = _attend(*split, block.attn.scale, host)
            outs.append(out.reshape(1, heads, b - a, dim))
        pending += (e - s) * (b - a) // count
        if pending >= STAGE_SCORES:
            mx.eval(outs)
            pending = 0
            yield None
    hidden = _finish_block(block, hidden, mx.concatenate(outs, axis=2))
    mx.eval(hidden)
    yield None
    return hidden


def _attention_calls(bounds: list[int]):
    """The attention calls for segments [bounds[i], bounds[i+1]) that each attend within
    themselves, as (query start, query end, segment start, segment end, windows): a segment
    of more than STAGE_SCORES scores in pieces of query rows, one window per call; runs of
    consecutive windows of one length together, up to STAGE_SCORES scores a call. Qwen2.5-VL's
    windowed blocks have 16 windows of 64 patches in a 448x448 image: one call each took 6.8
    ms on the 2-core EPYC, a turn of its own beside the streams (docs/PERFORMANCE.md,
    session 23)."""
    segments = list(zip(bounds, bounds[1:]))
    i = 0
    while i < len(segments):
        a, b = segments[i]
        width = b - a
        if width * width > STAGE_SCORES:
            rows = max(STAGE_SCORES // max(width, 1), 1)
            for s in range(a, b, rows):
                yield s, min(s + rows, b), a, b, 1
            i += 1
            continue
        count = 1
        while i + count < len(segments) and \
                segments[i + count][1] - segments[i + count][0] == width and \
                (count + 1) * width * width <= STAGE_SCORES:
            count += 1
        end = a + count * width
        yield a, end, a, end, count
        i += count


def _siglip_tower_stages(vlm, vp: VisionPrompt, host: bool, whole_layers: bool = False):
    """Gemma 3's image tower (mlx-vlm's SigLIP modules, in the order its forward pass runs
    them: the patch embeddings, each encoder layer, the last norm, then the projector), yielding
    None between stages, then the features. Each image's patches attend over all of that
    image's patches; on the CPU a layer's attention is split by query rows into stages of at
    most STAGE_SCORES scores (a real Gemma 3 image is 4,096 patches: 16M scores a head in each
    of 27 layers), on a GPU (`whole_layers`) a stage is one layer."""
    import mlx.core as mx

    tower = vlm.vision_tower.vision_model
    # The dtype mlx-vlm's get_input_embeddings gives the pixels: its token embeddings'.
    dtype = vlm.language_model.model.embed_tokens(mx.array([0])).dtype
    pixels = mx.array(vp.arrays["pixel_values"]).transpose(0, 2, 3, 1).astype(dtype)
    hidden = tower.embeddings(pixels)
    mx.eval(hidden)
    yield None
    for layer in tower.encoder.layers:
        if whole_layers:
            hidden = layer(hidden)
            mx.eval(hidden)
            yield None
        else:
            hidden = yield from _siglip_layer_stages(layer, hidden, host)
    yield vlm.multi_modal_projector(tower.post_layernorm(hidden))


def _siglip_layer_stages(layer, hidden, host: bool):
    """One SigLIP encoder layer (`x + attn(norm1(x))`, then `x + mlp(norm2(x))`) over
    `hidden` (images, patches, dims), in stages; returns the layer's output."""
    import mlx.core as mx

    attn = layer.self_attn
    images, n, _ = hidden.shape
    x = layer.layer_norm1(hidden)
    q, k, v = (proj(x).reshape(images, n, attn.num_heads, -1).transpose(0, 2, 1, 3)
               for proj in (attn.q_proj, attn.k_proj, attn.v_proj))
    mx.eval(q, k, v)
    yield None
    rows = max(STAGE_SCORES // n, 1)
    per_image, pending = [], 0
    for i in range(images):
        outs = []
        for s in range(0, n, rows):
            e = min(s + rows, n)
            outs.append(_attend(q[i:i + 1, :, s:e], k[i:i + 1], v[i:i + 1], attn.scale, host))
            pending += (e - s) * n
            if pending >= STAGE_SCORES:
                mx.eval(outs)
                pending = 0
                yield None
        per_image.append(mx.concatenate(outs, axis=2))
    out = mx.concatenate(per_image, axis=0).transpose(0, 2, 1, 3).reshape(images, n, -1)
    hidden = hidden + attn.out_proj(out)
    hidden = hidden + layer.mlp(layer.layer_norm2(hidden))
    mx.eval(hidden)
    yield None
    return hidden


def _attend(q, k, v, scale: float, host: bool):
    """Image patches attending over a segment, with no mask: with numpy's softmax where the
    text rows would use it (runner/kv/host_attention.py), so an image's prompt costs no more
    against a text prompt of the same length than MLX's softmax would make it."""
    import mlx.core as mx

    from mlxr.runner.kv import host_attention

    if host and host_attention.worth_it(q.shape[1] * q.shape[2] * k.shape[2], k.dtype):
        return host_attention.attend(q, k, v, scale, causal=False)
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale)


def load_vision(model_dir: str, text_model, host_attention: bool = True) -> VisionModel | None:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    if vision_family(config) is None:
        return None
    return VisionModel(model_dir, text_model, config, host_attention)
