"""Images as requests carry them: base64 (Ollama's `images`) or `data:` URLs (OpenAI,
Anthropic), decoded with Pillow. Both sides use this: the supervisor decodes each image once to
refuse a corrupt, oversized or unsupported one with a 400 before any runner sees it; the runner
decodes the same bytes again for the processor.

Limits: at most MAX_IMAGE_BYTES of encoded data and MAX_IMAGE_PIXELS pixels (checked from the
header, before the pixels are decoded: a small file that expands to a huge image is refused
without being expanded). An animated GIF gives its first frame. Every image leaves here in RGB.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
from dataclasses import dataclass
from typing import Any

from mlxr.shared.errors import InvalidRequest

MAX_IMAGE_BYTES = 20 << 20
MAX_IMAGE_PIXELS = 40_000_000
FORMATS = ("JPEG", "PNG", "WEBP", "GIF")
DATA_URL_PREFIX = "data:"


@dataclass(frozen=True, slots=True)
class DecodedImage:
    image: Any  # PIL.Image.Image, RGB
    digest: str  # SHA-256 of the encoded bytes, hex
    format: str


def image_base64(value: str, what: str = "image") -> str:
    """The base64 data of `value`, a base64 string or a `data:image/...;base64,` URL. An
    http(s) URL is the caller's to fetch or refuse (see `is_remote`)."""
    if value.startswith(DATA_URL_PREFIX):
        head, sep, data = value.partition(",")
        if not sep or ";base64" not in head or not head[5:].startswith("image/"):
            raise InvalidRequest(f"{what}: a data URL must be data:image/<type>;base64,<data>")
        return data
    return value


def is_remote(value: str) -> bool:
    return value.startswith(("http://", "https://"))


def image_bytes(data: str, what: str = "image") -> bytes:
    if len(data) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise InvalidRequest(f"{what} is larger than {MAX_IMAGE_BYTES >> 20} MiB")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequest(f"{what} is not valid base64 data") from None
    if not raw:
        raise InvalidRequest(f"{what} is empty")
    return raw


def decode_image(raw: bytes, what: str = "image") -> DecodedImage:
    """Open and check an encoded image; its first frame in RGB."""
    from PIL import Image, UnidentifiedImageError

    if len(raw) > MAX_IMAGE_BYTES:
        raise InvalidRequest(f"{what} is larger than {MAX_IMAGE_BYTES >> 20} MiB")
    try:
        img = Image.open(io.BytesIO(raw))
    except (UnidentifiedImageError, OSError, ValueError):
        raise InvalidRequest(f"{what} is not a JPEG, PNG, WebP or GIF image") from None
    if img.format not in FORMATS:
        raise InvalidRequest(f"{what}: {img.format} images are not supported "
                             f"(JPEG, PNG, WebP or GIF)")
    width, height = img.size
    if width < 1 or height < 1 or width * height > MAX_IMAGE_PIXELS:
        raise InvalidRequest(f"{what} is {width}x{height}: at most "
                             f"{MAX_IMAGE_PIXELS:,} pixels are accepted")
    try:
        img.seek(0)
        rgb = img.convert("RGB")
        rgb.load()
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError):
        raise InvalidRequest(f"{what} is corrupt or truncated") from None
    return DecodedImage(rgb, hashlib.sha256(raw).hexdigest(), img.format)


def decode_base64_image(value: str, what: str = "image") -> DecodedImage:
    return decode_image(image_bytes(image_base64(value, what), what), what)
