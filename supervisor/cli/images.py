"""Image paths in a prompt typed to `mlxr run` with a vision model, read the way `ollama run`
reads them: a path that starts with `/`, `./`, `../` or `~/` (spaces escaped with a backslash, or
the whole path in quotes) and ends in .jpg, .jpeg, .png, .webp or .gif names an image when the
file exists. Each found image is taken out of the text and sent as base64 in `images`."""

from __future__ import annotations

import base64
import re
from pathlib import Path

EXTENSIONS = ("jpg", "jpeg", "png", "webp", "gif")
_EXT = "|".join(EXTENSIONS)
_PATH = re.compile(
    rf"""(?P<q>["'])(?P<quoted>(?:/|\./|\.\./|~/)[^"']+?\.(?:{_EXT}))(?P=q)"""
    rf"""|(?P<bare>(?:/|\./|\.\./|~/)(?:\\ |[^\s"'])+?\.(?:{_EXT}))(?=\s|$)""",
    re.IGNORECASE)


def take_images(text: str) -> tuple[str, list[str], list[Path]]:
    """(the text without the image paths, the images as base64, the files read)."""
    images: list[str] = []
    files: list[Path] = []

    def replace(match: re.Match) -> str:
        raw = match.group("quoted") or match.group("bare").replace("\\ ", " ")
        path = Path(raw).expanduser()
        if not path.is_file():
            return match.group(0)
        images.append(base64.b64encode(path.read_bytes()).decode())
        files.append(path)
        return ""

    rest = _PATH.sub(replace, text)
    return " ".join(rest.split()) if files else text, images, files
