"""The secret that every request to a runner carries, so that no other local process can use
a runner's loopback port (and step around MLXR_API_KEY).

The supervisor makes one secret per runner and writes it as the first line of the runner's
stdin (never argv, which `ps` shows to every user). A runner started by hand reads it from a
file (`--token-file`), or makes one and writes it to a new private file. Requests carry it as
`Authorization: Bearer <secret>`, or as the password of HTTP basic auth (any user name), so
that `curl -u :SECRET` and `http://:SECRET@127.0.0.1:PORT` work by hand.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import os
import secrets
import tempfile
from pathlib import Path
from typing import BinaryIO

TOKEN_BYTES = 32


def make_token() -> str:
    return secrets.token_urlsafe(TOKEN_BYTES)


def auth_header(token: str) -> str:
    """The `Authorization` header value that carries `token`."""
    return f"Bearer {token}"


class TokenCheck:
    """Compares a request's `Authorization` header with the secret in constant time."""

    def __init__(self, token: str):
        if not token:
            raise ValueError("a runner token must not be empty")
        self._bearer = auth_header(token).encode()
        self._token = token.encode()

    def __call__(self, header: str | None) -> bool:
        given = (header or "").encode(errors="replace")
        if given[:6].lower() == b"basic ":
            try:
                _, _, password = base64.b64decode(given[6:].strip(), validate=True).partition(b":")
            except (binascii.Error, ValueError):
                return False
            return hmac.compare_digest(password, self._token)
        return hmac.compare_digest(given, self._bearer)


def read_token_line(stream: BinaryIO) -> str | None:
    """The first line of `stream` (the runner's stdin); None at end of input (the supervisor
    went away before writing it)."""
    line = stream.readline()
    if not line.endswith(b"\n"):
        return None
    token = line.decode(errors="replace").strip()
    return token or None


def token_from_file(path: Path) -> str:
    """The secret in `path`; a missing file is created (mode 0600) with a fresh secret."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        token = path.read_text().strip()
        if not token:
            raise ValueError(f"token file {path} is empty") from None
        return token
    token = make_token()
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token


def new_token_file() -> tuple[str, Path]:
    """A fresh secret in a new file only this user can read (in a new 0700 directory)."""
    directory = Path(tempfile.mkdtemp(prefix="mlxr-runner-"))
    path = directory / "token"
    return token_from_file(path), path
