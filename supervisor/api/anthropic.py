"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`), as Ollama serves it
for Claude Code: a third thin skin over the same service as the Ollama and OpenAI routes.

Requests are translated in anthropic_body.py. One `MessageBuilder` turns the service's events
into Anthropic's stream events for both modes: a streamed reply sends them as server-sent
events, a whole reply is the message they build. Invariants:
- Blocks come in the order the output has them (thinking, text, tool_use ...); exactly one
  block is open at a time, and every block started is stopped before `message_delta`.
- A stream is message_start, ping, the blocks, message_delta (stop_reason, usage),
  message_stop; an error after message_start is one `error` event, and the stream ends.
- Stop sequences are matched here, on the text blocks only: text that may begin one is held
  back until it cannot, nothing from a matched sequence on is sent, and the completion is
  closed there (which cancels it in the runner).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
from typing import Any, AsyncIterator

from aiohttp import web

from mlxr.shared.errors import MlxrError
from mlxr.shared.ndjson import dumps_line
from mlxr.supervisor.api.anthropic_body import (MessagesCall, parse_count_tokens,
                                                parse_messages)
from mlxr.supervisor.api.body import read_json
from mlxr.supervisor.api.keys import SERVICE
from mlxr.supervisor.api.middleware import anthropic_error_body
from mlxr.supervisor.inference.types import Completion, Delta, Final

PING_INTERVAL_S = 10.0  # a ping while the model is silent (a long prefill), as Anthropic does
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens"}


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


# -- stop sequences ----------------------------------------------------------------------------

class StopMatcher:
    """Finds the first of `stops` in streamed text. `feed` returns the text that is safe to
    send and the sequence matched (None while none has); `flush` the text held back."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.pending = ""

    def feed(self, text: str) -> tuple[str, str | None]:
        if not self.stops:
            return text, None
        buf = self.pending + text
        hits = [(buf.find(s), s) for s in self.stops if s in buf]
        if hits:
            at, stop = min(hits, key=lambda hit: hit[0])
            self.pending = ""
            return buf[:at], stop
        hold = max((k for s in self.stops for k in range(1, len(s))
                    if buf.endswith(s[:k])), default=0)
        self.pending = buf[len(buf) - hold:] if hold else ""
        return buf[:len(buf) - hold], None

    def flush(self) -> str:
        text, self.pending = self.pending, ""
        return text


# -- events -> Anthropic's stream events and message --------------------------------------------

class MessageBuilder:
    """The Anthropic events of one reply, built from the service's `Delta`s; `message` is the
    whole reply they describe (what the client's accumulator makes of them)."""

    def __init__(self, ident: str, model: str, stop_sequences: list[str] | None = None):
        self.ident, self.model = ident, model
        self.blocks: list[dict[str, Any]] = []
        self.open: str | None = None  # the type of the open block, if one is open
        self.stop = StopMatcher(stop_sequences or [])
        self.stop_sequence: str | None = None
        self.num_tokens = 0  # output tokens seen (the logprob entries, when asked for)
        self.stop_reason: str | None = None
        self.usage = {"input_tokens": 0, "output_tokens": 0}

    @property
    def stopped(self) -> bool:
        """A stop sequence matched: read no further."""
        return self.stop_sequence is not None

    def start(self) -> list[dict[str, Any]]:
        return [{"type": "message_start", "message": {**self.message(), "content": []}},
                {"type": "ping"}]

    def feed(self, delta: Delta) -> list[dict[str, Any]]:
        self.num_tokens += len(delta.logprobs or [])
        if self.stopped:
            return []
        events = self._append("thinking", delta.thinking) if delta.thinking else []
        if delta.content:
            text, self.stop_sequence = self.stop.feed(delta.content)
            events += self._append("text", text)
            if self.stopped:
                return events
        if delta.tool_calls:
            events += self._append("text", self.stop.flush()) + self._close()
            for call in delta.tool_calls:
                events += self._tool_use(call)
        return events

    def finish(self, done_reason: str, input_tokens: int, output_tokens: int
               ) -> list[dict[str, Any]]:
        events = [] if self.stopped else self._append("text", self.stop.flush())
        events += self._close()
        if any(b["type"] == "tool_use" for b in self.blocks):
            self.stop_reason = "tool_use"
        elif self.stopped:
            self.stop_reason = "stop_sequence"
        else:
            self.stop_reason = STOP_REASONS.get(done_reason, "end_turn")
        self.usage = {"input_tokens": input_tokens, "output_tokens": output_tokens}
        return events + [{"type": "message_delta",
                          "delta": {"stop_reason": self.stop_reason,
                                    "stop_sequence": self.stop_sequence},
                          "usage": dict(self.usage)},
                         {"type": "message_stop"}]

    def message(self) -> dict[str, Any]:
        return {"id": self.ident, "type": "message", "role": "assistant", "model": self.model,
                "content": self.blocks, "stop_reason": self.stop_reason,
                "stop_sequence": self.stop_sequence, "usage": dict(self.usage)}

    def _append(self, kind: str, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        events = []
        if self.open != kind:
            events += self._close()
            block = {"type": kind, kind: ""}
            if kind == "thinking":
                block["signature"] = ""  # nothing signs it; the field is in the block's type
            events.append(self._start_block(block))
            self.open = kind
        index = len(self.blocks) - 1
        self.blocks[index][kind] += text
        delta = {"type": f"{kind}_delta", kind: text}
        return events + [{"type": "content_block_delta", "index": index, "delta": delta}]

    def _tool_use(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        fn = call.get("function") or {}
        args = fn.get("arguments")
        args = args if isinstance(args, dict) else {}
        start = self._start_block({"type": "tool_use", "id": new_id("toolu"),
                                   "name": fn.get("name", ""), "input": {}})
        index = len(self.blocks) - 1
        self.blocks[index]["input"] = args
        return [start,
                {"type": "content_block_delta", "index": index,
                 "delta": {"type": "input_json_delta", "partial_json": json.dumps(args)}},
                {"type": "content_block_stop", "index": index}]

    def _start_block(self, block: dict[str, Any]) -> dict[str, Any]:
        self.blocks.append(block)
        return {"type": "content_block_start", "index": len(self.blocks) - 1,
                "content_block": dict(block)}

    def _close(self) -> list[dict[str, Any]]:
        if self.open is None:
            return []
        self.open = None
        return [{"type": "content_block_stop", "index": len(self.blocks) - 1}]


# -- running a request -------------------------------------------------------------------------

async def _with_pings(completion: Completion, interval_s: float
                      ) -> AsyncIterator[Delta | Final | None]:
    """The completion's events, and None each time `interval_s` passes without one."""
    events = aiter(completion)
    pending: asyncio.Future | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(events))
            done, _ = await asyncio.wait({pending}, timeout=interval_s)
            if not done:
                yield None
                continue
            try:
                event = pending.result()
            except StopAsyncIteration:
                return
            pending = None
            yield event
    finally:
        if pending is not None and not pending.done():
            # Let the cancelled step finish, so the completion can be closed after it.
            pending.cancel()
            with contextlib.suppress(BaseException):
                await pending


async def _events(service: Any, call: MessagesCall, completion: Completion,
                  builder: MessageBuilder, source: AsyncIterator[Any]
                  ) -> AsyncIterator[dict[str, Any]]:
    """Anthropic's events for one request, from message_start to message_stop. A stream's
    message_start carries the prompt's token count, as Anthropic's does (the runner's
    tokenizer counts it; the final counts come in message_delta)."""
    if call.stream:
        builder.usage["input_tokens"] = await completion.prompt_tokens()
    for event in builder.start():
        yield event
    final = None
    async for event in source:
        if event is None:
            yield {"type": "ping"}
        elif isinstance(event, Final):
            final = event
            break
        else:
            for out in builder.feed(event):
                yield out
            if builder.stopped:
                break
    if final is not None:
        done = (final.done_reason, final.prompt_eval_count, final.eval_count)
    else:
        assert builder.stopped, "a completion ends with a Final"
        # Closed at the stop sequence: no final counts come, so they are taken here.
        await completion.aclose()
        done = ("stop", await service.count_tokens(call.chat), builder.num_tokens)
    for event in builder.finish(*done):
        yield event


# -- handlers ----------------------------------------------------------------------------------

async def messages(request: web.Request) -> web.StreamResponse:
    call = parse_messages(await read_json(request))
    service = request.app[SERVICE]
    completion = await service.chat(call.chat)
    builder = MessageBuilder(new_id("msg"), call.chat.model, call.stop_sequences)
    try:
        if call.stream:
            return await _stream(request, service, call, completion, builder)
        async for _ in _events(service, call, completion, builder, aiter(completion)):
            pass
        return web.json_response(builder.message())
    finally:
        await completion.aclose()


async def _stream(request: web.Request, service: Any, call: MessagesCall,
                  completion: Completion, builder: MessageBuilder) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
    await response.prepare(request)

    async def send(event: dict[str, Any]) -> None:
        data = dumps_line(event)[:-1]
        await response.write(b"event: " + event["type"].encode() + b"\ndata: " + data + b"\n\n")

    try:
        async with contextlib.aclosing(_with_pings(completion, PING_INTERVAL_S)) as source:
            async for event in _events(service, call, completion, builder, source):
                await send(event)
    except MlxrError as err:
        await send(anthropic_error_body(err))
    await response.write_eof()
    return response


async def count_tokens(request: web.Request) -> web.Response:
    req = parse_count_tokens(await read_json(request))
    count = await request.app[SERVICE].count_tokens(req)
    return web.json_response({"input_tokens": count})
