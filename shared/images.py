"""Images as requests carry them: base64 (Ollama's `images`) or `data:` URLs (OpenAI,
Anthropic), decoded with Pillow. Both sides use this: the supervisor decodes each image once to
refuse a corrupt, oversized or unsupported one with a 400 before any runner sees it; the runner
decodes the same bytes again for the processor.

Limits: at most MAX_IMAGE_BYTES of encoded data and MAX_IMAGE_PIXELS pixels (checked from the
header, before the pixels are decoded: a small file that expands to a huge image is refused
without being expanded). An animated GIF gives its first frame. Every image leaves here in RGB,
transparent pixels over white as transformers' processors put them.
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


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n:,} bytes"


def image_bytes(data: str, what: str = "image") -> bytes:
    if len(data) > MAX_IMAGE_BYTES * 4 // 3 + 4 + len(data) // 76 * 2:
        raise InvalidRequest(f"{what} is larger than {_size(MAX_IMAGE_BYTES)}")
    # Line breaks are skipped, as Go's decoder (Ollama's) skips them.
    data = data.replace("\r", "").replace("\n", "")
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
        raise InvalidRequest(f"{what} is larger than {_size(MAX_IMAGE_BYTES)}")
    try:
        img = Image.open(io.BytesIO(raw))
    except Image.DecompressionBombError:  # Pillow's own check, past twice its pixel limit
        raise InvalidRequest(f"{what} is larger than {MAX_IMAGE_PIXELS:,} pixels") from None
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
        rgb = _to_rgb(img)
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError):
        raise InvalidRequest(f"{what} is corrupt or truncated") from None
    return DecodedImage(rgb, hashlib.sha256(raw).hexdigest(), img.format)


def _to_rgb(img):
    """RGB pixels as transformers' processors see them: transparency over white, 16- and
    32-bit greyscale scaled (not clipped) to 8 bits."""
    from PIL import Image

    if img.mode in ("I;16", "I;16B", "I;16L", "I"):
        import numpy as np

        wide = np.asarray(img, dtype=np.float64)
        top = 65535.0 if img.mode.startswith("I;16") or wide.max() > 255 else 255.0
        img = Image.fromarray(np.clip(wide / top * 255.0 + 0.5, 0, 255).astype(np.uint8))
    if img.mode == "P" and "transparency" in img.info:
        img = img.convert("RGBA")
    if img.mode in ("RGBA", "LA", "PA"):
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        img = Image.alpha_composite(white, rgba)
    rgb = img.convert("RGB")
    rgb.load()
    return rgb


def decode_base64_image(value: str, what: str = "image") -> DecodedImage:
    return decode_image(image_bytes(image_base64(value, what), what), what)
