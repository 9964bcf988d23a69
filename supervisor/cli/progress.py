"""Ollama-style progress on stderr: spinners (`writing manifest ⠋`) and one bar per digest
(`pulling 8eeb52dfb3bb... 100% ▕██████▏ 125 MB`).

On a terminal the lines are redrawn in place with rich's Live display. Anywhere else (a pipe,
a test) each line is printed once, when it is finished: a spinner when the next status
replaces it, a bar when it completes, whatever is left when the progress stops."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any, TextIO

from rich.console import Console
from rich.live import Live
from rich.text import Text

from mlxr.supervisor.cli.format import human_bytes

FRAMES = "⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏"


@dataclass(slots=True)
class _Line:
    text: str
    total: int | None = None  # None: a spinner
    completed: int = 0
    done: bool = False
    printed: bool = False
    started: float = field(default_factory=time.monotonic)

    def render(self, width: int, now: float) -> str:
        if self.total is None:
            if self.done:
                return self.text
            return f"{self.text} {FRAMES[int(now * 10) % len(FRAMES)]}".lstrip()
        pct = 100.0 * self.completed / self.total if self.total else 100.0
        pre = f"{self.text} {pct:3.0f}% "
        if self.completed >= self.total:
            suf = f" {human_bytes(self.total)}"
        else:
            elapsed = max(now - self.started, 1e-6)
            rate = self.completed / elapsed
            suf = f" {human_bytes(self.completed)}/{human_bytes(self.total)}"
            if rate > 0 and elapsed > 1:
                left = int((self.total - self.completed) / rate)
                suf += f"  {human_bytes(int(rate))}/s  {left // 60}m{left % 60}s"
        cells = max(10, min(width, 120) - len(pre) - len(suf) - 2)
        filled = int(cells * pct / 100)
        return f"{pre}▕{'█' * filled}{' ' * (cells - filled)}▏{suf}"


class Progress:
    """Spinners and bars, keyed; use as a context manager (stops, and prints what is left)."""

    def __init__(self, stream: TextIO | None = None, clear: bool = False):
        self.stream = stream or sys.stderr
        self.clear = clear  # a transient progress (the loading spinner) leaves nothing behind
        self.lines: dict[str, _Line] = {}
        self._status_key: str | None = None
        self._live: Live | None = None
        if self.stream.isatty():
            console = Console(file=self.stream, highlight=False)
            self._live = Live(_Renderable(self), console=console, transient=clear,
                              refresh_per_second=10, redirect_stdout=False,
                              redirect_stderr=False)
            self._live.start()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def status(self, text: str, key: str | None = None) -> None:
        """Start a spinner (ending the previous status spinner), or retitle the one at `key`."""
        key = key or text
        if key in self.lines:
            self.lines[key].text = text
            return
        self._end_status()
        self.lines[key] = _Line(text)
        self._status_key = key

    def finish(self, key: str) -> None:
        line = self.lines.get(key)
        if line and not line.done:
            line.done = True
            self._emit(line)

    def bar(self, key: str, text: str, total: int, completed: int) -> None:
        self._end_status()
        line = self.lines.get(key)
        if line is None:
            line = self.lines[key] = _Line(text, total=max(total, 0))
        line.completed = min(completed, line.total or completed)
        if line.total is not None and line.completed >= line.total and not line.done:
            line.done = True
            self._emit(line)

    def handle(self, item: dict[str, Any], verb: str = "pulling",
               skip_empty: bool = False) -> None:
        """One progress item of a pull/push/create stream, shown as Ollama shows it."""
        digest, status = item.get("digest"), item.get("status", "")
        if digest:
            completed = int(item.get("completed") or 0)
            if skip_empty and completed == 0:
                return  # a pull announces each layer before it starts; no 0% bars
            hex_part = digest.removeprefix("sha256:")
            label = f"{verb} {hex_part[:12]}..." if digest.startswith("sha256:") else status
            if status.startswith("converting"):  # a GGUF blob being converted to MLX
                label = f"{status} {hex_part[:12]}..."
            self.bar(digest, label or verb, int(item.get("total") or 0), completed)
        elif status and status != self._status_key:
            self.status(status)

    def stop(self) -> None:
        self._end_status()
        for line in self.lines.values():
            self._emit(line)
        if self._live is not None:
            self._live.stop()
            self._live = None

    # -- internals ---------------------------------------------------------------------------
    def _end_status(self) -> None:
        if self._status_key is not None:
            self.finish(self._status_key)
            self._status_key = None

    def _emit(self, line: _Line) -> None:
        """Without a live display, print a finished line once."""
        if self._live is not None or line.printed or self.clear or not line.text:
            return
        line.printed = True
        self.stream.write(line.render(80, time.monotonic()) + "\n")
        self.stream.flush()


class _Renderable:
    def __init__(self, progress: Progress):
        self.progress = progress

    def __rich_console__(self, console: Console, options: Any):
        now, width = time.monotonic(), options.max_width
        # list(): the refresh thread must not iterate the dict while the main thread adds to it
        lines = [x.render(width, now) for x in list(self.progress.lines.values())]
        yield Text("\n".join(lines), no_wrap=True, overflow="ellipsis")
