"""A real headless Chromium (Debian's, installed by scripts/system-deps.sh --test), driven by
Playwright's Python package, which brings its own driver: no browser is downloaded."""

from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from playwright.sync_api import Browser, Page, sync_playwright

# Chromium tries to reach Google's services at start-up; this machine's network refuses them.
QUIET_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
               "--disable-background-networking", "--disable-component-update", "--disable-sync",
               "--disable-dev-shm-usage"]


def chromium_path() -> str:
    for candidate in (os.environ.get("MLXR_CHROMIUM"), "/usr/bin/chromium",
                      shutil.which("chromium"), shutil.which("chromium-browser")):
        if candidate and Path(candidate).exists():
            return candidate
    raise RuntimeError("no chromium found: `make test` installs Debian's (scripts/system-deps.sh "
                       "--test); elsewhere set MLXR_CHROMIUM to a Chromium or Chrome binary")


@contextmanager
def chromium() -> Iterator[Browser]:
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium_path(), args=QUIET_FLAGS)
        try:
            yield browser
        finally:
            browser.close()


def watch_errors(page: Page) -> list[str]:
    """Script errors and failed loads the page reports, collected as they happen."""
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(f"page error: {exc}"))
    page.on("console", lambda msg: errors.append(f"console: {msg.text}")
            if msg.type == "error" else None)
    return errors
