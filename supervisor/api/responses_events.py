"""The Responses API's output: one state machine (`ResponseBuilder`) turns a completion's
events into output items and the typed stream events, for streamed and whole responses alike
(a response that is not streamed is the builder's final `response`, its events unsent).

Invariants:
- Events come in Ollama's order, each with the next `sequence_number` from 0:
  response.created, response.in_progress, then per output item output_item.added, its
  deltas, its .done events, output_item.done; last one of response.completed,
  response.incomplete (the output limit was reached: status "incomplete",
  incomplete_details.reason "max_output_tokens") or response.failed.
- At most one item is open at a time; an item of another kind closes it. Items are indexed by
  `output_index` in the order they were opened and never change once done.
- A reasoning item (the model's thinking) carries its text as Ollama gives it: one
  summary_text part, and the same text in `encrypted_content` (plain, so a client sending it
  back gives the model its thinking again).
- Whitespace before any text is held back: it goes into the message once text follows, and
  is dropped when a function call comes instead. Without function calls the output always
  has a message item (empty if the model wrote nothing), so `output_text` is always defined.
"""

from __future__ import annotations

import json
import secrets
import time
from typing import Any

from aiohttp import web

from mlxr.shared.errors import MlxrError
from mlxr.supervisor.inference.types import Completion, Delta, Final


def _id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class ResponseBuilder:
    def __init__(self, model: str, echo: dict[str, Any], created_at: int):
        self.id = _id("resp")
        self.model = model
        self.echo = echo
        self.created_at = created_at
        self.events: list[tuple[str, dict[str, Any]]] = []  # not yet sent: (type, data)
        self.output: list[dict[str, Any]] = []  # items done, by output_index
        self.response: dict[str, Any] = self._object("in_progress", [])
        self._seq = 0
        self._open: dict[str, Any] | None = None  # the item being streamed
        self._text = ""  # the open item's text so far
        self._held = ""  # whitespace not yet given to a message
        self._calls = 0
        self._messages = 0
        self._started = False

    # -- input ----------------------------------------------------------------------------

    def start(self) -> None:
        if not self._started:
            self._started = True
            self._event("response.created", response=self._object("in_progress", []))
            self._event("response.in_progress", response=self._object("in_progress", []))

    def feed(self, event: Delta | Final) -> None:
        self.start()
        if isinstance(event, Final):
            self._finish(event)
            return
        if event.thinking:
            self._reasoning(event.thinking)
        if event.content:
            self._message(event.content)
        for call in event.tool_calls:
            self._function_call(call)

    def fail(self, err: MlxrError) -> None:
        """The completion failed after it started: a response.failed event."""
        self.start()
        self.response = self._object("failed", list(self.output))
        self.response["error"] = {"code": err.code or err.openai_type, "message": err.message}
        self._event("response.failed", response=self.response)

    def take_events(self) -> list[tuple[str, dict[str, Any]]]:
        events, self.events = self.events, []
        return events

    # -- items ----------------------------------------------------------------------------

    def _reasoning(self, text: str) -> None:
        if self._open is None or self._open["type"] != "reasoning":
            self._close()
            self._add({"id": _id("rs"), "type": "reasoning", "summary": []})
            self._event("response.reasoning_summary_part.added", **self._at(),
                        summary_index=0, part={"type": "summary_text", "text": ""})
        self._text += text
        self._event("response.reasoning_summary_text.delta", **self._at(), summary_index=0,
                    delta=text)

    def _message(self, text: str) -> None:
        if self._open is not None and self._open["type"] == "message":
            self._text += text
            self._event("response.output_text.delta", **self._at(), content_index=0,
                        delta=text, logprobs=[])
            return
        if not (self._held + text).strip():
            self._held += text
            return
        self._close()
        text, self._held = self._held + text, ""
        self._open_message()
        self._message(text)

    def _open_message(self) -> None:
        self._messages += 1
        self._add({"id": _id("msg"), "type": "message", "status": "in_progress",
                   "role": "assistant", "content": []})
        self._event("response.content_part.added", **self._at(), content_index=0,
                    part=_text_part(""))

    def _function_call(self, call: dict[str, Any]) -> None:
        self._close()
        self._held = ""
        self._calls += 1
        fn = call["function"]
        args = json.dumps(fn.get("arguments") or {})
        item = {"id": _id("fc"), "type": "function_call", "status": "in_progress",
                "call_id": call.get("id") or _id("call"), "name": fn["name"], "arguments": ""}
        self._add(item)
        self._event("response.function_call_arguments.delta", **self._at(), delta=args)
        self._event("response.function_call_arguments.done", **self._at(), arguments=args)
        self._done({**item, "status": "completed", "arguments": args})

    def _add(self, item: dict[str, Any]) -> None:
        self._open, self._text = item, ""
        self._event("response.output_item.added", output_index=len(self.output), item=item)

    def _at(self) -> dict[str, Any]:
        assert self._open is not None
        return {"item_id": self._open["id"], "output_index": len(self.output)}

    def _close(self, status: str = "completed") -> None:
        item, text = self._open, self._text
        if item is None or item["type"] == "function_call":
            return
        if item["type"] == "reasoning":
            part = {"type": "summary_text", "text": text}
            self._event("response.reasoning_summary_text.done", **self._at(), summary_index=0,
                        text=text)
            self._event("response.reasoning_summary_part.done", **self._at(), summary_index=0,
                        part=part)
            self._done({**item, "summary": [part], "encrypted_content": text})
        else:
            self._event("response.output_text.done", **self._at(), content_index=0, text=text,
                        logprobs=[])
            self._event("response.content_part.done", **self._at(), content_index=0,
                        part=_text_part(text))
            self._done({**item, "status": status, "content": [_text_part(text)]})

    def _done(self, item: dict[str, Any]) -> None:
        self._event("response.output_item.done", output_index=len(self.output), item=item)
        self.output.append(item)
        self._open, self._text = None, ""

    def _finish(self, final: Final) -> None:
        truncated = final.done_reason == "length"
        status = "incomplete" if truncated else "completed"
        if not self._calls and not self._messages:
            self._close()
            self._open_message()
            if self._held:
                self._message(self._held)
                self._held = ""
        self._close(status)
        self.response = self._object(status, list(self.output))
        self.response["completed_at"] = int(time.time())
        if truncated:
            self.response["incomplete_details"] = {"reason": "max_output_tokens"}
        self.response["usage"] = {
            "input_tokens": final.prompt_eval_count,
            "input_tokens_details": {"cached_tokens": final.prompt_eval_cached_count},
            "output_tokens": final.eval_count,
            "output_tokens_details": {"reasoning_tokens": final.reasoning_count},
            "total_tokens": final.prompt_eval_count + final.eval_count}
        self._event(f"response.{status}", response=self.response)

    # -- envelopes ------------------------------------------------------------------------

    def _event(self, kind: str, **data: Any) -> None:
        self.events.append((kind, {"type": kind, "sequence_number": self._seq, **data}))
        self._seq += 1

    def _object(self, status: str, output: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": "response", "created_at": self.created_at,
                "completed_at": None, "status": status, "incomplete_details": None,
                "model": self.model, "previous_response_id": None, "output": output,
                "error": None, "usage": None, "store": False, "background": False,
                "service_tier": "default", "presence_penalty": 0, "frequency_penalty": 0,
                "top_logprobs": 0, "max_tool_calls": None, "safety_identifier": None,
                "prompt_cache_key": None, **self.echo}


async def write_stream(request: web.Request, builder: ResponseBuilder,
                       completion: Completion) -> web.StreamResponse:
    """Server-sent events, each `event: <type>` and `data: <the event>`; an error after the
    stream began ends it with response.failed."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
    await response.prepare(request)

    async def flush() -> None:
        events = builder.take_events()
        if events:
            await response.write(b"".join(
                f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode()
                for kind, data in events))

    builder.start()
    await flush()
    try:
        async for event in completion:
            builder.feed(event)
            await flush()
    except MlxrError as err:
        builder.fail(err)
        await flush()
    await response.write_eof()
    return response
