"""One background task whose progress fans out to every caller that asked for the same thing.

Invariants:
- At most one job per key is in `jobs` at a time; it removes itself when it ends.
- Every subscriber gets the items emitted after it joined, preceded by the latest item per
  progress key; then exactly one end: normal, or the job's exception raised.
- When the last subscriber leaves before the end, the job is cancelled (its work is resumable).
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Awaitable, Callable

Emit = Callable[[dict[str, Any]], None]
_END = object()


class SharedJob:
    def __init__(self, key: str, jobs: dict[str, Any]):
        self.key = key
        self._jobs = jobs
        self._queues: list[asyncio.Queue] = []
        self._latest: dict[str, dict[str, Any]] = {}
        self._task: asyncio.Task | None = None

    @classmethod
    def join(cls, jobs: dict[str, Any], key: str,
             work: Callable[[Emit], Awaitable[None]]) -> "SharedJob":
        """The running job for `key`, or a new one running `work(emit)`."""
        job = jobs.get(key)
        if isinstance(job, cls) and job._task is not None and not job._task.done():
            return job
        job = cls(key, jobs)
        jobs[key] = job
        job._task = asyncio.get_running_loop().create_task(job._run(work))
        return job

    def emit(self, item: dict[str, Any]) -> None:
        self._latest[str(item.get("digest") or item.get("status"))] = item
        for q in self._queues:
            q.put_nowait(item)

    async def _run(self, work: Callable[[Emit], Awaitable[None]]) -> None:
        end: object = _END
        try:
            await work(self.emit)
        except asyncio.CancelledError:
            end = asyncio.CancelledError()
        except Exception as exc:  # delivered to every subscriber
            end = exc
        finally:
            if self._jobs.get(self.key) is self:
                del self._jobs[self.key]
            for q in self._queues:
                q.put_nowait(end)

    async def stream(self) -> AsyncIterator[dict[str, Any]]:
        q: asyncio.Queue = asyncio.Queue()
        for item in self._latest.values():
            q.put_nowait(item)
        self._queues.append(q)
        try:
            while True:
                item = await q.get()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self._queues.remove(q)
            if not self._queues and self._task is not None and not self._task.done():
                self._task.cancel()
