"""A request's images, made ready for the runner: each one base64 data, checked.

The API layers hand over images in Ollama's shape (base64 strings; `data:` URLs already cut
to their data by the OpenAI, Anthropic and Responses parsers, or left whole, which is read here
too). An http(s) URL is refused with a 400 unless MLXR_ALLOW_IMAGE_URLS is set; then it is
fetched, bounded by MAX_IMAGE_BYTES and FETCH_TIMEOUT_S. Every image is decoded once here
(shared/images.py, in a thread), so a corrupt, oversized or unsupported image is a 400 before
a runner is loaded for it.
"""

from __future__ import annotations

import asyncio
import base64

import httpx

from mlxr.shared.errors import InvalidRequest
from mlxr.shared.images import MAX_IMAGE_BYTES, decode_base64_image, image_base64, is_remote

FETCH_TIMEOUT_S = 10.0
MAX_IMAGES = 16  # per request


async def ready_images(images: list[str], allow_urls: bool) -> list[str]:
    if len(images) > MAX_IMAGES:
        raise InvalidRequest(f"too many images: {len(images)} (at most {MAX_IMAGES})")
    out = []
    for i, value in enumerate(images):
        what = f"image {i}"
        if is_remote(value):
            if not allow_urls:
                raise InvalidRequest(f"{what}: image URLs are not fetched; send the image as "
                                     "base64 data or a data: URL (or start the server with "
                                     "MLXR_ALLOW_IMAGE_URLS=1)")
            value = base64.b64encode(await _fetch(value, what)).decode()
        else:
            value = image_base64(value, what)
        await asyncio.to_thread(decode_base64_image, value, what)
        out.append(value)
    return out


async def _fetch(url: str, what: str) -> bytes:
    try:
        async with httpx.AsyncClient(timeout=FETCH_TIMEOUT_S, follow_redirects=True) as client:
            async with client.stream("GET", url) as resp:
                if resp.status_code != 200:
                    raise InvalidRequest(f"{what}: fetching {url} gave HTTP {resp.status_code}")
                body = bytearray()
                async for chunk in resp.aiter_bytes():
                    body += chunk
                    if len(body) > MAX_IMAGE_BYTES:
                        raise InvalidRequest(f"{what} is larger than "
                                             f"{MAX_IMAGE_BYTES >> 20} MiB")
                return bytes(body)
    except httpx.HTTPError as exc:
        raise InvalidRequest(f"{what}: could not fetch {url}: {exc}") from None
