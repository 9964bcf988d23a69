"""Image decoding as both processes do it (shared/images.py): base64 and data: URLs in, an RGB
first frame out, and every bad image a 400 (InvalidRequest) rather than a crash."""

from __future__ import annotations

import hashlib
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from mlxr.shared import images
from mlxr.shared.errors import InvalidRequest
from mlxr.shared.images import (decode_base64_image, decode_image, image_base64, image_bytes,
                                is_remote)
from tests.harness.images import animated_gif, b64, data_url, encoded, noise


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header claims `width` x `height` RGB pixels, with no pixel data to speak of:
    what a decompression bomb looks like to the size check."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b""))
            + chunk(b"IEND", b""))


# -- decoding --------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF"])
def test_each_supported_format_decodes_to_rgb_of_its_size(fmt):
    out = decode_image(encoded(noise(1, 80, 64), fmt))
    assert out.format == fmt
    assert out.image.mode == "RGB"
    assert out.image.size == (80, 64)


@pytest.mark.parametrize("fmt", ["PNG", "WEBP"])
def test_lossless_formats_keep_the_pixels(fmt):
    img = noise(2, 16, 12)
    kwargs = {"lossless": True} if fmt == "WEBP" else {}
    out = decode_image(encoded(img, fmt, **kwargs))
    assert np.array_equal(np.asarray(out.image), np.asarray(img))


@pytest.mark.parametrize("mode, colour", [("RGBA", (10, 200, 30, 255)), ("P", 5), ("L", 77)])
def test_rgba_palette_and_greyscale_images_come_out_rgb(mode, colour):
    img = Image.new(mode, (20, 10), colour)
    expected = img.convert("RGB").getpixel((0, 0))
    out = decode_image(encoded(img, "PNG"))
    assert out.image.mode == "RGB"
    assert out.image.size == (20, 10)
    assert out.image.getpixel((3, 4)) == expected
    if mode == "L":
        assert expected == (77, 77, 77)


def test_an_animated_gif_gives_its_first_frame():
    red = Image.new("RGB", (24, 16), (255, 0, 0))
    blue = Image.new("RGB", (24, 16), (0, 0, 255))
    out = decode_image(animated_gif(red, blue))
    assert out.format == "GIF"
    assert out.image.mode == "RGB"
    assert out.image.size == (24, 16)
    assert out.image.getpixel((5, 5)) == (255, 0, 0)
    # and the other order gives the other colour: the frame is the first, not a fixed one
    assert decode_image(animated_gif(blue, red)).image.getpixel((5, 5)) == (0, 0, 255)


def test_digest_is_the_sha256_of_the_encoded_bytes():
    raw = encoded(noise(3), "PNG")
    first, again = decode_image(raw), decode_base64_image(b64(raw))
    assert first.digest == hashlib.sha256(raw).hexdigest()
    assert again.digest == first.digest
    assert decode_image(encoded(noise(4), "PNG")).digest != first.digest


# -- base64 and data: URLs -------------------------------------------------------------------
def test_plain_base64_passes_through_and_decodes():
    raw = encoded(noise(5), "JPEG")
    assert image_base64(b64(raw)) == b64(raw)
    assert image_bytes(b64(raw)) == raw
    assert decode_base64_image(b64(raw)).format == "JPEG"


@pytest.mark.parametrize("mime", ["image/png", "image/jpeg", "image/webp"])
def test_a_data_url_gives_its_data(mime):
    raw = encoded(noise(6), "PNG")
    assert image_base64(data_url(raw, mime)) == b64(raw)
    out = decode_base64_image(data_url(raw, mime))
    assert out.image.size == (80, 64)
    assert out.digest == hashlib.sha256(raw).hexdigest()


@pytest.mark.parametrize("url", [
    "data:image/png," + "iVBORw0KGgo=",  # no ;base64
    "data:text/plain;base64,aGVsbG8=",  # not an image
    "data:;base64,aGVsbG8=",  # no type at all
    "data:image/png;base64",  # no comma, no data
])
def test_a_malformed_data_url_is_refused(url):
    with pytest.raises(InvalidRequest, match="data URL"):
        image_base64(url, "image 0")
    with pytest.raises(InvalidRequest):
        decode_base64_image(url)


def test_remote_urls_are_recognised_and_nothing_else():
    assert is_remote("http://example.com/a.png")
    assert is_remote("https://example.com/a.png")
    assert not is_remote(data_url(b"x"))
    assert not is_remote(b64(encoded(noise(7), "PNG")))
    assert not is_remote("ftp://example.com/a.png")


@pytest.mark.parametrize("data", ["not base64!", "aGVsbG8", "aGVs bG8=", "%%%%"])
def test_invalid_base64_is_refused(data):
    with pytest.raises(InvalidRequest, match="not valid base64"):
        image_bytes(data, "image 3")


def test_the_error_names_the_image():
    with pytest.raises(InvalidRequest, match="^image 3 is not valid base64"):
        decode_base64_image("***", "image 3")


def test_empty_data_is_refused():
    with pytest.raises(InvalidRequest, match="empty"):
        image_bytes("")
    with pytest.raises(InvalidRequest, match="empty"):
        decode_base64_image(data_url(b""))


# -- bad images ------------------------------------------------------------------------------
def test_bytes_that_are_no_image_are_refused():
    with pytest.raises(InvalidRequest, match="not a JPEG, PNG, WebP or GIF"):
        decode_image(b"hello, this is text and not an image at all")


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "GIF"])
def test_a_truncated_image_is_corrupt_or_truncated(fmt):
    raw = encoded(noise(8, 120, 90), fmt)
    with pytest.raises(InvalidRequest, match="corrupt or truncated"):
        decode_image(raw[:len(raw) // 2])


def test_a_truncated_webp_is_refused():
    # Pillow decodes WebP when it opens it, so the message is the "not an image" one
    raw = encoded(noise(8, 120, 90), "WEBP")
    with pytest.raises(InvalidRequest):
        decode_image(raw[:len(raw) // 2])


@pytest.mark.parametrize("fmt", ["BMP", "TIFF"])
def test_other_formats_are_not_supported(fmt):
    with pytest.raises(InvalidRequest, match=f"{fmt} images are not supported"):
        decode_image(encoded(noise(9, 8, 8), fmt))


# -- limits ----------------------------------------------------------------------------------
def test_more_pixels_than_the_limit_is_refused(monkeypatch):
    raw = encoded(noise(10, 80, 64), "PNG")
    monkeypatch.setattr(images, "MAX_IMAGE_PIXELS", 80 * 64)
    assert decode_image(raw).image.size == (80, 64)  # exactly the limit is accepted
    monkeypatch.setattr(images, "MAX_IMAGE_PIXELS", 80 * 64 - 1)
    with pytest.raises(InvalidRequest, match="80x64"):
        decode_image(raw)


def test_the_pixel_limit_is_checked_from_the_header_before_decoding():
    # 8000 x 8000 claimed, no pixels present: refused for its size, not as truncated
    with pytest.raises(InvalidRequest, match="8000x8000: at most 40,000,000 pixels"):
        decode_image(png_header_only(8000, 8000))


def test_a_header_claiming_a_gigantic_image_is_a_bad_request():
    with pytest.raises(InvalidRequest, match="pixels"):
        decode_image(png_header_only(20000, 20000))  # 400 M pixels: Pillow's own bomb check


def test_more_encoded_bytes_than_the_limit_is_refused(monkeypatch):
    raw = encoded(noise(11), "PNG")
    monkeypatch.setattr(images, "MAX_IMAGE_BYTES", len(raw))
    assert decode_base64_image(b64(raw)).image.size == (80, 64)  # exactly the limit
    monkeypatch.setattr(images, "MAX_IMAGE_BYTES", len(raw) - 1)
    with pytest.raises(InvalidRequest, match="larger than"):
        decode_image(raw)
    with pytest.raises(InvalidRequest, match="larger than"):
        decode_base64_image(b64(raw))


def test_base64_far_over_the_limit_is_refused_before_decoding(monkeypatch):
    monkeypatch.setattr(images, "MAX_IMAGE_BYTES", 1000)
    with pytest.raises(InvalidRequest, match="larger than"):
        image_bytes("A" * 2000)  # valid base64 of 1500 bytes; never decoded
    assert len(image_bytes(b64(bytes(1000)))) == 1000


def test_transparent_pixels_come_out_white_as_transformers_puts_them():
    clear_red = Image.new("RGBA", (4, 4), (255, 0, 0, 0))
    half = Image.new("RGBA", (4, 4), (0, 0, 0, 128))
    assert decode_image(encoded(clear_red, "PNG")).image.getpixel((1, 1)) == (255, 255, 255)
    assert decode_image(encoded(half, "PNG")).image.getpixel((1, 1)) == (127, 127, 127)
    palette = Image.new("P", (4, 4), 0)
    palette.putpalette([255, 0, 0] * 256)
    palette.info["transparency"] = 0
    assert decode_image(encoded(palette, "PNG", transparency=0)).image.getpixel((0, 0)) == \
        (255, 255, 255)


def test_sixteen_bit_grey_is_scaled_not_clipped():
    grey = Image.new("I;16", (4, 4), 32768)
    assert decode_image(encoded(grey, "PNG")).image.getpixel((0, 0)) == (128, 128, 128)


def test_base64_wrapped_in_lines_is_read_as_go_reads_it():
    raw = encoded(noise(12), "PNG")
    text = b64(raw)
    wrapped = "\r\n".join(text[i:i + 76] for i in range(0, len(text), 76))
    assert decode_base64_image(wrapped).digest == decode_base64_image(text).digest


def test_small_limits_are_named_in_bytes(monkeypatch):
    monkeypatch.setattr(images, "MAX_IMAGE_BYTES", 100)
    with pytest.raises(InvalidRequest, match="larger than 100 bytes"):
        decode_image(encoded(noise(13), "PNG"))
