"""The inference service's vocabulary, shared by the Ollama and OpenAI skins: the requests they
translate into, the events a `Completion` yields (`Delta`s, then one `Final`), and `fold`,
which makes one `Reply` of those events for a request that is not streamed."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, Iterable

from mlxr.supervisor.inference.tool_calls import ForcedCall


@dataclass(slots=True)
class ChatRequest:
    model: str
    messages: list[dict[str, Any]]  # Ollama's shape: role, content, images, tool_calls, ...
    tools: list[dict[str, Any]] = field(default_factory=list)
    # Ollama's think value: None (the model's default: thinking models think), True, False,
    # or a level "low" | "medium" | "high" | "max" (thinking on, at that effort).
    think: bool | str | None = None
    format: Any = None  # "json" or a JSON schema object; None or "" for free text
    options: dict[str, Any] = field(default_factory=dict)
    keep_alive_s: float | None = None  # None: the server default; negative: forever
    logprobs: bool = False
    top_logprobs: int = 0
    force_call: ForcedCall | None = None  # the reply must be a call to one of `tools`
    # Ollama's `truncate`: an over-long chat drops its oldest turns (system messages and the
    # last user turn stay) to fit num_ctx; False keeps the whole chat (a 400 if too long).
    truncate: bool = True
    # Ollama's `shift`: a reply that fills num_ctx drops older context (after num_keep
    # tokens) and goes on; False ends it there with done_reason "length".
    shift: bool = True
    # At most this many output tokens of thinking (Anthropic's budget_tokens); then the
    # runner writes the end-of-thinking tag itself and the answer follows. None: no limit.
    think_budget: int | None = None


@dataclass(slots=True)
class GenerateRequest:
    model: str
    prompt: str = ""
    suffix: str = ""
    system: str | None = None
    template: str | None = None
    raw: bool = False
    context: list[int] | None = None
    images: list[str] = field(default_factory=list)
    think: bool | str | None = None
    format: Any = None
    options: dict[str, Any] = field(default_factory=dict)
    keep_alive_s: float | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    shift: bool = True  # as ChatRequest.shift


@dataclass(slots=True)
class EmbedCall:
    model: str
    input: Any  # a string, a list of strings, or token arrays
    truncate: bool = True
    dimensions: int | None = None
    options: dict[str, Any] = field(default_factory=dict)
    keep_alive_s: float | None = None


@dataclass(slots=True)
class EmbedResult:
    embeddings: list[list[float]]
    prompt_eval_count: int
    load_duration: int = 0  # ns
    total_duration: int = 0


@dataclass(slots=True)
class Delta:
    content: str = ""
    thinking: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    logprobs: list[dict[str, Any]] | None = None

    def __bool__(self) -> bool:
        return bool(self.content or self.thinking or self.tool_calls or self.logprobs)


@dataclass(slots=True)
class Final:
    done_reason: str  # stop | length | load | unload
    prompt_eval_count: int = 0
    prompt_eval_cached_count: int = 0  # prompt tokens served from the runner's prefix cache
    prompt_eval_duration: int = 0  # ns, as on Ollama's wire
    eval_count: int = 0
    eval_duration: int = 0
    load_duration: int = 0
    total_duration: int = 0
    context: list[int] | None = None
    # Of eval_count, the tokens that went to the thinking (OpenAI's reasoning_tokens): those
    # of runner chunks whose text was all thinking.
    reasoning_count: int = 0


class Completion:
    """An accepted request: iterate for `Delta`s, then one `Final`. Always `aclose()` it:
    that frees the runner slot even if the events were never read."""

    def __init__(self, model: str, events: AsyncIterator[Delta | Final],
                 cleanup: Callable[[], Awaitable[None]] | None = None,
                 count_prompt: Callable[[], Awaitable[int]] | None = None):
        self.model = model
        self._events = events
        self._cleanup = cleanup
        self._count_prompt = count_prompt

    async def prompt_tokens(self) -> int:
        """The prompt's token count before any event is read (the runner's tokenizer, on the
        runner this request holds); what the Final's prompt_eval_count will say."""
        if self._count_prompt is None:
            raise RuntimeError("this completion cannot count its prompt")
        return await self._count_prompt()

    def __aiter__(self) -> AsyncIterator[Delta | Final]:
        return self._events

    async def aclose(self) -> None:
        close = getattr(self._events, "aclose", None)
        if close is not None:
            await close()
        if self._cleanup is not None:
            await self._cleanup()


@dataclass(slots=True)
class Reply:
    """A whole completion: its `Delta`s joined, and its `Final`."""

    final: Final
    content: str = ""
    thinking: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    logprobs: list[dict[str, Any]] = field(default_factory=list)


def fold(events: Iterable[Delta | Final]) -> Reply:
    """One `Reply` of a completion's events (for `stream: false`)."""
    content, thinking, calls, logprobs = [], [], [], []
    final = None
    for event in events:
        if isinstance(event, Final):
            final = event
            continue
        content.append(event.content)
        thinking.append(event.thinking)
        calls += event.tool_calls
        logprobs += event.logprobs or []
    assert final is not None, "a completion ends with a Final"
    return Reply(final, "".join(content), "".join(thinking), calls, logprobs)


@dataclass(slots=True)
class RunningModel:
    name: str
    model: str
    size: int
    size_vram: int
    digest: str
    details: dict[str, Any]
    expires_at: dt.datetime
    context_length: int
    blas: dict[str, str]
    kv: dict[str, Any] = field(default_factory=dict)
    weights: str = ""  # "bfloat16", "float32 from 4-bit", ... (runner/weights.py)
    active: int = 0  # the runner's running and waiting sequences (the dashboard shows them)
    waiting: int = 0
    ranks: list[dict[str, Any]] = field(default_factory=list)  # a distributed runner's ranks
    sharding: str = ""
