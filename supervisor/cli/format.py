"""What the command line prints, in Ollama's formats: sizes ("125 MB"), counts ("19.54M"),
relative times ("2 minutes ago"), Go durations ("1.25s"), borderless tables, the `show`
summary, the `--verbose` timing summary and the chat's help texts. Pure functions, no I/O."""

from __future__ import annotations

import datetime as dt
import math
from typing import Any, Iterable, Sequence

PADDING = "    "  # between table columns, as Ollama's tablewriter is set up


def human_bytes(n: int) -> str:
    """Decimal units; whole numbers from 10 up ("125 MB"), one decimal below ("4.7 GB")."""
    for unit, scale in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if n >= scale:
            value = n / scale
            if value >= 10 or value == math.trunc(value):
                return f"{int(value)} {unit}"
            return f"{value:.1f} {unit}"
    return f"{n} B"


def human_number(n: int) -> str:
    """A parameter count: "8B", "1.5B", "19.54M", "125K"."""
    if n >= 10**9:
        value = n / 10**9
        return f"{value:.0f}B" if value == math.floor(value) else f"{value:.1f}B"
    if n >= 10**6:
        value = n / 10**6
        return f"{value:.0f}M" if value == math.floor(value) else f"{value:.2f}M"
    if n >= 10**3:
        return f"{n / 10**3:.0f}K"
    return str(n)


def _human_duration(seconds: float) -> str:
    s = int(seconds)
    if s < 1:
        return "Less than a second"
    if s == 1:
        return "1 second"
    if s < 60:
        return f"{s} seconds"
    minutes = int(seconds / 60)
    if minutes == 1:
        return "About a minute"
    if minutes < 60:
        return f"{minutes} minutes"
    hours = round(seconds / 3600)
    if hours == 1:
        return "About an hour"
    if hours < 48:
        return f"{hours} hours"
    if hours < 24 * 7 * 2:
        return f"{hours // 24} days"
    if hours < 24 * 30 * 2:
        return f"{hours // 24 // 7} weeks"
    if hours < 24 * 365 * 2:
        return f"{hours // 24 // 30} months"
    return f"{hours // 24 // 365} years"


def parse_time(text: str | None) -> dt.datetime | None:
    """An RFC 3339 time from the API (None when absent or unreadable)."""
    if not text:
        return None
    try:
        t = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    return t if t.tzinfo else t.replace(tzinfo=dt.timezone.utc)


def human_time(t: dt.datetime | None, zero: str = "Never",
               now: dt.datetime | None = None) -> str:
    """ "2 minutes ago", "4 minutes from now", or "Forever" (more than 20 years ahead)."""
    if t is None:
        return zero
    now = now or dt.datetime.now(dt.timezone.utc)
    delta = (now - t).total_seconds()
    if delta < -20 * 365 * 24 * 3600:
        return "Forever"
    if delta < 0:
        return _human_duration(-delta) + " from now"
    return _human_duration(delta) + " ago"


def _decimal(n: int, unit: int) -> str:
    whole, frac = divmod(n, unit)
    if not frac:
        return str(whole)
    digits = len(str(unit)) - 1
    return f"{whole}.{frac:0{digits}d}".rstrip("0")


def go_duration(ns: int) -> str:
    """Nanoseconds as Go's time.Duration prints them: "97.885315ms", "2m43.589481292s"."""
    ns = int(ns)
    if ns == 0:
        return "0s"
    sign, ns = ("-", -ns) if ns < 0 else ("", ns)
    if ns < 1_000:
        return f"{sign}{ns}ns"
    if ns < 1_000_000:
        return f"{sign}{_decimal(ns, 1_000)}µs"
    if ns < 1_000_000_000:
        return f"{sign}{_decimal(ns, 1_000_000)}ms"
    hours, rest = divmod(ns, 3600 * 10**9)
    minutes, rest = divmod(rest, 60 * 10**9)
    text = _decimal(rest, 10**9) + "s"
    if hours:
        return f"{sign}{hours}h{minutes}m{text}"
    return f"{sign}{minutes}m{text}" if minutes else sign + text


def table(rows: Iterable[Sequence[str]], header: Sequence[str] | None = None) -> str:
    """Left-aligned columns separated by four spaces, no borders (lines end without blanks)."""
    all_rows = ([list(header)] if header else []) + [list(r) for r in rows]
    if not all_rows:
        return ""
    ncols = max(len(r) for r in all_rows)
    widths = [max((len(r[i]) for r in all_rows if i < len(r)), default=0) for i in range(ncols)]
    lines = [PADDING.join(cell.ljust(widths[i]) for i, cell in enumerate(r)).rstrip()
             for r in all_rows]
    return "\n".join(lines) + "\n"


# -- command outputs ------------------------------------------------------------------------

def models_table(tags: dict[str, Any], prefix: str = "") -> str:
    """`mlxr list`: NAME, ID, SIZE, MODIFIED."""
    rows = [[m["name"], m.get("digest", "")[:12], human_bytes(m.get("size", 0)),
             human_time(parse_time(m.get("modified_at")))]
            for m in tags.get("models", []) if m["name"].lower().startswith(prefix.lower())]
    return table(rows, ["NAME", "ID", "SIZE", "MODIFIED"])


def processor(size: int, size_vram: int) -> str:
    if size_vram == 0:
        return "100% CPU"
    if size_vram == size:
        return "100% GPU"
    if size_vram > size or size == 0:
        return "Unknown"
    cpu = round((size - size_vram) / size * 100)
    return f"{cpu}%/{100 - cpu}% CPU/GPU"


def running_table(ps: dict[str, Any], prefix: str = "",
                  now: dt.datetime | None = None) -> str:
    """`mlxr ps`: NAME, ID, SIZE, PROCESSOR, CONTEXT, UNTIL."""
    now = now or dt.datetime.now(dt.timezone.utc)
    rows = []
    for m in ps.get("models", []):
        if not m["name"].startswith(prefix):
            continue
        expires = parse_time(m.get("expires_at"))
        until = "Stopping..." if expires and expires < now else human_time(expires, now=now)
        rows.append([m["name"], m.get("digest", "")[:12], human_bytes(m.get("size", 0)),
                     processor(m.get("size", 0), m.get("size_vram", 0)),
                     str(m.get("context_length", "")), until])
    return table(rows, ["NAME", "ID", "SIZE", "PROCESSOR", "CONTEXT", "UNTIL"])


def _number(value: Any) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return "" if value is None else str(value)


def _head(text: str, n: int) -> list[list[str]]:
    lines = [x.strip() for x in text.splitlines() if x.strip()]
    rows = [["", x] for x in lines[:n]]
    return rows + ([["", "..."]] if len(lines) > n else [])


def show_info(resp: dict[str, Any], verbose: bool = False) -> str:
    """`mlxr show MODEL`: the Model, Capabilities, Parameters, System and License sections."""
    sections: list[str] = []

    def section(title: str, rows: list[list[str]]) -> None:
        sections.append(f"  {title}\n" + table(rows) + "\n")

    info, details = resp.get("model_info") or {}, resp.get("details") or {}
    arch = info.get("general.architecture")
    if arch:
        rows = [["", "architecture", str(arch)]]
        if info.get("general.parameter_count"):
            rows.append(["", "parameters", human_number(int(info["general.parameter_count"]))])
        for label, key in (("context length", "context_length"),
                           ("embedding length", "embedding_length")):
            if f"{arch}.{key}" in info:
                rows.append(["", label, _number(info[f"{arch}.{key}"])])
    else:
        rows = [["", "architecture", details.get("family", "")],
                ["", "parameters", details.get("parameter_size", "")]]
    rows.append(["", "quantization", details.get("quantization_level", "")])
    if info.get("general.description"):  # e.g. the demo: "random test model: ..."
        rows.append(["", "description", str(info["general.description"])])
    section("Model", rows)
    if resp.get("capabilities"):
        section("Capabilities", [["", c] for c in resp["capabilities"]])
    if resp.get("parameters"):
        section("Parameters", [[""] + line.split() for line in resp["parameters"].splitlines()
                               if line.strip()])
    if verbose and info:
        section("Metadata", [["", k, _metadata_value(info[k])] for k in sorted(info)])
    if resp.get("system"):
        section("System", _head(resp["system"], 2))
    if resp.get("license"):
        section("License", _head(resp["license"], 2))
    return "".join(sections)


def _metadata_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        shown = value[:3]
        more = f" ...+{len(value) - 3} more" if len(value) > 3 else ""
        return "[" + " ".join(str(v) for v in shown) + more + "]"
    return _number(value)


def metrics_summary(final: dict[str, Any]) -> str:
    """`--verbose`: the timings of a finished reply, as Ollama prints them."""
    out = []
    if final.get("total_duration"):
        out.append(f"total duration:       {go_duration(final['total_duration'])}")
    if final.get("load_duration"):
        out.append(f"load duration:        {go_duration(final['load_duration'])}")
    count = final.get("prompt_eval_count") or 0
    if count:
        out.append(f"prompt eval count:    {count} token(s)")
    if final.get("prompt_eval_duration"):
        ns = final["prompt_eval_duration"]
        out.append(f"prompt eval duration: {go_duration(ns)}")
        out.append(f"prompt eval rate:     {count / (ns / 1e9):.2f} tokens/s")
    count = final.get("eval_count") or 0
    if count:
        out.append(f"eval count:           {count} token(s)")
    if final.get("eval_duration"):
        ns = final["eval_duration"]
        out.append(f"eval duration:        {go_duration(ns)}")
        out.append(f"eval rate:            {count / (ns / 1e9):.2f} tokens/s")
    return "".join(line + "\n" for line in out)


# -- the interactive chat's help ---------------------------------------------------------

USAGE = """Available Commands:
  /set            Set session variables
  /show           Show model information
  /load <model>   Load a session or model
  /save <model>   Save your current session
  /clear          Clear session context
  /bye            Exit
  /?, /help       Help for a command
  /? shortcuts    Help for keyboard shortcuts

Use \"\"\" to begin a multi-line message.
"""
USAGE_SET = """Available Commands:
  /set parameter ...     Set a parameter
  /set system <string>   Set system message
  /set format json       Enable JSON mode
  /set noformat          Disable formatting
  /set verbose           Show LLM stats
  /set quiet             Disable LLM stats
  /set think             Enable thinking
  /set nothink           Disable thinking
"""
USAGE_SHOW = """Available Commands:
  /show info         Show details for this model
  /show license      Show model license
  /show modelfile    Show Modelfile for this model
  /show parameters   Show parameters for this model
  /show system       Show system message
  /show template     Show prompt template
"""
USAGE_PARAMETERS = """Available Parameters:
  /set parameter seed <int>             Random number seed
  /set parameter num_predict <int>      Max number of tokens to predict
  /set parameter top_k <int>            Pick from top k num of tokens
  /set parameter top_p <float>          Pick token based on sum of probabilities
  /set parameter min_p <float>          Pick token based on top token probability * min_p
  /set parameter num_ctx <int>          Set the context size
  /set parameter temperature <float>    Set creativity level
  /set parameter repeat_penalty <float> How strongly to penalize repetitions
  /set parameter repeat_last_n <int>    Set how far back to look for repetitions
  /set parameter stop <string> <string> ...   Set the stop parameters
"""
USAGE_SHORTCUTS = """Available keyboard shortcuts:
  Ctrl + a            Move to the beginning of the line (Home)
  Ctrl + e            Move to the end of the line (End)
  Ctrl + k            Delete the sentence after the cursor
  Ctrl + u            Delete the sentence before the cursor
  Ctrl + w            Delete the word before the cursor

  Ctrl + l            Clear the screen
  Ctrl + c            Stop the model from responding
  Ctrl + d            Exit mlxr (/bye)
"""
