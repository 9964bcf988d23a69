"""Per-architecture knowledge: GGUF metadata and tensor names <-> a Hugging Face config.json and
weight names that mlx_lm loads, with the tensor transforms llama.cpp's converter applies.

Supported (GGUF `general.architecture` -> mlx_lm `model_type`): llama -> llama (Llama 2 and 3,
and Mistral 7B / Nemo, whose GGUFs say "llama"; with experts, mixtral: Mixtral 8x7B and 8x22B,
each projection's experts stacked, as llama.cpp has written them since April 2024: its loader
no longer takes the first files' one tensor an expert, nor does this), qwen2, qwen3, gemma2,
gemma3 -> gemma3_text (text only: a multimodal file's vision tower is left out), phi3, granite,
granitemoe (Granite 3's mixtures), and qwen3moe ->
qwen3_moe (Qwen3's mixtures of experts: each layer's experts are one 3-D tensor a projection,
as mlx_lm's `switch_mlp` holds them), gpt-oss -> gpt_oss, and gemma4 -> gemma4_text (text only;
its per-layer settings are gemma4.py's).

Invariants:
- `hf_tensor_name` and `gguf_tensor_name` are inverses on every tensor mlx_lm loads; a GGUF
  tensor that only carries metadata (`rope_freqs`, `rope_factors_*`) maps to None and is read by
  `hf_config` instead, as do a multimodal gemma3 file's vision tensors (`v.*`, `mm.*`); any
  other unknown name is an error naming it, never silently dropped.
- `row_order` undoes exactly the row permutation `gguf_row_order` applies (llama.cpp's q/k
  interleaving for llama-rope architectures), so composing them is the identity. It is a row
  permutation only: the caller applies it alike to float weights and to quantized weights,
  scales and biases, since GGUF quant blocks and MLX groups both run along rows.
- `value_offset` is what to add to a GGUF tensor to get the mlx_lm value (Gemma stores RMSNorm
  weights as 1 + w); writing a GGUF subtracts it.
- `hf_config(gguf_metadata(config))` reproduces every field mlx_lm reads for these models.
- Everything here is numpy and plain Python: no mlx, no file access.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import numpy as np

from mlxr.shared.errors import InvalidRequest, UnsupportedModel

from . import gemma4


class UnsupportedArchitecture(UnsupportedModel):
    """A GGUF model this server cannot run: its architecture, a tensor, or a setting."""


# -- tensor names ------------------------------------------------------------------------
_ATTENTION = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
}
_MLP = {"ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_QK_NORM = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
# llama.cpp's `ffn_norm` is the norm before the MLP: Llama's post_attention_layernorm, but
# Gemma's pre_feedforward_layernorm (Gemma's post_attention_layernorm is a post-norm).
_PRE_NORM_BLOCK = {**_ATTENTION, **_MLP, "ffn_norm": "post_attention_layernorm"}
_GEMMA_BLOCK = {**_ATTENTION, **_MLP, "post_attention_norm": "post_attention_layernorm",
                "ffn_norm": "pre_feedforward_layernorm",
                "post_ffw_norm": "post_feedforward_layernorm"}
# Phi-3 keeps q/k/v fused, and gate/up fused under llama.cpp's `ffn_up` name.
_PHI3_BLOCK = {"attn_norm": "input_layernorm", "attn_qkv": "self_attn.qkv_proj",
               "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
               "ffn_up": "mlp.gate_up_proj", "ffn_down": "mlp.down_proj"}
# Mixtral (and Mistral's other mixtures): a "llama" GGUF whose MLP is a mixture, named as
# mlx_lm's mixtral module holds it: the router, every expert's projection stacked.
_MIXTRAL_MOE = {"ffn_gate_inp": "block_sparse_moe.gate",
                "ffn_gate_exps": "block_sparse_moe.switch_mlp.gate_proj",
                "ffn_up_exps": "block_sparse_moe.switch_mlp.up_proj",
                "ffn_down_exps": "block_sparse_moe.switch_mlp.down_proj"}
# Granite's mixtures (granitemoe: granite3-moe, granite3.1-moe): the router is
# `block_sparse_moe.router.layer`; Hugging Face's fused `input_linear` (gate then up) and
# `output_linear` become mlx_lm's switch_mlp, as llama.cpp's converter splits them.
_GRANITE_MOE = {"ffn_gate_inp": "block_sparse_moe.router.layer",
                "ffn_gate_exps": "block_sparse_moe.switch_mlp.gate_proj",
                "ffn_up_exps": "block_sparse_moe.switch_mlp.up_proj",
                "ffn_down_exps": "block_sparse_moe.switch_mlp.down_proj"}
# A mixture of experts: the router, and every expert's projection stacked (experts, out, in).
_MOE = {"ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.switch_mlp.gate_proj",
        "ffn_up_exps": "mlp.switch_mlp.up_proj", "ffn_down_exps": "mlp.switch_mlp.down_proj"}
# gpt-oss: biases on q/k/v/o, the router and every expert; one attention sink a head (a bare
# parameter in mlx_lm, `self_attn.sinks`); the MLP's norm is llama.cpp's post_attention_norm.
# Ollama's files from OpenAI's own checkpoint keep q/k/v fused (`attn_qkv`), split on import.
_GPT_OSS_BLOCK = {**_ATTENTION, "attn_qkv": "self_attn.qkv_proj", "attn_sinks": "self_attn.sinks",
                  "post_attention_norm": "post_attention_layernorm",
                  "ffn_gate_inp": "mlp.router", "ffn_gate_exps": "mlp.experts.gate_proj",
                  "ffn_up_exps": "mlp.experts.up_proj", "ffn_down_exps": "mlp.experts.down_proj"}
_BARE = (".self_attn.sinks",)  # mlx_lm parameters with no `.weight`
_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# sentence-transformers' Dense modules: GGUF stem -> the module folder's weight stem (a name
# with a folder is written into that folder's model.safetensors: convert.py).
DENSE_MODULES = {"dense_2": "2_Dense/linear", "dense_3": "3_Dense/linear"}
# Tensors that carry rope settings, read by hf_config (pass them as `rope_tensors`).
ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


@dataclass(frozen=True, slots=True)
class ArchSpec:
    gguf: str  # general.architecture
    model_type: str  # config.json model_type (mlx_lm's module)
    hf_class: str
    block: dict[str, str]  # GGUF block tensor stem -> HF name inside model.layers.{i}
    permute_qk: bool = False  # llama.cpp interleaves q/k rotary halves (llama-style rope)
    norm_offset: float = 0.0  # GGUF norm weight = HF weight - norm_offset
    head_dim_derived: bool = False  # mlx_lm computes hidden // heads and reads no head_dim
    skip_prefixes: tuple[str, ...] = ()  # tensors of other modalities, left out
    aliases: tuple[str, ...] = ()  # other model_types written as this architecture
    globals: dict[str, str] = field(default_factory=dict)  # beyond _GLOBAL: GGUF stem -> HF
    scales: dict[tuple[str, str], str] = field(default_factory=dict)  # (stem, kind) -> HF
    bare: tuple[str, ...] = _BARE  # HF parameters with no `.weight`
    block_inverse: dict[str, str] = field(init=False, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "block_inverse", {v: k for k, v in self.block.items()})


SPECS: dict[str, ArchSpec] = {s.gguf: s for s in (
    ArchSpec("llama", "llama", "LlamaForCausalLM", {**_PRE_NORM_BLOCK, **_MIXTRAL_MOE},
             permute_qk=True, aliases=("mistral", "mixtral")),
    ArchSpec("qwen2", "qwen2", "Qwen2ForCausalLM", _PRE_NORM_BLOCK, head_dim_derived=True),
    ArchSpec("qwen3", "qwen3", "Qwen3ForCausalLM", {**_PRE_NORM_BLOCK, **_QK_NORM}),
    ArchSpec("gemma2", "gemma2", "Gemma2ForCausalLM", _GEMMA_BLOCK, norm_offset=-1.0),
    # EmbeddingGemma (llama.cpp's and Ollama's files alike): gemma3's body with attention both
    # ways, and sentence-transformers' two Dense modules as `dense_2`, `dense_3` (written into
    # their module folders). Before gemma3: a gemma3_text config is written as gemma3.
    ArchSpec("gemma-embedding", "gemma3_text", "Gemma3TextModel", {**_GEMMA_BLOCK, **_QK_NORM},
             norm_offset=-1.0, globals=DENSE_MODULES),
    ArchSpec("gemma3", "gemma3_text", "Gemma3ForCausalLM", {**_GEMMA_BLOCK, **_QK_NORM},
             norm_offset=-1.0, skip_prefixes=("v.", "mm.")),
    ArchSpec("phi3", "phi3", "Phi3ForCausalLM", _PHI3_BLOCK, head_dim_derived=True),
    ArchSpec("granite", "granite", "GraniteForCausalLM", _PRE_NORM_BLOCK, permute_qk=True,
             head_dim_derived=True),
    ArchSpec("granitemoe", "granitemoe", "GraniteMoeForCausalLM",
             {**_ATTENTION, **_GRANITE_MOE, "ffn_norm": "post_attention_layernorm"},
             permute_qk=True, head_dim_derived=True),
    ArchSpec("qwen3moe", "qwen3_moe", "Qwen3MoeForCausalLM",
             {**_ATTENTION, **_QK_NORM, **_MOE, "ffn_norm": "post_attention_layernorm"}),
    # Ollama's first gpt-oss files say "gptoss"; llama.cpp's and later Ollama's "gpt-oss"
    # (written last: the name a gpt_oss config is written under).
    ArchSpec("gptoss", "gpt_oss", "GptOssForCausalLM", _GPT_OSS_BLOCK),
    ArchSpec("gpt-oss", "gpt_oss", "GptOssForCausalLM", _GPT_OSS_BLOCK),
    ArchSpec(gemma4.ARCH, gemma4.MODEL_TYPE, gemma4.HF_CLASS, gemma4.BLOCK,
             skip_prefixes=gemma4.SKIP_PREFIXES, globals=gemma4.GLOBALS, scales=gemma4.SCALES,
             bare=gemma4.BARE),
)}
ARCHITECTURES: tuple[str, ...] = tuple(SPECS)
_BY_MODEL_TYPE = {t: s for s in SPECS.values() for t in (s.model_type, *s.aliases)}

_GGUF_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias|scale)")
_GGUF_GLOBAL = re.compile(r"(\w+)\.(weight|bias)")
_HF_BLOCK = re.compile(r"model\.layers\.(\d+)\.([\w.]+)\.(weight|bias)")
_HF_BARE = re.compile(r"model\.layers\.(\d+)\.([\w.]+)")
# (and a module folder's weight: 2_Dense/linear.weight)
_HF_GLOBAL = re.compile(r"(model\.[\w.]+|lm_head|\w+/\w+)\.(weight|bias)")
_HF_EXPERT = re.compile(r"(model\.layers\.\d+\.mlp)\.experts\.(\d+)\.(\w+_proj)\.weight")
# Mixtral's: `block_sparse_moe.experts.E.w1` (gate), `w3` (up), `w2` (down).
_HF_MIXTRAL_EXPERT = re.compile(
    r"(model\.layers\.\d+\.block_sparse_moe)\.experts\.(\d+)\.(w[123])\.weight")
_MIXTRAL_PROJ = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
# Granite's: every expert's gate and up in one `input_linear` (experts, 2 x width, in), the
# down projections in `output_linear`.
_HF_GRANITE_EXPERTS = re.compile(
    r"(model\.layers\.\d+\.block_sparse_moe)\.(input|output)_linear\.weight")
_HF_QK = re.compile(r"model\.layers\.\d+\.self_attn\.([qk])_proj\.(weight|bias|scales|biases)")


def spec(arch: str) -> ArchSpec:
    try:
        return SPECS[arch]
    except KeyError:
        raise UnsupportedArchitecture(
            f'GGUF architecture "{arch}" is not supported; supported: '
            + ", ".join(ARCHITECTURES)) from None


def spec_for_model_type(model_type: str) -> ArchSpec:
    try:
        return _BY_MODEL_TYPE[model_type]
    except KeyError:
        raise UnsupportedArchitecture(
            f'model type "{model_type}" has no GGUF architecture here; supported: '
            + ", ".join(sorted(_BY_MODEL_TYPE))) from None


def hf_tensor_name(arch: str, gguf_name: str) -> str | None:
    """The mlx_lm weight name of a GGUF tensor; None for tensors read as metadata or of
    another modality."""
    s = spec(arch)
    if gguf_name in ROPE_TENSORS or gguf_name.startswith(s.skip_prefixes):
        return None
    if m := _GGUF_BLOCK.fullmatch(gguf_name):
        layer, stem, kind = m.groups()
        if stem == "attn_rot_embd":  # old files: a precomputed rope table, never used
            return None
        if (stem, kind) in s.scales:
            return f"model.layers.{layer}.{s.scales[stem, kind]}"
        if stem in s.block and kind != "scale":
            name = f"model.layers.{layer}.{s.block[stem]}"
            return name if name.endswith(s.bare) and kind == "weight" else f"{name}.{kind}"
    elif (m := _GGUF_GLOBAL.fullmatch(gguf_name)) and (hf := {**_GLOBAL, **s.globals}.get(
            m.group(1))):
        return f"{hf}.{m.group(2)}"
    raise UnsupportedArchitecture(f'tensor "{gguf_name}" of a {arch} GGUF is not supported')


def gguf_tensor_name(arch: str, hf_name: str) -> str:
    """The GGUF name llama.cpp's converter gives an mlx_lm weight."""
    s = spec(arch)
    if (m := _HF_BARE.fullmatch(hf_name)) and hf_name.endswith(s.bare):
        scale = next((key for key, v in s.scales.items() if v == m.group(2)), None)
        if scale is not None:
            return f"blk.{m.group(1)}.{scale[0]}.{scale[1]}"
        if m.group(2) in s.block_inverse:
            return f"blk.{m.group(1)}.{s.block_inverse[m.group(2)]}.weight"
    if m := _HF_BLOCK.fullmatch(hf_name):
        layer, stem, kind = m.groups()
        if stem in s.block_inverse:
            return f"blk.{layer}.{s.block_inverse[stem]}.{kind}"
    elif m := _HF_GLOBAL.fullmatch(hf_name):
        stem = next((k for k, v in {**_GLOBAL, **s.globals}.items() if v == m.group(1)), None)
        if stem is not None:
            return f"{stem}.{m.group(2)}"
    raise UnsupportedArchitecture(f'weight "{hf_name}" has no GGUF name for {arch}')


def stack_experts(tensors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Hugging Face's weights of a mixture, one tensor per expert and projection
    (`model.layers.L.mlp.experts.E.gate_proj.weight`, Mixtral's
    `...block_sparse_moe.experts.E.w1.weight`; Granite's fused `input_linear`, split), as
    mlx_lm and GGUF hold them: one
    (experts, out, in) tensor a projection (`...mlp.switch_mlp.gate_proj.weight`). Other
    weights pass as they are."""
    out: dict[str, np.ndarray] = {}
    experts: dict[str, dict[int, np.ndarray]] = {}
    for name, x in tensors.items():
        if m := _HF_EXPERT.fullmatch(name):
            mlp, e, proj = m.groups()
            experts.setdefault(f"{mlp}.switch_mlp.{proj}.weight", {})[int(e)] = x
        elif m := _HF_MIXTRAL_EXPERT.fullmatch(name):
            mlp, e, w = m.groups()
            experts.setdefault(f"{mlp}.switch_mlp.{_MIXTRAL_PROJ[w]}.weight", {})[int(e)] = x
        elif m := _HF_GRANITE_EXPERTS.fullmatch(name):
            moe, kind = m.groups()
            if kind == "output":
                out[f"{moe}.switch_mlp.down_proj.weight"] = x
            else:
                gate, up = np.split(x, 2, axis=1)
                out[f"{moe}.switch_mlp.gate_proj.weight"] = gate
                out[f"{moe}.switch_mlp.up_proj.weight"] = up
        else:
            out[name] = x
    for name, by_index in experts.items():
        if sorted(by_index) != list(range(len(by_index))):
            raise UnsupportedArchitecture(f"{name}: experts {sorted(by_index)} are not 0..n-1")
        out[name] = np.stack([by_index[e] for e in range(len(by_index))])
    return out


# -- tensor values -----------------------------------------------------------------------
def _qk_heads(hf_name: str, config: Mapping[str, Any]) -> tuple[int, int] | None:
    """(heads, head_dim) of a q/k projection (weight, bias or quantized parts), else None."""
    m = _HF_QK.fullmatch(hf_name)
    if m is None:
        return None
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or config["hidden_size"] // heads)
    return (heads if m.group(1) == "q" else kv_heads), head_dim


def interleave_order(heads: int, head_dim: int) -> np.ndarray:
    """Rows of llama.cpp's layout taken from the HF layout: within each head, HF keeps the
    two rotary halves apart ([x0..x(d/2-1), y0..]); llama.cpp interleaves them ([x0, y0, x1,
    y1, ...]). Row h*d + 2i + j of the GGUF tensor is HF row h*d + j*d/2 + i."""
    half = head_dim // 2
    i, j = np.divmod(np.arange(head_dim), 2)
    within = j * half + i
    return (np.arange(heads)[:, None] * head_dim + within[None, :]).reshape(-1)


def gguf_row_order(arch: str, hf_name: str, config: Mapping[str, Any]) -> np.ndarray | None:
    """Indices with gguf_rows = hf_rows[order] (llama.cpp's q/k permutation); None when the
    tensor is stored as is."""
    shape = _qk_heads(hf_name, config) if spec(arch).permute_qk else None
    return None if shape is None else interleave_order(*shape)


def row_order(arch: str, hf_name: str, config: Mapping[str, Any]) -> np.ndarray | None:
    """Indices with hf_rows = gguf_rows[order], undoing `gguf_row_order`; None: as is."""
    order = gguf_row_order(arch, hf_name, config)
    return None if order is None else np.argsort(order)


def value_offset(arch: str, hf_name: str) -> float:
    """What to add to the GGUF tensor to get mlx_lm's: -1.0 for Gemma's RMSNorm weights
    (every `*norm.weight`, the q/k norms included), else 0.0."""
    s = spec(arch)
    return s.norm_offset if hf_name.endswith("norm.weight") else 0.0


# -- config ------------------------------------------------------------------------------
LLAMA3_ORIGINAL_CONTEXTS = (8192, 4096, 2048, 16384, 32768, 65536, 131072, 1024)
LLAMA3_FACTORS = (8.0, 32.0, 16.0, 4.0, 2.0, 64.0)
LLAMA3_LOW_HIGH = ((1.0, 4.0), (1.0, 2.0), (1.0, 8.0), (0.5, 4.0), (2.0, 8.0), (0.5, 2.0))


def llama3_rope_factors(rope_theta: float, dims: int, factor: float, low_freq_factor: float,
                        high_freq_factor: float, original_context: int) -> np.ndarray:
    """Llama 3's per-frequency divisors, as llama.cpp stores them in `rope_freqs.weight`:
    1 for wavelengths under original/high, `factor` over original/low, and a smooth
    interpolation of the frequency in between."""
    wavelen = 2 * math.pi * rope_theta ** (np.arange(0, dims, 2, dtype=np.float64) / dims)
    smooth = (original_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    between = 1.0 / ((1 - smooth) / factor + smooth)
    out = np.where(wavelen < original_context / high_freq_factor, 1.0,
                   np.where(wavelen > original_context / low_freq_factor, factor, between))
    return out.astype(np.float32)


def llama3_rope_scaling(freqs: np.ndarray, rope_theta: float, dims: int) -> dict[str, Any] | None:
    """Llama 3's rope_scaling from its `rope_freqs` tensor: the first candidate setting whose
    factors match (None when every factor is 1). Settings that give equal factors are equal
    for the model, so the first match is as good as the original."""
    freqs = np.asarray(freqs, dtype=np.float32).reshape(-1)
    if freqs.size != dims // 2:
        raise UnsupportedArchitecture(
            f"rope_freqs has {freqs.size} factors; {dims // 2} expected for rope dimension {dims}")
    if np.allclose(freqs, 1.0):
        return None
    top = float(freqs.max())
    factors = dict.fromkeys((round(top, 4), *LLAMA3_FACTORS))
    for original in LLAMA3_ORIGINAL_CONTEXTS:
        for factor in factors:
            for low, high in LLAMA3_LOW_HIGH:
                ref = llama3_rope_factors(rope_theta, dims, factor, low, high, original)
                if np.allclose(ref, freqs, rtol=1e-4, atol=1e-5):
                    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                            "high_freq_factor": high,
                            "original_max_position_embeddings": original}
    raise UnsupportedArchitecture(
        "rope_freqs.weight does not match Llama 3's rope scaling for any known setting")


class _Kv:
    """`{arch}.`-prefixed lookups into GGUF metadata."""

    def __init__(self, kv: Mapping[str, Any], arch: str):
        self.kv, self.arch = kv, arch

    def get(self, key: str, default: Any = None) -> Any:
        value = self.kv.get(f"{self.arch}.{key}")
        return default if value is None else value

    def scalar(self, key: str, default: Any = None) -> Any:
        """A value some files write per layer: it must then be the same for every layer."""
        value = self.get(key, default)
        if isinstance(value, (list, tuple)):
            if not value or any(v != value[0] for v in value):
                raise UnsupportedArchitecture(
                    f"{self.arch}.{key} varies across layers ({value[:8]}...), which is not "
                    "supported")
            value = value[0]
        if value is None:
            raise UnsupportedArchitecture(f"the GGUF file has no {self.arch}.{key}")
        return value


def hf_config(kv: Mapping[str, Any], *, vocab_size: int, tied: bool,
              has_rope_freqs: bool = False, rope_freqs: np.ndarray | None = None,
              rope_tensors: Mapping[str, np.ndarray] | None = None,
              tensor_names: Iterable[str] | None = None) -> dict[str, Any]:
    """config.json for mlx_lm from GGUF metadata (plain values keyed by GGUF key). `tied`: the
    file has no `output.weight`. `rope_tensors`: the file's ROPE_TENSORS (or `rope_freqs`
    alone); `tensor_names`: every tensor name, to see optional biases."""
    arch = kv.get("general.architecture")
    s = spec(str(arch))
    rope = dict(rope_tensors or {})
    if rope_freqs is not None:
        rope["rope_freqs.weight"] = rope_freqs
    elif has_rope_freqs and "rope_freqs.weight" not in rope:
        raise ValueError("has_rope_freqs: pass the rope_freqs tensor's values")
    p = _Kv(kv, s.gguf)
    heads = int(p.scalar("attention.head_count"))
    hidden = int(p.scalar("embedding_length"))
    if s.gguf == gemma4.ARCH:  # per-layer widths and head counts, two head sizes
        return _gemma4(p, heads, hidden, vocab_size, tied, rope, set(tensor_names or ()))
    head_dim = int(p.get("attention.key_length") or p.get("attention.head_dim") or hidden // heads)
    if int(p.get("attention.value_length", head_dim)) != head_dim:
        raise UnsupportedArchitecture(f"{arch} with different key and value head sizes")
    if s.head_dim_derived and head_dim * heads != hidden:
        raise UnsupportedArchitecture(
            f"{arch} with head size {head_dim} (mlx_lm assumes hidden / heads = {hidden // heads})")
    config: dict[str, Any] = {
        "architectures": [s.hf_class],
        "model_type": s.model_type,
        "hidden_size": hidden,
        "num_hidden_layers": int(p.scalar("block_count")),
        # (a mixture's file may give only its experts' width)
        "intermediate_size": int(p.scalar("feed_forward_length",
                                          p.get("expert_feed_forward_length"))),
        "num_attention_heads": heads,
        "num_key_value_heads": int(p.scalar("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(p.scalar("attention.layer_norm_rms_epsilon",
                                       _DEFAULT_EPS.get(s.gguf, 1e-5))),
        "rope_theta": float(p.get("rope.freq_base", p.get(
            "rope.global.freq_base", _DEFAULT_ROPE_THETA.get(s.gguf, 10000.0)))),
        "max_position_embeddings": int(p.scalar("context_length", 4096)),
        "vocab_size": int(vocab_size),
        "tie_word_embeddings": bool(tied),
        "hidden_act": "gelu_pytorch_tanh" if s.gguf.startswith("gemma") else "silu",
    }
    names = set(tensor_names or ())
    _EXTRA[s.gguf](config, p, rope, names)
    return config


def _gemma4(p: _Kv, heads: int, hidden: int, vocab_size: int, tied: bool,
            rope: Mapping[str, np.ndarray], names: set[str]) -> dict[str, Any]:
    base = {"hidden_size": hidden, "num_hidden_layers": int(p.scalar("block_count")),
            "num_attention_heads": heads,
            "rms_norm_eps": float(p.scalar("attention.layer_norm_rms_epsilon", 1e-6)),
            "max_position_embeddings": int(p.scalar("context_length", 131072)),
            "vocab_size": int(vocab_size), "tie_word_embeddings": bool(tied)}
    try:
        return gemma4.hf_config(p, base, rope, names)
    except gemma4.Gemma4Error as exc:
        raise UnsupportedArchitecture(str(exc)) from None


# Where a file leaves a setting out (Ollama's multimodal gemma3 files write neither), the
# value its runtimes assume.
_DEFAULT_ROPE_THETA = {"gemma3": 1_000_000.0, "gemma-embedding": 1_000_000.0}
_DEFAULT_EPS = {"gemma2": 1e-6, "gemma3": 1e-6, "gemma-embedding": 1e-6}


def _rope_scaling(p: _Kv) -> dict[str, Any] | None:
    """rope_scaling from `rope.scaling.*` keys (linear and YaRN), or Ollama's
    `rope.freq_scale` (the inverse of a linear factor)."""
    kind = p.get("rope.scaling.type", "none")
    if kind == "none":
        scale = float(p.get("rope.freq_scale", 1.0))
        return None if scale == 1.0 else {"rope_type": "linear", "factor": 1.0 / scale}
    factor = float(p.get("rope.scaling.factor", 1.0))
    if kind == "linear":
        return None if factor == 1.0 else {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        original = p.get("rope.scaling.original_context_length", p.get("context_length"))
        out = {"rope_type": "yarn", "factor": factor,
               "original_max_position_embeddings": int(original)}
        for key in ("beta_fast", "beta_slow"):  # llama.cpp's names, then Ollama's
            value = p.get(f"rope.scaling.yarn_{key}", p.get(f"rope.scaling.{key}"))
            if value is not None:
                out[key] = float(value)
        return out
    raise UnsupportedArchitecture(f'{p.arch} rope scaling "{kind}" is not supported')


def _rope(config: dict, p: _Kv, rope: Mapping[str, np.ndarray]) -> None:
    """Llama 3 scaling from `rope_freqs` where the file has it, else the rope.scaling keys.
    (Ollama's llama converter writes hidden / heads as the rope dimension even where the head
    size differs: the head size is what rotates.)"""
    dims = int(p.get("rope.dimension_count", config["head_dim"]))
    if dims < config["head_dim"]:
        raise UnsupportedArchitecture(
            f"{p.arch} with rope on {dims} of {config['head_dim']} dimensions is not supported")
    if "rope_freqs.weight" in rope:
        scaling = llama3_rope_scaling(rope["rope_freqs.weight"], config["rope_theta"],
                                      config["head_dim"])
    else:
        scaling = _rope_scaling(p)
    if scaling is not None:
        config["rope_scaling"] = scaling


def _llama(config: dict, p: _Kv, rope: Mapping[str, np.ndarray], names: set[str]) -> None:
    _rope(config, p, rope)
    if p.arch == "llama" and p.get("expert_count"):
        _mixtral(config, p, names)
        return
    config["attention_bias"] = any(n.endswith("attn_q.bias") for n in names)
    config["mlp_bias"] = any(n.endswith("ffn_up.bias") for n in names)


def _mixtral(config: dict, p: _Kv, names: set[str]) -> None:
    """A "llama" file with experts: Mixtral. Every layer a mixture; a token's experts weighted
    by the softmax of their router logits (mlx_lm's mixtral; llama.cpp's softmax over all
    experts then renormalised over the chosen is the same). No biases (mlx_lm's mixtral has
    none)."""
    experts, used = _mixture(config, p, names)
    if p.get("expert_shared_count") or float(p.get("expert_weights_scale", 0.0)) not in (0.0,
                                                                                       1.0):
        raise UnsupportedArchitecture("llama mixture with shared or scaled experts")
    if any(n.endswith(".bias") for n in names):
        raise UnsupportedArchitecture("llama mixture with biases")
    config.update({"model_type": "mixtral", "architectures": ["MixtralForCausalLM"],
                   "num_local_experts": experts, "num_experts_per_tok": used,
                   "intermediate_size": int(p.scalar("expert_feed_forward_length",
                                                     config["intermediate_size"]))})


def _qwen(config: dict, p: _Kv, rope: Mapping[str, np.ndarray], names: set[str]) -> None:
    _rope(config, p, rope)  # qwen2's q/k/v biases are fixed by the model, not the config


def _granite(config: dict, p: _Kv, rope: Mapping[str, np.ndarray], names: set[str]) -> None:
    _llama(config, p, rope, names)
    config["attention_multiplier"] = float(p.get("attention.scale", config["head_dim"] ** -0.5))
    config["embedding_multiplier"] = float(p.get("embedding_scale", 1.0))
    config["residual_multiplier"] = float(p.get("residual_scale", 1.0))
    config["logits_scaling"] = float(p.get("logit_scale", 1.0))


def _granitemoe(config: dict, p: _Kv, rope: Mapping[str, np.ndarray], names: set[str]) -> None:
    """Granite's multipliers, and every layer a mixture: a token's experts weighted by the
    softmax of their router logits (mlx_lm's granitemoe, llama.cpp's alike). Shared experts
    (granitemoeshared) have other tensors, refused by name."""
    _granite(config, p, rope, names)
    experts, used = _mixture(config, p, names)
    del config["mlp_bias"]  # (mlx_lm's granitemoe has no MLP biases)
    config.update({"num_local_experts": experts, "num_experts_per_tok": used,
                   "intermediate_size": int(p.scalar("expert_feed_forward_length",
                                                     config["intermediate_size"]))})


def _gemma_scalar(config: Mapping[str, Any], layers_27b: int) -> int:
    """query_pre_attn_scalar, which GGUF does not store: llama.cpp (and Google's reference)
    use hidden / heads for the 27B models (known by their layer count), else the head size.
    An int, as transformers' config (which loads the tokenizer) requires."""
    if config["num_hidden_layers"] == layers_27b:
        return int(config["hidden_size"]) // int(config["num_attention_heads"])
    return int(config["head_dim"])


def _gemma2(config: dict, p: _Kv, rope: Mapping[str, np.ndarray], names: set[str]) -> None:
    config["attn_logit_softcapping"] = float(p.get("attn_logit_softcapping", 50.0))
    config["final_logit_softcapping"] = float(p.get("final_logit_softcapping", 30.0))
    config["query_pre_attn_scalar"] = _gemma_scalar(config, 46)
    config["sliding_window"] = int(p.get("attention.sliding_window", 4096))


GEMMA3_PATTERN = 6  # llama.cpp hard-codes it for gemma3; Ollama may write it per layer


def _gemma3_pattern(p: _Kv, layers: int) -> int:
    value = p.get("attention.sliding_window_pattern", GEMMA3_PATTERN)
    if not isinstance(value, (list, tuple)):
        return int(value)
    # Ollama writes one bool per layer (true: sliding): every pattern-th layer is global.
    pattern = next((i + 1 for i, local in enumerate(value) if not local), len(value) + 1)
    if [(i + 1) % pattern != 0 for i in range(layers)] != [bool(v) for v in value]:
        raise UnsupportedArchitecture(f"gemma3 sliding window layers {value} are not periodic")
    return pattern


def _gemma3(config: dict, p: _Kv, rope: Mapping[str, np.ndarray], names: set[str]) -> None:
    if p.get("final_logit_softcapping"):
        raise UnsupportedArchitecture("gemma3 with final logit soft-capping is not supported")
    config["query_pre_attn_scalar"] = _gemma_scalar(config, 62)
    config["sliding_window"] = int(p.get("attention.sliding_window", 512))
    config["sliding_window_pattern"] = _gemma3_pattern(p, config["num_hidden_layers"])
    config["rope_local_base_freq"] = float(
        p.get("rope.freq_base_swa", p.get("rope.local.freq_base", 10000.0)))
    scaling = _rope_scaling(p)
    if scaling is not None:
        config["rope_scaling"] = scaling


def _gemma_embedding(config: dict, p: _Kv, rope: Mapping[str, np.ndarray],
                     names: set[str]) -> None:
    """gemma3's settings, attention both ways (runner/embed/bidirectional.py), and the
    sliding window as the model's own config.json gives it (both runtimes halve it)."""
    _gemma3(config, p, rope, names)
    config["use_bidirectional_attention"] = True
    config["max_position_embeddings"] = int(p.scalar("context_length", 2048))


def _phi3(config: dict, p: _Kv, rope: Mapping[str, np.ndarray], names: set[str]) -> None:
    dims = int(p.get("rope.dimension_count", config["head_dim"]))
    if dims != config["head_dim"]:
        config["partial_rotary_factor"] = dims / config["head_dim"]
    original = int(p.get("rope.scaling.original_context_length", config["max_position_embeddings"]))
    config["original_max_position_embeddings"] = original
    window = int(p.get("attention.sliding_window", 0))
    config["sliding_window"] = window or None
    long, short = rope.get("rope_factors_long.weight"), rope.get("rope_factors_short.weight")
    if long is not None:
        short = long if short is None else short
        config["rope_scaling"] = {"type": "longrope", "rope_type": "longrope",
                                  "long_factor": [float(x) for x in np.ravel(long)],
                                  "short_factor": [float(x) for x in np.ravel(short)]}
    elif (scaling := _rope_scaling(p)) is not None:
        if scaling["rope_type"] != "linear":
            raise UnsupportedArchitecture(
                f"phi3 rope scaling {scaling['rope_type']} is not supported")
        config["rope_scaling"] = {"type": "linear", "factor": scaling["factor"]}


def _mixture(config: Mapping[str, Any], p: _Kv, names: set[str]) -> tuple[int, int]:
    """(experts a layer, experts a token) of a file whose every layer is a mixture (a router,
    `ffn_gate_inp`, in each: checked where the tensor names are given)."""
    experts, used = int(p.scalar("expert_count")), int(p.scalar("expert_used_count"))
    if not 1 <= used <= experts:
        raise UnsupportedArchitecture(f"{p.arch} with {used} of {experts} experts a token")
    routed = {int(n.split(".")[1]) for n in names if ".ffn_gate_inp." in n}
    if names and routed != set(range(config["num_hidden_layers"])):
        raise UnsupportedArchitecture(f"{p.arch} mixture whose every layer is not a mixture")
    return experts, used


def _qwen3moe(config: dict, p: _Kv, rope: Mapping[str, np.ndarray], names: set[str]) -> None:
    """llama.cpp's qwen3moe: every layer a mixture (no shared expert), the chosen experts'
    weights renormalised to sum to 1 (mlx_lm's norm_topk_prob)."""
    _qwen(config, p, rope, names)
    experts, used = _mixture(config, p, names)
    if p.get("expert_shared_count") or p.get("expert_shared_feed_forward_length"):
        raise UnsupportedArchitecture("qwen3moe with shared experts")
    if float(p.get("expert_weights_scale", 0.0)) not in (0.0, 1.0):
        raise UnsupportedArchitecture("qwen3moe with expert_weights_scale "
                                      f"{p.get('expert_weights_scale')}")
    config.update({"num_experts": experts, "num_experts_per_tok": used,
                   "moe_intermediate_size": int(p.scalar("expert_feed_forward_length")),
                   "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True})


def _gpt_oss(config: dict, p: _Kv, rope: Mapping[str, np.ndarray], names: set[str]) -> None:
    """gpt-oss: every layer a mixture (softmax over the chosen experts' router logits, as
    mlx_lm and llama.cpp both do), sliding-window attention on every other layer from the
    first (llama.cpp's fixed pattern), YaRN rope (llama.cpp's default betas 32 and 1)."""
    experts, used = _mixture(config, p, names)
    layers = config["num_hidden_layers"]
    config.update({
        "num_local_experts": experts, "num_experts_per_tok": used,
        "intermediate_size": int(p.scalar("expert_feed_forward_length",
                                          config["intermediate_size"])),
        "sliding_window": int(p.get("attention.sliding_window", 128)),
        "layer_types": [("sliding_attention", "full_attention")[i % 2] for i in range(layers)],
    })
    scaling = _rope_scaling(p)
    if scaling is not None:
        if scaling["rope_type"] == "yarn":
            scaling = {"beta_fast": 32.0, "beta_slow": 1.0, **scaling}
        config["rope_scaling"] = scaling


def split_rows(arch: str, hf_name: str, config: Mapping[str, Any]) -> list[tuple[str, int]] | None:
    """A fused tensor mlx_lm holds as several: [(name, rows), ...] in row order (gpt-oss's
    `attn_qkv` -> q, k, v projections); None for every other tensor."""
    if spec(arch).model_type == gemma4.MODEL_TYPE:
        return gemma4.split_gate_up(hf_name, config)
    if spec(arch).model_type != "gpt_oss" or ".self_attn.qkv_proj." not in hf_name:
        return None
    kind = hf_name.rsplit(".", 1)[1]
    stem = hf_name.removesuffix(f".qkv_proj.{kind}")
    heads, kv_heads = int(config["num_attention_heads"]), int(config["num_key_value_heads"])
    head_dim = int(config["head_dim"])
    return [(f"{stem}.q_proj.{kind}", heads * head_dim),
            (f"{stem}.k_proj.{kind}", kv_heads * head_dim),
            (f"{stem}.v_proj.{kind}", kv_heads * head_dim)]


_EXTRA = {"llama": _llama, "qwen2": _qwen, "qwen3": _qwen, "gemma2": _gemma2,
          "gemma3": _gemma3, "gemma-embedding": _gemma_embedding, "phi3": _phi3,
          "granite": _granite, "granitemoe": _granitemoe, "qwen3moe": _qwen3moe,
          "gptoss": _gpt_oss, "gpt-oss": _gpt_oss}


# -- the inverse: config.json -> GGUF metadata, for writing GGUF files --------------------
def gguf_metadata(config: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """(architecture, metadata) as llama.cpp's converter writes them for this config: ints are
    GGUF uint32, floats float32, strings strings (tokenizer keys are not included). Tensors
    that carry settings come from `gguf_extra_tensors`."""
    s = spec_for_model_type(str(config.get("model_type")))
    if config.get("use_bidirectional_attention") and s.gguf == "gemma3":
        s = spec("gemma-embedding")  # EmbeddingGemma
    a = s.gguf
    heads = int(config["num_attention_heads"])
    hidden = int(config["hidden_size"])
    head_dim = int(config.get("head_dim") or hidden // heads)
    kv: dict[str, Any] = {
        "general.architecture": a,
        f"{a}.context_length": int(config.get("max_position_embeddings") or 4096),
        f"{a}.embedding_length": hidden,
        f"{a}.block_count": int(config["num_hidden_layers"]),
        f"{a}.feed_forward_length": int(config["intermediate_size"]),
        f"{a}.attention.head_count": heads,
        f"{a}.attention.head_count_kv": int(config.get("num_key_value_heads") or heads),
        f"{a}.attention.layer_norm_rms_epsilon": float(config["rms_norm_eps"]),
        f"{a}.rope.freq_base": float(config.get("rope_theta", _DEFAULT_ROPE_THETA.get(a, 10000.0))),
    }
    if not s.head_dim_derived:
        kv[f"{a}.attention.key_length"] = kv[f"{a}.attention.value_length"] = head_dim
    if a == gemma4.ARCH:
        gemma4.gguf_metadata(kv, a, config)
    else:
        _WRITE_EXTRA[a](kv, a, config, head_dim)
    return a, kv


def gguf_extra_tensors(config: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """The float32 tensors llama.cpp's converter adds for rope settings: `rope_freqs` for
    Llama 3 scaling, `rope_factors_long/short` for Phi-3's LongRoPE."""
    if config.get("model_type") == gemma4.MODEL_TYPE:
        return {"rope_freqs.weight": gemma4.rope_freqs(config)}
    scaling = config.get("rope_scaling") or {}
    kind = scaling.get("rope_type") or scaling.get("type")
    if kind == "llama3":
        heads = int(config["num_attention_heads"])
        dims = int(config.get("head_dim") or config["hidden_size"] // heads)
        return {"rope_freqs.weight": llama3_rope_factors(
            float(config.get("rope_theta", 10000.0)), dims, float(scaling.get("factor", 8.0)),
            float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0)),
            int(scaling.get("original_max_position_embeddings", 8192)))}
    if kind in ("longrope", "su"):
        return {"rope_factors_long.weight": np.asarray(scaling["long_factor"], np.float32),
                "rope_factors_short.weight": np.asarray(scaling["short_factor"], np.float32)}
    return {}


def _write_rope_scaling(kv: dict, a: str, config: Mapping[str, Any]) -> None:
    scaling = config.get("rope_scaling") or {}
    kind = scaling.get("rope_type") or scaling.get("type")
    if kind in (None, "default", "llama3", "longrope", "su"):
        return  # nothing, or tensors (gguf_extra_tensors)
    if kind not in ("linear", "yarn"):
        raise UnsupportedArchitecture(f'rope scaling "{kind}" has no GGUF form here')
    kv[f"{a}.rope.scaling.type"] = kind
    kv[f"{a}.rope.scaling.factor"] = float(scaling["factor"])
    if kind == "yarn":
        kv[f"{a}.rope.scaling.original_context_length"] = int(
            scaling["original_max_position_embeddings"])
        for key in ("beta_fast", "beta_slow"):
            if key in scaling:
                kv[f"{a}.rope.scaling.yarn_{key}"] = float(scaling[key])


def _write_llama(kv: dict, a: str, config: Mapping[str, Any], head_dim: int) -> None:
    kv[f"{a}.vocab_size"] = int(config["vocab_size"])
    kv[f"{a}.rope.dimension_count"] = head_dim
    if config.get("model_type") == "mixtral":  # as llama.cpp's converter writes Mixtral
        kv[f"{a}.expert_count"] = int(config["num_local_experts"])
        kv[f"{a}.expert_used_count"] = int(config["num_experts_per_tok"])
    _write_rope_scaling(kv, a, config)


def _write_plain(kv: dict, a: str, config: Mapping[str, Any], head_dim: int) -> None:
    _write_rope_scaling(kv, a, config)


def _write_granite(kv: dict, a: str, config: Mapping[str, Any], head_dim: int) -> None:
    _write_llama(kv, a, config, head_dim)
    kv[f"{a}.attention.scale"] = float(config["attention_multiplier"])
    kv[f"{a}.embedding_scale"] = float(config["embedding_multiplier"])
    kv[f"{a}.residual_scale"] = float(config["residual_multiplier"])
    kv[f"{a}.logit_scale"] = float(config["logits_scaling"])


def _write_granitemoe(kv: dict, a: str, config: Mapping[str, Any], head_dim: int) -> None:
    _write_granite(kv, a, config, head_dim)
    kv[f"{a}.expert_count"] = int(config["num_local_experts"])
    kv[f"{a}.expert_used_count"] = int(config["num_experts_per_tok"])


def _check_gemma_scalar(config: Mapping[str, Any], head_dim: int, layers_27b: int) -> None:
    full = {**config, "head_dim": head_dim}
    wanted = float(config.get("query_pre_attn_scalar", head_dim))
    if not math.isclose(wanted, _gemma_scalar(full, layers_27b)):
        raise UnsupportedArchitecture(
            f"query_pre_attn_scalar {wanted} cannot be stored in GGUF for this shape "
            f"(llama.cpp derives {_gemma_scalar(full, layers_27b)})")


def _write_gemma2(kv: dict, a: str, config: Mapping[str, Any], head_dim: int) -> None:
    _check_gemma_scalar(config, head_dim, 46)
    kv[f"{a}.attn_logit_softcapping"] = float(config.get("attn_logit_softcapping", 50.0))
    kv[f"{a}.final_logit_softcapping"] = float(config.get("final_logit_softcapping", 30.0))
    kv[f"{a}.attention.sliding_window"] = int(config.get("sliding_window", 4096))


def _write_gemma3(kv: dict, a: str, config: Mapping[str, Any], head_dim: int) -> None:
    _check_gemma_scalar(config, head_dim, 62)
    kv[f"{a}.attention.sliding_window"] = int(config.get("sliding_window", 512))
    pattern = int(config.get("sliding_window_pattern", GEMMA3_PATTERN))
    if pattern != GEMMA3_PATTERN:
        kv[f"{a}.attention.sliding_window_pattern"] = pattern
    local_base = float(config.get("rope_local_base_freq", 10000.0))
    if local_base != 10000.0:
        kv[f"{a}.rope.freq_base_swa"] = local_base
    _write_rope_scaling(kv, a, config)


def _write_phi3(kv: dict, a: str, config: Mapping[str, Any], head_dim: int) -> None:
    dims = int(float(config.get("partial_rotary_factor", 1.0)) * head_dim)
    kv[f"{a}.rope.dimension_count"] = dims
    kv[f"{a}.rope.scaling.original_context_length"] = int(
        config.get("original_max_position_embeddings") or kv[f"{a}.context_length"])
    kv[f"{a}.attention.sliding_window"] = int(config.get("sliding_window") or 0)
    scaling = config.get("rope_scaling") or {}
    if (scaling.get("rope_type") or scaling.get("type")) in ("longrope", "su"):
        scale = kv[f"{a}.context_length"] / kv[f"{a}.rope.scaling.original_context_length"]
        kv[f"{a}.rope.scaling.attn_factor"] = math.sqrt(
            1 + math.log(scale) / math.log(kv[f"{a}.rope.scaling.original_context_length"])
        ) if scale > 1 else 1.0
    else:
        _write_rope_scaling(kv, a, config)


def _write_qwen3moe(kv: dict, a: str, config: Mapping[str, Any], head_dim: int) -> None:
    if config.get("mlp_only_layers") or int(config.get("decoder_sparse_step", 1)) != 1:
        raise UnsupportedArchitecture("qwen3_moe with dense layers has no GGUF form here")
    if not config.get("norm_topk_prob", False):
        raise UnsupportedArchitecture("qwen3_moe without norm_topk_prob: llama.cpp's "
                                      "qwen3moe always renormalises the experts' weights")
    kv[f"{a}.expert_count"] = int(config["num_experts"])
    kv[f"{a}.expert_used_count"] = int(config["num_experts_per_tok"])
    kv[f"{a}.expert_feed_forward_length"] = int(config["moe_intermediate_size"])
    _write_rope_scaling(kv, a, config)


def _write_gpt_oss(kv: dict, a: str, config: Mapping[str, Any], head_dim: int) -> None:
    layers = int(config["num_hidden_layers"])
    wanted = [("sliding_attention", "full_attention")[i % 2] for i in range(layers)]
    if config.get("layer_types", wanted) != wanted:
        raise UnsupportedArchitecture("gpt_oss with other layer types than llama.cpp's "
                                      "alternating pattern has no GGUF form here")
    kv[f"{a}.expert_count"] = int(config["num_local_experts"])
    kv[f"{a}.expert_used_count"] = int(config["num_experts_per_tok"])
    kv[f"{a}.expert_feed_forward_length"] = int(config["intermediate_size"])
    kv[f"{a}.attention.sliding_window"] = int(config["sliding_window"])
    _write_rope_scaling(kv, a, config)


_WRITE_EXTRA = {"llama": _write_llama, "qwen2": _write_plain, "qwen3": _write_plain,
                "gemma2": _write_gemma2, "gemma3": _write_gemma3,
                "gemma-embedding": _write_gemma3, "phi3": _write_phi3,
                "granite": _write_granite, "granitemoe": _write_granitemoe,
                "qwen3moe": _write_qwen3moe,
                "gpt-oss": _write_gpt_oss}
