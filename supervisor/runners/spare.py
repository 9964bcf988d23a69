"""One runner process started before any model asks for it: `python -m mlxr.runner --spare`.

Half of a small model's load was the runner's own start: Python, then MLX, mlx-lm and
transformers imported (1.5-2.5 s of 4-6 s on the 2-core EPYC). A spare has done that already
and waits for its settings on stdin; a load takes it instead of starting a process
(docs/PERFORMANCE.md, "Loads", session 32).

Invariants:
- At most one spare at a time. It is made when the server starts and again after each load
  that took it has finished, so it never competes with a load for the CPU.
- A spare is taken only with the BLAS it was started with (its environment's preload): a load
  whose choice differs starts its own process, as before.
- A spare that died before it was taken is never handed out; after SPARE_FAILURES deaths in
  a row no more are made (the log says why), and loads start their own processes.
- `close` ends the spare (SIGTERM); a spare also exits when its stdin closes, and on Linux when the
  supervisor dies (PR_SET_PDEATHSIG), as every runner does.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import sys
from dataclasses import dataclass, field

from mlxr.shared.config import Settings

log = logging.getLogger("mlxr.runner")

SPARE_FAILURES = 3
RUNNER_MODULE = "mlxr.runner"  # only the real runner takes --spare (tests may swap the module)


@dataclass(eq=False)
class Spare:
    process: asyncio.subprocess.Process
    blas: str | None
    # What it wrote before it was taken (read so the pipe never fills): the runner's client
    # starts its own tail from these lines.
    tail: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=40))
    reader: asyncio.Task | None = None

    async def read_output(self) -> None:
        assert self.process.stdout is not None
        async for raw in self.process.stdout:
            self.tail.append(raw.decode(errors="replace").rstrip())


class SpareRunner:
    """Keeps one spare runner; `spawn` (supervisor/runners/client.py's process start, with
    the runner's environment) is how it starts one."""

    def __init__(self, settings: Settings, spawn):
        self.enabled = settings.spare_runner and settings.runner_module == RUNNER_MODULE
        self._spawn = spawn  # async (blas) -> asyncio.subprocess.Process
        self._spare: Spare | None = None
        self._making: asyncio.Task | None = None
        self._failures = 0
        self._closed = False

    def replenish(self, blas: str | None) -> None:
        """Start a spare with `blas` preloaded unless one is alive or on its way."""
        if not self.enabled or self._closed or self._making is not None:
            return
        if self._spare is not None and self._spare.process.returncode is None:
            return
        self._making = asyncio.create_task(self._make(blas))

    async def _make(self, blas: str | None) -> None:
        try:
            process = await self._spawn(blas)
        except (OSError, ValueError) as exc:
            self._failed(f"could not start a spare runner: {exc}")
            return
        finally:
            self._making = None
        spare = Spare(process, blas)
        spare.reader = asyncio.create_task(spare.read_output())
        if self._closed:
            await _end(spare)
            return
        self._spare = spare
        log.debug("spare runner pid %d started", process.pid)

    def take(self, blas: str | None) -> Spare | None:
        """The spare, if one is alive and has `blas` preloaded; it is no longer ours."""
        spare, self._spare = self._spare, None
        if spare is None:
            return None
        if spare.process.returncode is not None:
            self._failed(f"the spare runner exited ({spare.process.returncode}) before it was "
                         f"used: {' | '.join(spare.tail) or 'no output'}")
            return None
        if spare.blas != blas:
            asyncio.create_task(_end(spare))
            return None
        assert spare.reader is not None
        spare.reader.cancel()
        self._failures = 0
        return spare

    def _failed(self, message: str) -> None:
        self._failures += 1
        if self._failures >= SPARE_FAILURES:
            self.enabled = False
            message += f"; no more spare runners after {SPARE_FAILURES} failures"
        log.warning("%s", message)

    async def close(self) -> None:
        self._closed = True
        if self._making is not None:  # a process start takes milliseconds: `_make` ends it
            await asyncio.gather(self._making, return_exceptions=True)
        spare, self._spare = self._spare, None
        if spare is not None:
            await _end(spare)


async def _end(spare: Spare) -> None:
    """SIGTERM: a spare holds nothing (no port, no files) and has no handler for it yet."""
    proc = spare.process
    if proc.returncode is None:
        try:
            proc.terminate()
        except ProcessLookupError:
            pass
    await proc.wait()
    if spare.reader is not None:
        spare.reader.cancel()
