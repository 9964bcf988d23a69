"""`mlxr run`'s flags as cobra parses Ollama's (`--think` / `--truncate` take a value only
with `=`), and the word wrapper that `ollama run` applies on a terminal."""

from __future__ import annotations

import click
import click.testing
import pytest

from mlxr.supervisor.cli.client import CliError
from mlxr.supervisor.cli.run import RunCommand, infer_think, think_value, truncate_value
from mlxr.supervisor.cli.wrap import WordWrapper


@click.command(cls=RunCommand)
@click.argument("words", nargs=-1)
@click.option("--think")
@click.option("--truncate")
def probe(words, think, truncate):
    click.echo(repr((words, think, truncate)))


@pytest.mark.parametrize("args, parsed", [
    (["--think", "high", "hi"], (("high", "hi"), "true", None)),
    (["--think=high", "hi"], (("hi",), "high", None)),
    (["hi", "--truncate"], (("hi",), None, "true")),
    (["--truncate=false", "hi"], (("hi",), None, "false")),
    (["--", "--think"], (("--think",), None, None)),
])
def test_bare_think_and_truncate_mean_true(args, parsed):
    result = click.testing.CliRunner().invoke(probe, args)
    assert result.output.strip() == repr(parsed)


def test_think_and_truncate_values():
    assert [think_value(v) for v in ("true", "false", "high", "max", None)] == \
        [True, False, "high", "max", None]
    with pytest.raises(CliError, match='invalid value for --think: "maybe"'):
        think_value("maybe")
    assert [truncate_value(v) for v in ("t", "FALSE", "0", None)] == [True, False, False, None]
    with pytest.raises(CliError, match='invalid argument "no"'):
        truncate_value("no")


def test_a_thinking_model_thinks_unless_told():
    assert infer_think(None, ["completion", "thinking"]) is True
    assert infer_think(False, ["completion", "thinking"]) is False
    assert infer_think(None, ["completion"]) is None


def visible(raw: str) -> list[str]:
    lines = [""]
    i = 0
    while i < len(raw):
        if raw.startswith("\x1b[", i):
            end = raw.index("K", i) if raw[i:].startswith("\x1b[K") else raw.index("D", i)
            if raw[end] == "D":
                lines[-1] = lines[-1][:-int(raw[i + 2:end])]
            i = end + 1
        elif raw[i] == "\n":
            lines.append("")
            i += 1
        else:
            lines[-1] += raw[i]
            i += 1
    return lines


def test_words_move_to_the_next_line_across_chunks():
    wrap = WordWrapper(20)  # lines of at most 15 columns
    text = "the quick brown fox jumps over the lazy dog"
    raw = "".join(wrap(chunk) for chunk in ("the qu", "ick brown fox ju",
                                            "mps over the lazy dog"))
    assert visible(raw) == ["the quick brown", "fox jumps over ", "the lazy dog"]
    assert "".join(visible(raw)).replace(" ", "") == text.replace(" ", "")


def test_a_word_longer_than_the_line_is_broken_and_wide_characters_count_twice():
    assert visible(WordWrapper(20)("a" * 20)) == ["a" * 15, "a" * 5]
    assert visible(WordWrapper(20)("語" * 10)) == ["語" * 7, "語" * 3]
    assert WordWrapper(8)("no wrapping on a very narrow terminal") == \
        "no wrapping on a very narrow terminal"
