"""The prefill cost model the scheduler sizes throttled chunks with. Imports no mlx (numpy for
the least squares).

Invariants:
- `chunk_for` answers None until a decode step and a prefill have been measured, so the
  scheduler keeps its configured chunk until then.
- `prefill_fixed_s` is never negative, and is non-zero only while `prefill_token_s` is a
  fitted (positive) slope; a per-token average always comes with a fixed part of 0.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from typing import Callable

import numpy as np


class StepTimer:
    """Running estimates of a decode step's time and of a prefill chunk's cost, from the
    engine's measurements.

    A chunk costs a fixed part (its own forward pass: about 9 ms on the 30M model, whatever its
    length) plus a part per token. Dividing a chunk's whole cost by its tokens makes small
    chunks look dear per token, so the next chunk is sized smaller still, down to the minimum
    (a 2,000-token prompt was read 16 tokens a step). So single-chunk steps are fitted as
    fixed + per-token over the last `window` of them when their sizes differ enough; while
    they do not, a fit keeps its slope and its fixed part follows the measurements. Before
    any fit, and for steps with several chunks, the estimate is per token (a moving average).

    A chunk's tokens also attend over the context before them, which costs per token in
    proportion to that context (at 8,000 positions the 30M model's softmax outweighs the rest
    of the step). Fitted on size alone, chunks read at growing contexts gave a slope near 0
    and a large fixed part, and a budget just above that fixed part bought 140-token chunks
    that took 0.6 s. So the fit is fixed + n x (per token + per token-and-position x the
    chunk's mean position) where the chunks' positions differ enough; `context_token_s` is
    that last term.

    A decode step's time is the median of the last `decode_window` decode-only steps, not a
    moving average: on a shared 2-core machine single steps took 11-47 ms around a median of
    21, and an average caught at a slow one (27 ms) let every chunk of a long prompt add 20 ms
    to its step, so the streams waited 2.2 of their median intervals instead of 1.75.
    (docs/PERFORMANCE.md, "The prefill stall (session 10)".)

    It is kept per number of decoding rows (`decode_for`): one median for all made a step of
    3 rows and a chunk look like 7 ms (a 1-row step measured long before) plus a chunk of
    1 ms a token, and under a steady stream of prompts, where no step decodes alone, neither
    was ever corrected (docs/PERFORMANCE.md, "Prompts queued behind a throttle"). A row count
    with no median is read off the nearest ones; `decode_age_s` says how old a count's last
    measurement is, so that the scheduler can measure it again."""

    TRUSTED = 3  # decode steps of one row count before their median stands alone

    def __init__(self, weight: float = 0.3, window: int = 12, decode_window: int = 15,
                 clock: Callable[[], float] = time.monotonic):
        self.weight = weight
        self.decode_window = decode_window
        self._clock = clock
        self._decodes: dict[int, deque[float]] = {}  # rows -> recent decode-only steps
        self._medians: dict[int, float] = {}
        self._measured_at: dict[int, float] = {}
        self.prefill_token_s: float | None = None
        self.prefill_fixed_s = 0.0
        self.context_token_s = 0.0  # per token per position of context before it
        self._chunks: deque[tuple[int, int, float]] = deque(maxlen=window)

    def _blend(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.weight * (new - old)

    def observe(self, num_decode: int, num_prefill: int, elapsed_s: float,
                num_chunks: int = 1, context: int = 0) -> None:
        """`context`: where a single chunk started (the positions it attends over before
        its own)."""
        if num_decode and not num_prefill:
            times = self._decodes.setdefault(num_decode, deque(maxlen=self.decode_window))
            times.append(elapsed_s)
            self._medians[num_decode] = statistics.median(times)  # numpy's: ~0.5 ms a step
            self._measured_at[num_decode] = self._clock()
        elif num_prefill:
            decode_part = (self.decode_for(num_decode) or 0.0) if num_decode else 0.0
            extra = max(elapsed_s - decode_part, 0.0)
            if num_chunks == 1:
                self._chunks.append((num_prefill, context, extra))
                if self._fit():
                    return
                if self.prefill_fixed_s and self.prefill_token_s:
                    # Too little spread to refit: keep the slope, move the fixed part.
                    residual = extra - num_prefill * (
                        self.prefill_token_s + self.context_token_s * (context + num_prefill / 2))
                    self.prefill_fixed_s = max(self._blend(self.prefill_fixed_s, residual), 0.0)
                    return
            self.prefill_token_s = self._blend(self.prefill_token_s, extra / num_prefill)
            self.prefill_fixed_s = self.context_token_s = 0.0

    def _fit(self) -> bool:
        """Least squares of cost on tokens (and tokens x mean position, where positions
        differ enough) over the recent single-chunk steps; False (keep the per-token average)
        unless it gives a positive cost per token and no negative part."""
        sizes = [n for n, _, _ in self._chunks]
        if len(sizes) < 4:
            return False
        positions = [c + n / 2 for n, c, _ in self._chunks]
        costs = np.array([t for _, _, t in self._chunks])
        spread_n = max(sizes) >= 1.5 * min(sizes)
        spread_c = max(positions) >= 1.5 * min(positions) + 64
        columns = [np.ones(len(sizes))]
        if spread_n:
            columns.append(np.array(sizes, dtype=float))
        if spread_c:
            columns.append(np.array([n * p for n, p in zip(sizes, positions)]))
        if len(columns) == 1:
            return False
        solution, *_ = np.linalg.lstsq(np.stack(columns, axis=1), costs, rcond=None)
        fixed = float(solution[0])
        per_token = float(solution[1]) if spread_n else 0.0
        per_position = float(solution[-1]) if spread_c else 0.0
        if not spread_n:  # fixed and per-token parts cannot be told apart: count it per token
            per_token, fixed = fixed / sizes[-1], 0.0
        if fixed < 0 or per_token < 0 or per_position < 0 or per_token + per_position <= 0:
            return False
        self.prefill_fixed_s, self.prefill_token_s = fixed, per_token
        self.context_token_s = per_position
        return True

    def decode_for(self, rows: int) -> float | None:
        """A decode-only step's time for `rows` rows (None before any decode step): the
        median of their recent steps once there are `TRUSTED` of them; before that, the
        median of those few and the value read off the other row counts (`_read_off`) as
        many times as they fall short, so that one slow step (a probe taken while the machine
        was busy) does not set the step's budget alone."""
        samples = self._decodes.get(rows, ())
        if len(samples) >= self.TRUSTED:
            return self._medians[rows]
        prior = self._read_off(rows)
        if prior is None:
            return self._medians.get(rows)
        return statistics.median([*samples] + [prior] * (self.TRUSTED - len(samples)))

    def _read_off(self, rows: int) -> float | None:
        """A step of `rows` rows from the medians of the other row counts: on the line
        through the nearest count on either side, else through the two nearest on one side,
        else the nearest one's. The line never falls with more rows."""
        known = {r: m for r, m in self._medians.items() if r != rows}
        if not known:
            return None
        below = sorted(r for r in known if r < rows)
        above = sorted(r for r in known if r > rows)
        if below and above:
            r0, r1 = below[-1], above[0]
        else:
            side = below[-2:] if below else above[:2]
            if len(side) == 1:
                return known[side[0]]
            r0, r1 = side
        slope = max(known[r1] - known[r0], 0.0) / (r1 - r0)
        near = r0 if abs(rows - r0) <= abs(rows - r1) else r1
        return max(known[near] + slope * (rows - near), 0.2 * known[near])

    def decode_age_s(self, rows: int) -> float:
        """Seconds since a decode-only step of `rows` rows was measured (inf if never)."""
        at = self._measured_at.get(rows)
        return math.inf if at is None else self._clock() - at

    def chunk_for(self, extra_s: float, context: int = 0) -> int | None:
        """Prefill tokens that fit in `extra_s` for a chunk starting at position `context`,
        or None before there are measurements."""
        if not self._medians or not (self.prefill_token_s or self.context_token_s):
            return None
        room = max(extra_s - self.prefill_fixed_s, 0.0)
        linear = self.prefill_token_s + self.context_token_s * context
        half = self.context_token_s / 2  # the chunk's own tokens attend over each other too
        if half <= 0:
            return int(room / linear)
        return int((-linear + (linear * linear + 4 * half * room) ** 0.5) / (2 * half))
