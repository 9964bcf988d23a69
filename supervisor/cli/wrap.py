"""Word wrapping of a streamed reply on a terminal, as `ollama run` wraps it (--nowordwrap and
`/set nowordwrap` turn it off). State is kept across chunks, so a word split over two chunks
still moves as one."""

from __future__ import annotations

import os
import unicodedata
from typing import TextIO


def _char_width(ch: str) -> int:
    return 2 if unicodedata.east_asian_width(ch) in ("W", "F") else 1


class WordWrapper:
    """Ollama's displayResponse: a line is broken before it reaches the terminal's width less
    5; the word being written moves to the next line (erased with ANSI codes), unless it is
    longer than the width less 10, which is broken where it is."""

    def __init__(self, width: int):
        self.width, self.line_len, self.word = width, 0, ""

    def __call__(self, text: str) -> str:
        if self.width < 10:  # too narrow to wrap (Ollama's limit too)
            return text
        out: list[str] = []
        for ch in text:
            w = _char_width(ch)
            if ch in "\r\n":
                out.append(ch)
                self.line_len, self.word = 0, ""
                continue
            if self.line_len + w > self.width - 5:
                word_w = sum(map(_char_width, self.word))
                if ch in " \t":
                    out.append("\n")
                    self.line_len, self.word = 0, ""
                    continue
                if self.word and word_w <= self.width - 10:
                    out.append(f"\x1b[{word_w}D\x1b[K\n{self.word}")
                    self.line_len = word_w
                else:
                    out.append("\n")
                    self.line_len, self.word = 0, ""
            out.append(ch)
            self.line_len += w
            self.word = "" if ch in " \t" or w == 2 else self.word + ch
        return "".join(out)


def terminal_width(out: TextIO) -> int:
    try:
        return os.get_terminal_size(out.fileno()).columns or 80
    except (OSError, ValueError, AttributeError):
        return 80
