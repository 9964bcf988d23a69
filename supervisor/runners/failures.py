"""Crash loops: a model whose runner keeps failing to load is not spawned again on every
request.

Invariants:
- Failures are counted per model name, in a row: a successful load or `clear` (unload) forgets
  them, and a failure of a different digest (the model was re-created or re-pulled) starts
  the count again at 1.
- Once `max_failures` loads in a row have failed, `check` refuses the model at once with the
  last error's text, until its digest changes, it is cleared, or `cooldown_s` has passed
  since the last failure; then one load is let through, and if it fails too the model is
  refused for another cool-down. `max_failures` <= 0 turns this off; a negative `cooldown_s`
  waits for a change or an unload only.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

from mlxr.shared.errors import MlxrError, RunnerFailed

log = logging.getLogger("mlxr.manager")


class Clock(Protocol):
    def now(self) -> float: ...


@dataclass(slots=True)
class Failure:
    """A model's failed loads in a row, and the last one's error."""
    count: int
    error: MlxrError
    digest: str
    at: float  # clock time of the last failure


class LoadFailures:
    def __init__(self, max_failures: int, cooldown_s: float, clock: Clock):
        self.max_failures = max_failures
        self.cooldown_s = cooldown_s
        self._clock = clock
        self._failures: dict[str, Failure] = {}

    def get(self, name: str) -> Failure | None:
        return self._failures.get(name)

    def clear(self, name: str) -> None:
        self._failures.pop(name, None)

    def record(self, name: str, digest: str, error: MlxrError) -> Failure:
        last = self._failures.get(name)
        count = last.count + 1 if last is not None and last.digest == digest else 1
        failure = self._failures[name] = Failure(count, error, digest, self._clock.now())
        if self.max_failures > 0 and count == self.max_failures:
            log.error("%s failed to load %d times in a row; refusing it until it changes, is "
                      "unloaded, or %gs pass", name, count, self.cooldown_s)
        return failure

    def check(self, name: str, digest: str) -> None:
        """Raise RunnerFailed, at once, for a model in a crash loop; else return."""
        failure = self._failures.get(name)
        if failure is None or self.max_failures <= 0 or failure.count < self.max_failures:
            return
        if failure.digest != digest:  # re-created or re-pulled: try it afresh
            del self._failures[name]
            return
        left = failure.at + self.cooldown_s - self._clock.now()
        if self.cooldown_s >= 0 and left <= 0:
            return  # one more try
        when = (f"it is tried again in {left:.0f}s, or once it is unloaded or changes"
                if self.cooldown_s >= 0 else "it is tried again once it is unloaded or changes")
        raise RunnerFailed(f"{name} failed to load {failure.count} times in a row and is not "
                           f"loaded again now ({when}); last error: {failure.error.message}")
