"""Test images, made in memory with Pillow: noise of a given seed, in any format."""

from __future__ import annotations

import base64
import io

import numpy as np
from PIL import Image


def noise(seed: int, width: int = 80, height: int = 64) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray((rng.random((height, width, 3)) * 255).astype("uint8"))


def encoded(img: Image.Image, fmt: str = "PNG", **kwargs) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kwargs)
    return buf.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{b64(data)}"


def animated_gif(first: Image.Image, second: Image.Image) -> bytes:
    buf = io.BytesIO()
    first.convert("P").save(buf, format="GIF", save_all=True,
                            append_images=[second.convert("P")], duration=100, loop=0)
    return buf.getvalue()
