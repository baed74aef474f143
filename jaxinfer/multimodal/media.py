"""Images from the OpenAI routes' `image_url` content parts: `data:` URLs (base64), and
`file://` paths inside the server's --allowed-local-media-path (vLLM's flag). http(s) URLs
are refused: the server makes no network requests (vLLM fetches them; send the image as a
data: URL instead). Every failure is a ValueError whose text says what is wrong; the route
names the content part."""

from __future__ import annotations

import base64
import binascii
import io
import os
from urllib.parse import unquote, urlparse

# Larger images are refused before they are decoded (their pixels would take more than
# 150 MiB as RGB; the processor shrinks every image to at most max_pixels anyway).
MAX_IMAGE_PIXELS = 50_000_000


def open_image(data: bytes):
    """Encoded image bytes -> a decoded PIL image (ValueError if unreadable or too large)."""
    from PIL import Image

    try:
        image = Image.open(io.BytesIO(data))
    except Exception as e:  # noqa: BLE001 - PIL raises many kinds for bad bytes
        raise ValueError(f"not a readable image ({type(e).__name__}: {e})") from None
    w, h = image.size
    if w * h > MAX_IMAGE_PIXELS:
        raise ValueError(f"image of {w} x {h} pixels: more than {MAX_IMAGE_PIXELS} pixels")
    try:
        image.load()
    except Exception as e:  # noqa: BLE001 - a truncated or corrupt file
        raise ValueError(f"the image cannot be decoded ({type(e).__name__}: {e})") from None
    return image


def load_image_url(url: str, allowed_local_media_path: str | None = None):
    """An image_url's url -> a PIL image."""
    if not isinstance(url, str) or not url:
        raise ValueError("image_url.url must be a non-empty string")
    if url.startswith("data:"):
        head, sep, payload = url.partition(",")
        if not sep or ";base64" not in head:
            raise ValueError("a data URL must be data:image/<type>;base64,<data>")
        if not head[5:].startswith("image/"):
            raise ValueError(f"data URL of type {head[5:].split(';')[0]!r}: an image/* type "
                             "is needed")
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise ValueError("the data URL's base64 payload is not valid base64") from None
        return open_image(data)
    scheme = urlparse(url).scheme.lower()
    if scheme == "file":
        if not allowed_local_media_path:
            raise ValueError("file:// URLs need the server to run with "
                             "--allowed-local-media-path DIR")
        root = os.path.realpath(allowed_local_media_path)
        path = os.path.realpath(unquote(urlparse(url).path))
        if os.path.commonpath([root, path]) != root:
            raise ValueError("the file is outside --allowed-local-media-path")
        try:
            with open(path, "rb") as f:
                data = f.read(MAX_IMAGE_PIXELS * 4)
        except OSError as e:
            raise ValueError(f"cannot read the file ({e.strerror})") from None
        return open_image(data)
    if scheme in ("http", "https"):
        raise ValueError("http(s) image URLs are not fetched (the server makes no network "
                         "requests); send the image as a data: URL "
                         "(data:image/png;base64,...)")
    raise ValueError(f"unsupported image URL scheme {scheme!r} (data:, or file:// with "
                     "--allowed-local-media-path)")
