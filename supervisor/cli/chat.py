"""`mlxr run`: one prompt streamed to stdout, or an interactive chat like `ollama run`'s.

The chat keeps the conversation (a system message first, when set) and sends all of it to
/api/chat each turn, with the options set by `/set parameter`. A turn stopped with Ctrl-C, or
one the server fails, is dropped from the conversation, and the session goes on."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, TextIO

from mlxr.shared.errors import InvalidRequest
from mlxr.supervisor.cli.client import ApiClient, CliError, ServerError
from mlxr.supervisor.cli.format import (USAGE, USAGE_PARAMETERS, USAGE_SET, USAGE_SHORTCUTS,
                                   USAGE_SHOW, metrics_summary, models_table, show_info)
from mlxr.supervisor.cli.images import take_images
from mlxr.supervisor.cli.progress import Progress
from mlxr.supervisor.cli.wrap import WordWrapper, terminal_width
from mlxr.supervisor.store.modelfile import parse_parameter

GREY, BOLD, RESET = "\x1b[90m", "\x1b[1m", "\x1b[0m"


@dataclass(slots=True)
class RunOptions:
    model: str
    prompt: str = ""
    format: Any = None
    keep_alive: str | None = None
    think: bool | str | None = None
    hide_thinking: bool = False
    verbose: bool = False
    word_wrap: bool = True  # wrap at words (only when writing to a terminal)
    system: str = ""
    options: dict[str, Any] = field(default_factory=dict)
    messages: list[dict[str, Any]] = field(default_factory=list)
    vision: bool = False  # the model takes images: image paths in a prompt are sent

    def request(self, **fields: Any) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, **fields}
        for key, value in (("options", dict(self.options)), ("format", self.format),
                           ("keep_alive", self.keep_alive), ("think", self.think)):
            if value not in (None, {}):
                body[key] = value
        return body


class ReplyWriter:
    """Writes a streamed reply: thinking between "Thinking..." and "...done thinking.", then
    the answer. `plain`: no colours (output is not a terminal). Words wrap only on a terminal
    (`wrap`): the wrapper's cursor moves would corrupt a file or a pipe."""

    def __init__(self, out: TextIO, hide_thinking: bool, plain: bool, wrap: bool = False):
        self.out, self.hide_thinking, self.plain = out, hide_thinking, plain
        self.thinking_open = False
        self.last_thought = ""
        self.wrap = WordWrapper(terminal_width(out)) if wrap and not plain else None

    def _text(self, text: str) -> None:
        self.out.write(self.wrap(text) if self.wrap and text else text)

    def write(self, content: str, thinking: str) -> None:
        if thinking and not self.hide_thinking:
            if not self.thinking_open:
                opening = "Thinking...\n"
                self.out.write(opening if self.plain else GREY + BOLD + opening + RESET + GREY)
                self.thinking_open = True
            self._text(thinking)
            self.last_thought = thinking
        if self.thinking_open and content:
            closing = "...done thinking.\n\n"
            if not self.last_thought.endswith("\n"):
                self.out.write("\n")
            self.out.write(closing if self.plain else GREY + BOLD + closing + RESET)
            self.thinking_open = False
            if self.wrap:
                self.wrap.line_len, self.wrap.word = 0, ""
        self._text(content)
        self.out.flush()


Parts = Callable[[dict[str, Any]], tuple[str, str]]


def _stream(items: Iterator[dict[str, Any]], parts: Parts, opts: RunOptions,
            out: TextIO) -> tuple[str, dict[str, Any] | None]:
    """Show a reply as it streams; returns its text and the final line (None: interrupted).
    A spinner runs on stderr until the first words arrive."""
    progress = Progress(clear=True)
    progress.status("")
    writer = ReplyWriter(out, opts.hide_thinking, plain=not out.isatty(), wrap=opts.word_wrap)
    text: list[str] = []
    final = None
    try:
        for item in items:
            content, thinking = parts(item)
            if content or (thinking and not opts.hide_thinking):
                progress.stop()
            writer.write(content, thinking)
            text.append(content)
            if item.get("done"):
                final = item
    except KeyboardInterrupt:
        final = None  # closing the stream below closes the connection: the server stops
    finally:
        progress.stop()
        close = getattr(items, "close", None)
        if close:
            close()
    return "".join(text), final


def _generate_parts(item: dict[str, Any]) -> tuple[str, str]:
    return item.get("response") or "", item.get("thinking") or ""


def _chat_parts(item: dict[str, Any]) -> tuple[str, str]:
    message = item.get("message") or {}
    return message.get("content") or "", message.get("thinking") or ""


def load_model(client: ApiClient, opts: RunOptions) -> None:
    """An empty generate loads the model (or, with keep_alive 0, unloads it)."""
    with Progress(clear=True) as progress:
        progress.status("")
        for _ in client.generate(opts.request()):
            pass


def _with_images(text: str, vision: bool) -> tuple[str, list[str]]:
    """For a vision model, the text without its image paths and the images they name."""
    if not vision:
        return text, []
    rest, images, files = take_images(text)
    for path in files:
        print(f"Added image '{path}'", file=sys.stderr)
    return rest, images


def run_once(client: ApiClient, opts: RunOptions, out: TextIO | None = None) -> None:
    """Generate a reply to `opts.prompt`, stream it to stdout, and print timings if verbose."""
    out = out or sys.stdout
    prompt, images = _with_images(opts.prompt, opts.vision)
    body = opts.request(prompt=prompt)
    if images:
        body["images"] = images
    if opts.system:
        body["system"] = opts.system
    _, final = _stream(client.generate(body), _generate_parts, opts, out)
    if final is None:
        return
    if opts.prompt:
        out.write("\n\n")
        out.flush()
    if opts.verbose:
        sys.stderr.write(metrics_summary(final))


def chat_turn(client: ApiClient, opts: RunOptions, out: TextIO | None = None
              ) -> dict[str, Any] | None:
    """Send the conversation; stream the reply; return the assistant message (None if
    interrupted)."""
    out = out or sys.stdout
    text, final = _stream(client.chat(opts.request(messages=opts.messages)), _chat_parts,
                          opts, out)
    if final is None:
        out.write("\n")
        return None
    out.write("\n\n")
    out.flush()
    if opts.verbose:
        sys.stderr.write(metrics_summary(final))
    return {"role": "assistant", "content": text}


def _go_value(value: Any) -> str:
    """A parameter value as Go's %v prints it."""
    if isinstance(value, list):
        return "[" + " ".join(_go_value(v) for v in value) + "]"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value).lower() if isinstance(value, bool) else str(value)


def set_parameter(options: dict[str, Any], name: str, values: list[str]) -> None:
    """Type a `/set parameter` value like a Modelfile's; stop strings accumulate."""
    if name == "stop":
        options["stop"] = list(options.get("stop") or []) + parse_parameter(name, values)
    else:
        options[name] = parse_parameter(name, values[0])


def _cut_suffix(text: str, suffix: str) -> tuple[str, bool]:
    return (text[:-len(suffix)], True) if text.endswith(suffix) else (text, False)


class ChatSession:
    """The interactive loop: `>>> ` lines are messages or /commands."""

    def __init__(self, client: ApiClient, opts: RunOptions):
        self.client, self.opts = client, opts
        self.buf: list[str] = []
        self.multiline: str | None = None  # "prompt" or "system" inside """ ... """

    def loop(self) -> None:
        if sys.stdin.isatty():
            import readline  # noqa: F401  (line editing and history for input())
        while True:
            try:
                line = input("... " if self.multiline else ">>> ")
            except EOFError:
                print()
                return
            except KeyboardInterrupt:
                print("\nUse Ctrl + d or /bye to exit.")
                self.buf.clear()
                self.multiline = None
                continue
            if not self.handle(line):
                return

    def handle(self, line: str) -> bool:
        """One input line; False ends the session."""
        if self.multiline:
            before, ended = _cut_suffix(line, '"""')
            self.buf.append(before)
            if not ended:
                self.buf.append("\n")
                return True
            if self.multiline == "system":
                self._set_system("".join(self.buf))
                self.buf.clear()
            self.multiline = None
        elif line.startswith('"""'):
            rest, ended = _cut_suffix(line[3:], '"""')
            self.buf.append(rest)
            if not ended:
                self.buf.append("\n")
                self.multiline = "prompt"
                return True
        elif line.startswith("/"):
            return self.command(line.split())
        else:
            self.buf.append(line)
        text = "".join(self.buf)
        self.buf.clear()
        if text:
            self.send(text)
        return True

    def send(self, text: str) -> None:
        text, images = _with_images(text, self.opts.vision)
        message: dict[str, Any] = {"role": "user", "content": text}
        if images:
            message["images"] = images
        self.opts.messages.append(message)
        try:
            reply = chat_turn(self.client, self.opts)
        except CliError as err:
            print(f"Error: {err.message}", file=sys.stderr)
            reply = None
        if reply is None:
            self.opts.messages.pop()
        else:
            self.opts.messages.append(reply)

    def command(self, args: list[str]) -> bool:
        name = args[0]
        if name in ("/bye", "/exit"):
            return False
        if name == "/clear":
            self.opts.messages = ([{"role": "system", "content": self.opts.system}]
                                  if self.opts.system else [])
            print("Cleared session context")
        elif name == "/set":
            self._set(args[1:])
        elif name == "/show":
            self._show(args[1:])
        elif name == "/load" and len(args) == 2:
            self._load(args[1])
        elif name == "/save" and len(args) == 2:
            self._save(args[1])
        elif name in ("/load", "/save"):
            print(f"Usage:\n  {name} <modelname>")
        elif name == "/list":
            print(models_table(self.client.tags(), args[1] if len(args) > 1 else ""), end="")
        elif name in ("/?", "/help"):
            topic = args[1].lstrip("/") if len(args) > 1 else ""
            usage = {"set": USAGE_SET, "show": USAGE_SHOW, "shortcut": USAGE_SHORTCUTS,
                     "shortcuts": USAGE_SHORTCUTS}.get(topic, USAGE)
            print(usage, file=sys.stderr)
        else:
            print(f"Unknown command '{name}'. Type /? for help")
        return True

    def _set_system(self, text: str) -> None:
        self.opts.system = text
        message = {"role": "system", "content": text}
        if self.opts.messages and self.opts.messages[-1]["role"] == "system":
            self.opts.messages[-1] = message
        else:
            self.opts.messages.append(message)
        print("Set system message.")

    def _set(self, args: list[str]) -> None:
        opts = self.opts
        what = args[0] if args else ""
        if what == "parameter":
            if len(args) < 3:
                print(USAGE_PARAMETERS, file=sys.stderr)
                return
            try:
                set_parameter(opts.options, args[1], args[2:])
            except InvalidRequest as err:
                print(f'Couldn\'t set parameter: "{err.message}"')
                return
            print(f"Set parameter '{args[1]}' to '{', '.join(args[2:])}'")
        elif what == "system" and len(args) > 1:
            text = " ".join(args[1:])
            if text.startswith('"""'):
                text, ended = _cut_suffix(text[3:], '"""')
                if not ended:
                    self.buf.append(text + "\n")
                    self.multiline = "system"
                    return
            self._set_system(text)
        elif what in ("verbose", "quiet"):
            opts.verbose = what == "verbose"
            print(f"Set '{what}' mode.")
        elif what == "think":
            opts.think = args[1] if len(args) > 1 else True
            print(f"Set 'think' mode to '{args[1]}'." if len(args) > 1 else "Set 'think' mode.")
        elif what == "nothink":
            opts.think = False
            print("Set 'nothink' mode.")
        elif what == "format":
            if len(args) < 2 or args[1] != "json":
                print("Invalid or missing format. For 'json' mode use '/set format json'")
            else:
                opts.format = "json"
                print("Set format to 'json' mode.")
        elif what == "noformat":
            opts.format = None
            print("Disabled format.")
        elif what in ("wordwrap", "nowordwrap"):
            opts.word_wrap = what == "wordwrap"
            print(f"Set '{what}' mode.")
        elif what in ("history", "nohistory"):
            pass
        elif what:
            print(f"Unknown command '/set {what}'. Type /? for help")
        else:
            print(USAGE_SET, file=sys.stderr)

    def _show(self, args: list[str]) -> None:
        if not args:
            print(USAGE_SHOW, file=sys.stderr)
            return
        resp = self.client.show(self.opts.model)
        what = args[0]
        if what == "info":
            print(show_info(resp), end="", file=sys.stderr)
        elif what == "license":
            print(resp.get("license") or "No license was specified for this model.")
        elif what == "modelfile":
            print(resp.get("modelfile", ""))
        elif what == "parameters":
            print("Model defined parameters:")
            params = resp.get("parameters") or ""
            lines = params.splitlines() or ["No additional parameters were specified for "
                                            "this model."]
            print("".join(f"  {x}\n" for x in lines))
            if self.opts.options:
                print("User defined parameters:")
                print("".join(f"  {k:<30} {_go_value(v)}\n"
                              for k, v in self.opts.options.items()))
        elif what == "system":
            system = self.opts.system or resp.get("system")
            print(system + "\n" if system else "No system message was specified for this model.")
        elif what == "template":
            print(resp.get("template") or "No prompt template was specified for this model.")
        else:
            print(f"Unknown command '/show {what}'. Type /? for help")

    def _load(self, model: str) -> None:
        print(f"Loading model '{model}'")
        previous = self.opts.model
        self.opts.model = model
        try:
            info = self.client.show(model)
            load_model(self.client, self.opts)
        except ServerError as err:
            self.opts.model = previous
            print(f"Couldn't find model '{model}'" if err.status == 404 else
                  f"error: {err.message}")
            return
        self.opts.messages, self.opts.system = [], ""
        self.opts.vision = "vision" in (info.get("capabilities") or [])

    def _save(self, name: str) -> None:
        body: dict[str, Any] = {"model": name, "from": self.opts.model}
        if self.opts.system:
            body["system"] = self.opts.system
        if self.opts.options:
            body["parameters"] = self.opts.options
        if self.opts.messages:
            body["messages"] = self.opts.messages
        try:
            for _ in self.client.create(body):
                pass
        except ServerError as err:
            print(f"error: {err.message}")
            return
        print(f"Created new model '{name}'")


def interactive(client: ApiClient, opts: RunOptions, info: dict[str, Any]) -> None:
    """Load the model, replay the model's stored messages, then chat."""
    load_model(client, opts)
    for message in info.get("messages") or []:
        if message.get("role") == "user":
            print(f">>> {message.get('content', '')}")
        elif message.get("role") == "assistant":
            print(message.get("content", "") + "\n")
    ChatSession(client, opts).loop()
