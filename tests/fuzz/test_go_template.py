"""The Go template parser and renderer against hostile templates (a request's `template`, a
Modelfile's TEMPLATE): generated sources either render or are a TemplateError (a 400), and
the limits hold: nesting, steps (however the loops are built) and output size are bounded,
so the worst template is refused within seconds."""

from __future__ import annotations

import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mlxr.shared.errors import InvalidRequest
from mlxr.supervisor.api.body import parse_chat
from mlxr.supervisor.inference.go_template.parse import MAX_NESTING, TemplateError, parse
from mlxr.supervisor.inference.go_template.render import GoTemplate, Limits
from tests.fuzz import strategies as s

DATA = {"System": "sys", "Prompt": "hello", "Response": "", "Think": True,
        "Messages": [{"role": "user", "content": "hi"},
                     {"role": "assistant", "content": "", "tool_calls": [
                         {"function": {"name": "f", "arguments": {"a": [1, 2]}}}]}],
        "Tools": [{"type": "function", "function": {"name": "f"}}], "N": 3, "M": {"k": "v"}}
# A budget for the worst templates here: the defaults' bound, with room for a loaded machine.
WORST_S = 10.0

# Templates from a small grammar of the subset (so most of them run), and with bad pieces
# dropped in anywhere (so the parser's errors are reached too).
VALUES = [".", ".Prompt", ".Messages", ".M", ".M.k", ".N", ".Missing.Deep", "$", "$.Tools",
          "1", "-2", "2.5", "1e999", '"s"', '"\\x41\\u00e9"', "`raw`", "'a'", "true", "nil",
          ".Prompt.__class__"]
FUNCS = ["and", "or", "not", "eq", "ne", "lt", "le", "gt", "ge", "len", "index", "slice",
         "print", "printf", "println", "html", "json", "currentDate"]
EXPR = st.recursive(
    st.sampled_from(VALUES),
    lambda inner: st.one_of(
        st.tuples(st.sampled_from(FUNCS), st.lists(inner, min_size=1, max_size=3)).map(
            lambda t: f"({t[0]} {' '.join(t[1])})"),
        st.tuples(inner, st.sampled_from(FUNCS)).map(lambda t: f"{t[0]} | {t[1]}")),
    max_leaves=5)
BLOCKS = st.recursive(
    st.one_of(st.text(max_size=4), EXPR.map(lambda e: "{{ " + e + " }}"),
              EXPR.map(lambda e: "{{- $x := " + e + " -}}"),
              st.sampled_from(["{{ $x }}", "{{ break }}", "{{ continue }}", "{{/* c */}}"])),
    lambda inner: st.one_of(
        st.tuples(st.sampled_from(["if", "with", "range", "range $i, $e :="]), EXPR,
                  inner, st.none() | inner).map(
            lambda t: f"{{{{ {t[0]} {t[1]} }}}}{t[2]}"
                      + ("" if t[3] is None else f"{{{{ else }}}}{t[3]}") + "{{ end }}"),
        st.lists(inner, min_size=2, max_size=3).map("".join)),
    max_leaves=8)
BAD = st.sampled_from(["{{", "}}", "{{ end }}", "{{ else }}", "{{ if }}", "{{ ( }}", '{{ "',
                       "{{ define }}", "{{ nope 1 }}", "{{ 1" + "1" * 5000 + " }}",
                       '{{ "\\ud800" }}', "{{ 'ab' }}", "{{ $y = 1 }}", "{{ .A | 1 }}"])
SOURCES = st.one_of(BLOCKS, st.tuples(BLOCKS, BAD, st.integers(0, 200)).map(
    lambda t: t[0][:t[2]] + t[1] + t[0][t[2]:]))


def renders_or_refuses(source: str, data: dict, limits: Limits = Limits()) -> str | None:
    try:
        return GoTemplate(source, limits).render(data)
    except InvalidRequest as err:
        assert err.status == 400 and err.message.startswith("template")
        return None


@s.SETTINGS
@given(source=SOURCES)
def test_any_template_renders_or_is_a_400(source):
    out = renders_or_refuses(source, DATA)
    assert out is None or isinstance(out, str)
    assert out is None or "<class" not in out  # no Python attribute reaches the output


@s.SETTINGS
@given(source=SOURCES, messages=st.lists(s.OLLAMA_MESSAGE, max_size=3))
def test_any_template_executes_a_chat_or_is_a_400(source, messages):
    """With the messages a chat request's checks let through."""
    try:
        messages = parse_chat({"model": "m", "messages": messages}).messages
        GoTemplate(source).execute(messages, tools=[{"function": {"name": "f"}}], prompt="p")
    except InvalidRequest as err:
        assert err.status == 400


# -- the limits --------------------------------------------------------------------------------

def refused_in_time(source: str, match: str, data: dict | None = None,
                    limits: Limits = Limits(), within_s: float = WORST_S) -> None:
    started = time.monotonic()
    with pytest.raises(TemplateError, match=match):
        GoTemplate(source, limits).render(DATA if data is None else data)
    assert time.monotonic() - started < within_s


BIG = {**DATA, "L": list(range(200_000))}
LOOPS = [
    "{{ range 1000000000 }}x{{ end }}",
    "{{ range 1000 }}{{ range 1000 }}{{ range 1000 }}{{ end }}{{ end }}{{ end }}",
    "{{ range $i, $m := 100000000 }}{{ if eq $i -1 }}{{ break }}{{ end }}{{ end }}",
    # one action of many operands is many steps, not one
    "{{ range 100000000 }}{{ print " + " ".join(["$.Prompt"] * 2000) + " }}{{ end }}",
    # a call's cost grows with what it reads and makes
    "{{ range 100000000 }}{{ $x := json $.L }}{{ $y := slice $.L 1 }}{{ end }}",
]


@pytest.mark.parametrize("source", [LOOPS[0], LOOPS[-1]])
def test_long_loops_are_refused_in_seconds(source):
    """With the default limits, as a request gets them."""
    refused_in_time(source, "steps", BIG)


@pytest.mark.parametrize("source", LOOPS)
def test_every_kind_of_loop_counts_its_steps(source):
    """A twentieth of the default steps takes a twentieth of the time, whatever the loop."""
    refused_in_time(source, "steps", BIG, Limits(max_steps=50_000), within_s=WORST_S / 10)


@pytest.mark.parametrize("source", [
    '{{ $x := "ab" }}' + "{{ $x = print $x $x }}" * 40,  # doubling: 2**41 characters
    "{{ range 100000 }}{{ $.Big }}{{ end }}",
])
def test_huge_output_is_refused_before_it_is_made(source):
    refused_in_time(source, "output longer|steps", {**DATA, "Big": "x" * 100_000})


def test_nesting_is_bounded():
    parse("{{ if . }}" * MAX_NESTING + "{{ end }}" * MAX_NESTING)
    for source in ["{{ if . }}" * (MAX_NESTING + 1) + "{{ end }}" * (MAX_NESTING + 1),
                   "{{ if . }}" * 100_000,
                   "{{ if . }}{{ else if . }}" * (MAX_NESTING + 1),
                   "{{ " + "(" * 100_000 + " }}"]:
        with pytest.raises(TemplateError, match="nested deeper"):
            parse(source)


def test_small_limits():
    with pytest.raises(TemplateError, match="more than 100 steps"):
        GoTemplate("{{ range 1000 }}{{ end }}", Limits(max_steps=100)).render({})
    with pytest.raises(TemplateError, match="longer than 10 characters"):
        GoTemplate("{{ range 5 }}abc{{ end }}", Limits(max_output_chars=10)).render({})
    assert GoTemplate("{{ range 3 }}abc{{ end }}", Limits(max_output_chars=10)).render({}) \
        == "abcabcabc"
    # a function's result counts before it is written anywhere
    doubling = '{{ $x := "ab" }}' + "{{ $x = print $x $x }}" * 40
    with pytest.raises(TemplateError, match="longer than 1000 characters"):
        GoTemplate(doubling, Limits(max_steps=10**9, max_output_chars=1000)).render({})


def test_the_turns_of_a_legacy_template_share_one_budget():
    """A template without .Messages renders once per turn: the limit is the whole prompt's."""
    turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": str(i)}
             for i in range(40)]
    legacy = GoTemplate("{{ range 10 }}{{ end }}{{ .Prompt }}{{ .Response }}",
                        Limits(max_steps=200))
    with pytest.raises(TemplateError, match="steps"):
        legacy.execute(turns)
    assert legacy.execute(turns[:4])


def test_a_long_chat_fits_the_default_limits():
    """Ollama's own idiom (`slice $.Messages $i` per message) over 5,000 messages."""
    template = ("{{- range $i, $_ := .Messages }}{{- $last := eq (len (slice $.Messages $i)) 1 }}"
                "{{ if eq .Role \"user\" }}U:{{ .Content }}{{ else }}A:{{ .Content }}{{ end }}"
                "{{ if $last }}!{{ end }}{{ end }}")
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i}"}
                for i in range(5000)]
    out = GoTemplate(template).execute(messages)
    assert out.startswith("U:m0A:m1") and out.endswith("A:m4999!")


@pytest.mark.parametrize("source,expected", [
    # each was a ValueError, TypeError, OverflowError or RecursionError (a 500) before
    ('{{ "\\ud800" }}', "invalid Unicode"),
    ('{{ "\\q" }}', "unknown escape"),
    ("{{ 1" + "0" * 5000 + " }}", "number too long"),
    ("{{ range 2.5 }}{{ end }}", "can't iterate"),
    ("{{ range true }}{{ end }}", "can't iterate"),
    ('{{ printf "%d" 1e999 }}', "error calling printf"),
    ("{{ index .Messages 1e999 }}", "error calling index"),
    ("{{ 'ab' }}", "unexpected"),
])
def test_malformed_templates_are_400s(source, expected):
    with pytest.raises(TemplateError, match=expected):
        GoTemplate(source).render(DATA)


@pytest.mark.parametrize("source,expected", [
    ('{{ "a\\tb\\x41\\101\\u00e9\\U0001F600\\"" }}', 'a\tbAAé😀"'),
    ("{{ '\\x41' }} {{ 'é' }} {{ '\\n' }}", "65 233 10"),
    ("{{ .Prompt.__class__ }}|{{ .Prompt.upper }}", "|"),  # maps have fields; nothing else
    ("{{ range -3 }}x{{ else }}none{{ end }}{{ range 2 }}{{ . }}{{ end }}", "none01"),
])
def test_literals_and_fields(source, expected):
    assert GoTemplate(source).render(DATA) == expected
