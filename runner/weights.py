"""Float32 weights on a CPU: a bfloat16, float16 or quantized model is widened to float32 at
load when it runs on the CPU and the wider copy fits in memory.

Why: MLX's CPU float32 matmul goes to BLAS, the others do not. On the 2-core EPYC
(docs/PERFORMANCE.md, "Float32 weights on a CPU") a 16 x 1024 @ 1024 x 3072 product takes
1.7 ms in float32, 30 ms in bfloat16 and 50 ms 4-bit; one row, 1.4 against 4.5 and 3.6 ms.
The price is memory: 2x a 16-bit model, about 7x a 4-bit one, and float32 KV rows.

Invariants:
- Only the default device's type decides "on the CPU"; a GPU (Metal, CUDA) keeps the weights
  as they are stored, whatever the setting.
- "auto" widens only when the extra bytes, plus the KV budget the runner was given, fit in
  FREE_SHARE of the memory available now. Otherwise the model is served as stored.
- Except: where the runner's numpy body may serve the model ("auto", one rank, a text model)
  and the quantized kernel builds (runner/quant_kernel.py), the 4- and 8-bit layers stay as
  stored, for the kernel, and only the rest is widened (`widen_around_kernel`): the decode
  step then reads a quarter (8-bit) or an eighth (4-bit) of the float32 bytes. (Where the
  body does not take the architecture, each such layer computes on the kernel instead:
  runner/kernel_layers.py, installed by the loader.) 2-, 3-, 5-
  and 6-bit layers are held in 4 or 8 bits for it (runner/repack.py), exactly. That too
  only where the bytes it adds (`kernel_extra_bytes`) and the KV budget fit FREE_SHARE of
  the memory available. "on" still widens everything.
- Whatever the setting, a mixture of experts' float layers are float32 on the CPU
  (`widen_experts`): MLX's CPU expert product takes no other type.
- Widening is exact for the stored values: a quantized layer becomes `mx.dequantize` of its
  arrays (mlx-lm's own `dequantize_model`), a 16-bit array its float32 image. Only the
  arithmetic after that is wider.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

log = logging.getLogger("mlxr.runner")

MODES = ("auto", "on", "off")
ON_KERNEL = " on the quantized kernel"  # the status's words for widen_around_kernel's models
EXPERTS_WIDE = ", experts in float32"  # and for a model only widen_experts widened
FREE_SHARE = 0.75  # of psutil's available memory, for the extra weight bytes plus the KV budget


@dataclass(frozen=True, slots=True)
class Footprint:
    """A model's weight bytes as stored and as float32, and what it is stored as."""
    stored_bytes: int
    float32_bytes: int
    stored_as: str  # "float32", "bfloat16", "float16", "4-bit", "8-bit", or a mix "a+b"

    @property
    def extra_bytes(self) -> int:
        return max(self.float32_bytes - self.stored_bytes, 0)


def decide(mode: str, on_cpu: bool, footprint: Footprint, available: int,
           kv_budget: int) -> tuple[bool, str]:
    """Whether to widen, and why (for the log)."""
    if mode not in MODES:
        raise ValueError(f"float32_weights must be one of {', '.join(MODES)}, not {mode!r}")
    if footprint.stored_as == "float32":
        return False, "stored as float32"
    if mode == "off":
        return False, "float32_weights is off"
    if not on_cpu:
        return False, "not on the CPU"
    if mode == "on":
        return True, "float32_weights is on"
    need = footprint.extra_bytes + kv_budget
    if need > available * FREE_SHARE:
        return False, (f"float32 needs {footprint.extra_bytes / 2**30:.2f} GiB more, and "
                       f"{available / 2**30:.2f} GiB is available")
    return True, "on the CPU, where float32 matmuls use BLAS"


def _quantized(model) -> list[tuple]:
    """(module, bits, [its packed weight, scales, biases]) for each quantized layer of
    `model`."""
    import mlx.core as mx

    out = []
    for _, module in model.named_modules():
        bits = getattr(module, "bits", None)
        if bits is None or not isinstance(getattr(module, "scales", None), mx.array):
            continue
        arrays = [a for a in (getattr(module, n, None) for n in ("weight", "scales", "biases"))
                  if isinstance(a, mx.array)]
        out.append((module, bits, arrays))
    return out


def _ids(layers: list[tuple]) -> set[int]:
    """The ids of those layers' arrays (the parameters not to count again)."""
    return {id(a) for _, _, arrays in layers for a in arrays}


def _float32_bytes(weight, bits: int) -> int:
    """A packed `bits`-bit weight's bytes once dequantized to float32."""
    return weight.size // weight.shape[-1] * (weight.shape[-1] * 32 // bits) * 4


def footprint(model) -> Footprint:
    """Measure `model` (an mlx.nn.Module) without evaluating anything."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    stored = wide = 0
    kinds: set[str] = set()
    layers = _quantized(model)
    quantized_arrays = _ids(layers)
    for module, bits, arrays in layers:
        wide += _float32_bytes(module.weight, bits)
        kinds.add(f"{bits}-bit")
        stored += sum(a.nbytes for a in arrays)
    for _, array in tree_flatten(model.parameters()):
        if id(array) in quantized_arrays:
            continue
        stored += array.nbytes
        if mx.issubdtype(array.dtype, mx.floating):
            wide += array.size * 4
            kinds.add(str(array.dtype).removeprefix("mlx.core."))
        else:
            wide += array.nbytes
    if any(k.endswith("-bit") for k in kinds):
        kinds.discard("float32")  # a quantized model's norms and biases
    return Footprint(stored, wide, "+".join(sorted(kinds)) or "float32")


def widen(model) -> None:
    """Make every weight of `model` float32, in place, and evaluate it (so the stored arrays
    are freed now, not at the first request)."""
    import mlx.core as mx
    from mlx_lm.utils import dequantize_model

    dequantize_model(model)
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())


def widen_experts(model) -> int:
    """Make the float weights of `model`'s mixture-of-experts layers (mlx_lm's SwitchLinear)
    float32, in place: MLX's CPU expert product (GatherMM) takes float32 only, so a bfloat16
    mixture served as stored failed at its first token. Returns the layers widened."""
    import mlx.core as mx
    from mlx_lm.models.switch_layers import SwitchLinear

    widened = 0
    for _, module in model.named_modules():
        if isinstance(module, SwitchLinear) and module.weight.dtype != mx.float32:
            module.set_dtype(mx.float32)
            mx.eval(module.parameters())
            widened += 1
    return widened


def kernel_layers(model) -> list[str]:
    """The names of `model`'s quantized layers whose layout the quantized kernel takes
    (runner/quant_kernel.py), as stored or repacked (runner/repack.py)."""
    from mlxr.runner.quant_kernel import takes, takes_stacked
    from mlxr.runner.repack import repackable

    return [name for name, module in model.named_modules()
            if takes(module) or takes_stacked(module) or repackable(module)
            or _mxfp4_experts(module)]


def _mxfp4_experts(module) -> bool:
    """gpt-oss's experts in MLX's mxfp4 format, for runner/mxfp4_kernel.py (where it builds)."""
    from mlxr.runner.mxfp4_kernel import Mxfp4Kernel, takes

    return takes(module) and Mxfp4Kernel.load() is not None


def kernel_extra_bytes(model) -> int:
    """The bytes `widen_around_kernel` adds to `model`: float32 scales and biases of the
    layers the kernel takes, the wider fields of those it repacks, and float32 copies of
    every other weight. Measured without evaluating anything."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from mlxr.runner.quant_kernel import takes, takes_stacked
    from mlxr.runner.repack import WIDER, repackable

    extra = 0
    layers = _quantized(model)
    seen = _ids(layers)
    for module, bits, arrays in layers:
        if _mxfp4_experts(module):
            continue  # kept as they are: codes and exponent bytes
        if takes(module) or takes_stacked(module) or repackable(module):
            extra += sum(a.size * 4 - a.nbytes for a in arrays[1:])
            if repackable(module):
                extra += module.weight.nbytes * (WIDER[bits] - bits) // bits
        else:
            extra += _float32_bytes(module.weight, bits) - sum(a.nbytes for a in arrays)
    for _, array in tree_flatten(model.parameters()):
        if id(array) not in seen and mx.issubdtype(array.dtype, mx.floating):
            extra += array.size * 4 - array.nbytes
    return extra


def widen_around_kernel(model) -> int:
    """Make every weight of `model` float32 except the quantized layers the kernel takes,
    which keep their packed values (their scales and biases become float32; mxfp4 experts
    keep their exponent bytes), and evaluate it. 2-, 3-, 5- and 6-bit layers are repacked
    into 4 or 8 bits for it (runner/repack.py); other quantized layers (other modes, group
    sizes) are dequantized. Returns the number of layers repacked."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_unflatten

    from mlxr.runner.quant_kernel import QuantKernel, takes
    from mlxr.runner.repack import repack, repackable

    kernel = QuantKernel.load()
    plain, repacked = [], 0
    for name, module in model.named_modules():
        if kernel is not None and repackable(module):
            repack(module, kernel)
            repacked += 1
        if takes(module):
            continue
        if isinstance(module, nn.QuantizedLinear):
            weight = mx.dequantize(module.weight, module.scales, module.biases,
                                   module.group_size, module.bits, mode=module.mode)
            linear = nn.Linear(weight.shape[1], weight.shape[0], bias="bias" in module)
            linear.weight = weight
            if "bias" in module:
                linear.bias = module.bias
            plain.append((name, linear))
        elif isinstance(module, nn.QuantizedEmbedding):
            weight = mx.dequantize(module.weight, module.scales, module.biases,
                                   module.group_size, module.bits, mode=module.mode)
            embedding = nn.Embedding(weight.shape[0], weight.shape[1])
            embedding.weight = weight
            plain.append((name, embedding))
    if plain:
        model.update_modules(tree_unflatten(plain))
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return repacked


def float32_on_cpu(model, mode: str, kv_budget: int, available: int,
                   agree: Callable[[bool], bool] | None = None,
                   host_kernel: bool = False) -> str:
    """Apply the setting to a loaded model; returns what its weights are now, for the status
    ("float32 from bfloat16", "8-bit on the quantized kernel", or what they were stored as).
    `agree`, for the ranks of a distributed runner: this rank's decision in, the group's out
    (every rank must hold the same dtype, and each one decided on its own host's free
    memory). `host_kernel`: the runner's numpy body may serve this model (a text model on one
    rank), so quantized layers may stay as stored for the quantized kernel."""
    import mlx.core as mx

    fp = footprint(model)
    on_cpu = mx.default_device().type == mx.DeviceType.cpu
    if host_kernel and on_cpu and mode == "auto" and agree is None and kernel_layers(model) \
            and kv_budget + kernel_extra_bytes(model) <= available * FREE_SHARE:
        from mlxr.runner.quant_kernel import QuantKernel

        if QuantKernel.load() is not None:
            repacked = widen_around_kernel(model)
            log.info("weights: %s as stored for the quantized kernel, float32 elsewhere%s",
                     fp.stored_as, f" ({repacked} layers of 2, 3, 5 or 6 bits held in 4 or 8)"
                     if repacked else "")
            return f"{fp.stored_as}{ON_KERNEL}"
    wide, why = decide(mode, on_cpu, fp, available, kv_budget)
    if agree is not None and agree(wide) != wide:
        wide, why = False, "another rank keeps the stored weights"
    if not wide:
        experts = widen_experts(model) if on_cpu else 0
        log.info("weights: %s as stored (%s)%s", fp.stored_as, why,
                 f"; {experts} layers of experts in float32" if experts else "")
        return fp.stored_as + (EXPERTS_WIDE if experts else "")
    widen(model)
    log.info("weights: float32, widened from %s (%s): %.2f GiB, %.2f stored", fp.stored_as,
             why, fp.float32_bytes / 2**30, fp.stored_bytes / 2**30)
    return f"float32 from {fp.stored_as}"
