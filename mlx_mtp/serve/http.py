"""What the HTTP handlers of both APIs share: the refused request and reading
a request's body and its client's going away."""

import json
import re

import numpy as np
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse


class APIError(Exception):
    """A request the server refuses, with OpenAI's error fields."""

    def __init__(self, message, param=None, code=None, status=400,
                 type="invalid_request_error"):  # fmt: skip
        super().__init__(message)
        self.message, self.param, self.code = message, param, code
        self.status, self.type = status, type

    def response(self) -> JSONResponse:
        body = {"message": self.message, "type": self.type, "param": self.param,
                "code": self.code}  # fmt: skip
        return JSONResponse({"error": body}, status_code=self.status)


async def wait_disconnect(request: HTTPRequest) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def too_large(limit: int) -> APIError:
    return APIError(
        f"the request body is larger than this server takes ({limit >> 20} MiB; "
        "--max-body-mb)",
        code="request_too_large",
        status=413,
    )


# deeper than any request needs, and far from the parser's recursion limit
MAX_JSON_DEPTH = 128
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")


def json_depth(raw: bytes) -> int:
    """How deep the arrays and objects of the JSON text ``raw`` nest, counted
    without parsing it (brackets inside strings are not counted)."""
    brackets = _STRING.sub(b"", raw).translate(None, _NOT_BRACKETS)
    if not brackets:
        return 0
    b = np.frombuffer(brackets, dtype=np.uint8)
    return int(np.where((b == ord("[")) | (b == ord("{")), 1, -1).cumsum().max())


def _check_text(value, where: str = "") -> None:
    """Refuse a string holding a lone surrogate: an escape such as ``\\ud800``
    that JSON reads but that is no Unicode text (no tokenizer takes it)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise APIError(
                f"'{where or 'the request body'}' holds a lone surrogate "
                f"(\\u{ord(value[e.start]):04x}), which is not text",
                param=where or None,
                code="invalid_value",
            ) from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_text(key, where)
            _check_text(item, f"{where}.{key}" if where else key)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_text(item, f"{where}[{i}]")


async def read_body(request: HTTPRequest, limit: int) -> dict:
    """The JSON object of the body; one past ``limit`` bytes is refused (413) by
    its Content-Length before any of it is read, or as soon as the bytes read
    (a chunked body) pass the limit. Nesting past ``MAX_JSON_DEPTH`` is refused
    before parsing, and so is a string that is not Unicode text (both off the
    event loop)."""
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        chunks.append(chunk)
    # parsed in a worker thread: a body of many megabytes takes seconds to
    # scan, and the event loop answers every other request meanwhile
    return await run_in_threadpool(_parse, b"".join(chunks))


def _parse(raw: bytes) -> dict:
    if json_depth(raw) > MAX_JSON_DEPTH:
        raise APIError(
            f"the request body nests deeper than {MAX_JSON_DEPTH} arrays and objects",
            code="invalid_json",
        )
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(f"the request body is not valid JSON ({e})", code="invalid_json")
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object", code="invalid_json")
    if _SURROGATE.search(raw):  # only an escape can put a surrogate in a string
        _check_text(body)
    return body
