"""The prefill cost model the scheduler sizes throttled chunks with. Imports no mlx.

Invariants:
- `chunk_for` answers None until a decode step and a prefill have been measured, so the
  scheduler keeps its configured chunk until then.
- `prefill_fixed_s` is never negative, and is non-zero only while `prefill_token_s` is a
  fitted (positive) slope; a per-token average always comes with a fixed part of 0.
"""

from __future__ import annotations

from collections import deque


class StepTimer:
    """Running estimates of a decode step's time and of a prefill chunk's cost, from the
    engine's measurements.

    A chunk costs a fixed part (its own forward pass: about 9 ms on the 30M model, whatever its
    length) plus a part per token. Dividing a chunk's whole cost by its tokens makes small
    chunks look dear per token, so the next chunk is sized smaller still, down to the minimum
    (a 2,000-token prompt was read 16 tokens a step). So single-chunk steps are fitted as
    fixed + per-token over the last `window` of them when their sizes differ enough; while
    they do not, a fit keeps its slope and its fixed part follows the measurements. Before
    any fit, and for steps with several chunks, the estimate is per token (a moving average)."""

    def __init__(self, weight: float = 0.3, window: int = 12):
        self.weight = weight
        self.decode_s: float | None = None
        self.prefill_token_s: float | None = None
        self.prefill_fixed_s = 0.0
        self._chunks: deque[tuple[int, float]] = deque(maxlen=window)

    def _blend(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.weight * (new - old)

    def observe(self, num_decode: int, num_prefill: int, elapsed_s: float,
                num_chunks: int = 1) -> None:
        if num_decode and not num_prefill:
            self.decode_s = self._blend(self.decode_s, elapsed_s)
        elif num_prefill:
            decode_part = (self.decode_s or 0.0) if num_decode else 0.0
            extra = max(elapsed_s - decode_part, 0.0)
            if num_chunks == 1:
                self._chunks.append((num_prefill, extra))
                if self._fit():
                    return
                if self.prefill_fixed_s and self.prefill_token_s:
                    # Too little spread to refit: keep the slope, move the fixed part.
                    residual = extra - self.prefill_token_s * num_prefill
                    self.prefill_fixed_s = max(self._blend(self.prefill_fixed_s, residual), 0.0)
                    return
            self.prefill_token_s = self._blend(self.prefill_token_s, extra / num_prefill)
            self.prefill_fixed_s = 0.0

    def _fit(self) -> bool:
        """Least squares of cost on tokens over the recent single-chunk steps; False (keep
        the per-token average) unless it gives a positive slope and no negative fixed part."""
        sizes = [n for n, _ in self._chunks]
        if len(sizes) < 4 or max(sizes) < 1.5 * min(sizes):
            return False
        mean_n = sum(sizes) / len(sizes)
        mean_t = sum(t for _, t in self._chunks) / len(sizes)
        var = sum((n - mean_n) ** 2 for n in sizes)
        slope = sum((n - mean_n) * (t - mean_t) for n, t in self._chunks) / var
        fixed = mean_t - slope * mean_n
        if slope <= 0 or fixed < 0:
            return False
        self.prefill_token_s, self.prefill_fixed_s = slope, fixed
        return True

    def chunk_for(self, extra_s: float) -> int | None:
        """Prefill tokens that fit in `extra_s`, or None before there are measurements."""
        if not self.decode_s or not self.prefill_token_s:
            return None
        return int(max(extra_s - self.prefill_fixed_s, 0.0) / self.prefill_token_s)
