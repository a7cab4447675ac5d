"""Images of chat messages (``image_url`` content parts) fetched, decoded and checked on the HTTP side.

``data:`` URLs are decoded locally. A server usually has no network (and
must not be made to fetch arbitrary hosts), so http(s) URLs are refused
unless ``--allowed-media-domains`` lists their host.
"""

from __future__ import annotations

import base64
import binascii
import io
import urllib.parse
import urllib.request
from collections.abc import Sequence
from typing import Any

from llmsched.server.errors import APIError

# An image larger than this is refused before it is decoded.
MAX_IMAGE_BYTES = 32 << 20
FETCH_TIMEOUT_S = 10.0


def decode_image(data: bytes, param: str) -> Any:
    """A PIL image (RGB) from encoded bytes; 400 when they are no image PIL can read.

    ``param`` (the content part's position) starts the message; the error's param is ``messages``.
    """
    from PIL import Image, UnidentifiedImageError

    try:
        img = Image.open(io.BytesIO(data))
        img.load()
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
        raise APIError(400, f"{param}: the image cannot be decoded: {e}", "messages") from None
    return img.convert("RGB")


def load_image_url(url: object, allowed_domains: Sequence[str], param: str) -> Any:
    """The image an ``image_url`` names: a data: URL, or an http(s) URL on an allowed host."""
    if not isinstance(url, str) or not url:
        raise APIError(400, f"{param}: image_url needs a 'url' string", "messages")
    if url.startswith("data:"):
        head, sep, payload = url.partition(",")
        if not sep or not head.endswith(";base64"):
            raise APIError(
                400, f"{param}: a data URL must be base64 ('data:image/png;base64,...')", "messages"
            )
        if len(payload) > MAX_IMAGE_BYTES * 4 // 3 + 4:
            raise APIError(400, f"{param}: the image is larger than {MAX_IMAGE_BYTES} bytes", "messages")
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as e:
            raise APIError(400, f"{param}: the data URL is not valid base64: {e}", "messages") from None
        return decode_image(data, "messages")
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme not in ("http", "https"):
        raise APIError(
            400,
            f"{param}: only data: and http(s) image URLs are supported, not {parsed.scheme!r}",
            "messages",
        )
    host = (parsed.hostname or "").lower()
    if host not in {d.lower() for d in allowed_domains}:
        raise APIError(
            400,
            f"{param}: fetching images from {host!r} is not allowed; send the image as a data: URL, or "
            "start the server with --allowed-media-domains listing the host",
            "messages",
        )
    try:
        with urllib.request.urlopen(url, timeout=FETCH_TIMEOUT_S) as resp:
            data = resp.read(MAX_IMAGE_BYTES + 1)
    except OSError as e:
        raise APIError(400, f"{param}: the image could not be fetched: {e}", "messages") from None
    if len(data) > MAX_IMAGE_BYTES:
        raise APIError(400, f"{param}: the image is larger than {MAX_IMAGE_BYTES} bytes", "messages")
    return decode_image(data, "messages")


def extract_images(
    messages: Sequence[Any], placeholder: str | None, allowed_domains: Sequence[str]
) -> tuple[list[Any], list[Any]]:
    """The messages with each image part turned into the model's image placeholder text, and the images."""
    out: list[Any] = []
    images: list[Any] = []
    for i, m in enumerate(messages):
        content = m.content
        if not isinstance(content, list) or not any(getattr(p, "type", None) == "image_url" for p in content):
            out.append(m)
            continue
        parts = []
        for j, p in enumerate(content):
            if getattr(p, "type", None) != "image_url":
                parts.append(p)
                continue
            param = f"messages[{i}].content[{j}]"
            if placeholder is None:
                raise APIError(400, f"{param}: this model takes no images", "messages")
            url = p.image_url.get("url") if isinstance(p.image_url, dict) else None
            images.append(load_image_url(url, allowed_domains, param))
            parts.append(type(p)(type="text", text=placeholder))
        out.append(m.model_copy(update={"content": parts}))
    return out, images
