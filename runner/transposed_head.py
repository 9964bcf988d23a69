"""The decode head against a (hidden, vocab) copy of its weight, where that is faster.

`nn.Linear` computes `x @ W.T` with W stored (vocab, hidden), which MLX's CPU backend hands
to `cblas_sgemm` as a transposed operand. On an AMD EPYC (Zen 3, OpenBLAS 0.3.21) the same
product against a contiguous transposed copy took 12 ms instead of 15.5 ms for 16 rows and
15 ms instead of 20 ms for 4-8 rows (docs/PERFORMANCE.md): packing a transposed operand costs
OpenBLAS more. Whether it pays depends on the CPU and the library, so the runner times both
on its own weight at load and keeps the copy only where it wins by at least 10%.

Used only on the CPU with a plain float32 head (as runner/host_head.py), and only when the
copy gives the model head's logits on a probe. It costs one more copy of the head weight.
"""

from __future__ import annotations

import logging
from typing import Callable

import mlx.core as mx

from mlxr.runner import probe_verdicts
from mlxr.runner.host_head import cpu_head_weight, matches, median_ms

log = logging.getLogger("mlxr.runner")

MIN_GAIN = 0.10
_PROBE_ROWS = 8


class TransposedHead:
    def __init__(self, weight: mx.array):
        self.weight_t = mx.contiguous(weight.T)
        mx.eval(self.weight_t)

    @classmethod
    def find(cls, model, mlx_head: Callable[[mx.array], mx.array] | None,
             ) -> "TransposedHead | None":
        weight = cpu_head_weight(model, mlx_head)
        if weight is None:
            return None
        made: list[TransposedHead] = []

        def pays() -> bool:
            made.append(cls(weight))
            if not matches(made[0], mlx_head, _PROBE_ROWS, weight.shape[1], "transposed"):
                return False
            probe = mx.random.normal((_PROBE_ROWS, weight.shape[1]), key=mx.random.key(1))
            ours, theirs = median_ms(made[0], probe), median_ms(mlx_head, probe)
            log.info("decode head: transposed weight %.1f ms, as stored %.1f ms (%d rows)",
                     ours, theirs, _PROBE_ROWS)
            return ours <= theirs * (1 - MIN_GAIN)

        if not probe_verdicts.decide("transposed_head", pays):
            return None
        return made[0] if made else cls(weight)

    def __call__(self, hidden: mx.array) -> mx.array:
        return hidden @ self.weight_t
