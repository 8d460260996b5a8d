"""Images in chat requests: OpenAI's ``image_url`` parts (and Anthropic's
``image`` blocks, translated into them), read for a vision model.

An image comes as a ``data:`` URL (base64 PNG, JPEG, WebP or GIF), always;
as an http(s) URL only on a server started with ``--allow-image-urls``, and
as a local file only under the folder of ``--allow-image-files`` (both off
by default: a server that fetches URLs can be made to reach hosts its
clients cannot, and one that reads files to show them). A fetch has a
timeout (for the whole of it) and the byte limit.

Each request's images are limited in count, bytes and pixels
(``ServeConfig.max_images``, ``max_image_bytes``, ``max_image_pixels``); a
broken, unsupported or oversized image is refused (a 400 naming the part)
before any of it is decoded: the byte limit on the base64 text, the type on
the first bytes, the pixels on the header. All of this runs in the worker
thread that templates and tokenizes the request, off the event loop.
"""

import base64
import binascii
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import List, Tuple
from urllib.parse import unquote, urlsplit

from .. import vision
from ..errors import MTPError
from .http import APIError

_CHUNK = 1 << 16


def _bad(message: str, where: str, code: str = "invalid_value") -> APIError:
    return APIError(message, param=where, code=code)


class Images:
    """The images of one request, in the order their parts stand."""

    def __init__(self, service):
        self.service = service
        self.parts: List[Tuple[str, str]] = []  # (url, the part's place)

    def add(self, url, where: str) -> str:
        """Take the image of ``url`` (checked later, in ``read``); the text
        that stands for it in the prompt (the processor's image block)."""
        service, config = self.service, self.service.config
        if not service.reads_images:
            raise _bad(service.why_no_images(), where, "unsupported_value")
        if len(self.parts) >= config.max_images:
            raise _bad(
                f"more than {config.max_images} images in one request "
                "(--max-images)",
                where,
            )
        if not isinstance(url, str) or not url:
            raise _bad(f"'{where}.image_url.url' must be a string", where,
                       "invalid_type")  # fmt: skip
        self.parts.append((url, where))
        return service.tokenizer.image_block

    def read(self) -> List["vision.Picture"]:
        """Every image's bytes, checked and decoded."""
        return [self._read(url, where) for url, where in self.parts]

    def _read(self, url: str, where: str) -> "vision.Picture":
        config = self.service.config
        if url.startswith("data:"):
            data = _data_url(url, where, config.max_image_bytes)
        elif urlsplit(url).scheme in ("http", "https"):
            data = _fetch(url, where, config)
        else:
            data = _file(url, where, config)
        kind = vision.sniff(data)
        if kind is None:
            raise _bad(
                f"'{where}': not a PNG, JPEG, WebP or GIF image", where,
                "unsupported_value",
            )  # fmt: skip
        try:
            return vision.decode_image(data, where, config.max_image_pixels)
        except MTPError as e:
            raise _bad(str(e), where) from None


def _too_large(where: str, limit: int) -> APIError:
    return _bad(
        f"'{where}': the image is larger than {limit} bytes (--max-image-mb)", where
    )


def _data_url(url: str, where: str, limit: int) -> bytes:
    head, comma, text = url.partition(",")
    kind = head[len("data:") :].split(";")
    if not comma or "base64" not in kind[1:]:
        raise _bad(f"'{where}': a data URL must be base64 (data:image/png;base64,...)",
                   where)  # fmt: skip
    if kind[0] and kind[0].lower() not in vision.IMAGE_TYPES:
        raise _bad(
            f"'{where}': images of type {kind[0]} are not supported (only "
            f"{', '.join(vision.IMAGE_TYPES)})",
            where,
            "unsupported_value",
        )
    if len(text) // 4 * 3 > limit + 2:  # before decoding it
        raise _too_large(where, limit)
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise _bad(f"'{where}': the data URL is not valid base64", where) from None
    if len(data) > limit:
        raise _too_large(where, limit)
    return data


def _fetch(url: str, where: str, config) -> bytes:
    if not config.allow_image_urls:
        raise _bad(
            f"'{where}': this server does not fetch image URLs (start it with "
            "--allow-image-urls); send the image as a data: URL",
            where,
            "unsupported_value",
        )
    limit, timeout = config.max_image_bytes, config.image_fetch_timeout
    deadline = time.monotonic() + timeout
    try:
        request = urllib.request.Request(url, headers={"User-Agent": "mlx-mtp"})
        with urllib.request.urlopen(request, timeout=timeout) as r:
            size = r.headers.get("Content-Length")
            if size is not None and size.isdigit() and int(size) > limit:
                raise _too_large(where, limit)
            data = bytearray()
            while True:
                chunk = r.read(_CHUNK)
                if not chunk:
                    break
                data += chunk
                if len(data) > limit:
                    raise _too_large(where, limit)
                if time.monotonic() > deadline:
                    raise TimeoutError
    except urllib.error.HTTPError as e:
        raise _bad(f"'{where}': fetching the image got HTTP {e.code}", where) from None
    except (TimeoutError, OSError, ValueError) as e:
        if isinstance(e, TimeoutError) or "timed out" in str(e):
            why = f"no answer within {timeout:g} s"
        else:
            why = str(getattr(e, "reason", e)) or type(e).__name__
        raise _bad(f"'{where}': cannot fetch the image ({why})", where) from None
    return bytes(data)


def _file(url: str, where: str, config) -> bytes:
    root = config.image_dir
    if root is None:
        also = " or an http(s) URL" if config.allow_image_urls else ""
        raise _bad(
            f"'{where}': an image must be a data: URL (base64){also}; this "
            "server reads no local files (--allow-image-files DIR)",
            where,
            "unsupported_value",
        )
    parts = urlsplit(url)
    if parts.scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise _bad(f"'{where}': a file URL names this machine's files", where)
        name = unquote(parts.path)
    elif parts.scheme and len(parts.scheme) > 1:  # (not a Windows drive)
        raise _bad(f"'{where}': URLs of scheme {parts.scheme}: are not supported",
                   where, "unsupported_value")  # fmt: skip
    else:
        name = url
    base = Path(root).resolve()
    path = (base / name).resolve()
    if not path.is_relative_to(base):
        raise _bad(f"'{where}': the file is not under the image folder", where)
    if not path.is_file():
        raise _bad(f"'{where}': no such image file under the image folder", where)
    if path.stat().st_size > config.max_image_bytes:
        raise _too_large(where, config.max_image_bytes)
    try:
        return path.read_bytes()
    except OSError as e:
        raise _bad(f"'{where}': cannot read the file ({type(e).__name__})",
                   where) from None  # fmt: skip
