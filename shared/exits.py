"""A process's exit status in words: a signal is named, never shown as a negative code."""

from __future__ import annotations

import signal


def describe_exit(returncode: int) -> str:
    """"exited with code 1", or "was killed by SIGILL (illegal instruction)" for -4."""
    if returncode >= 0:
        return f"exited with code {returncode}"
    number = -returncode
    try:
        name = signal.Signals(number).name
    except ValueError:
        return f"was killed by signal {number}"
    words = (signal.strsignal(number) or "").lower()
    return f"was killed by {name} ({words})" if words else f"was killed by {name}"
