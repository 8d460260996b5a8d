"""What the HTTP handlers of both APIs share: the refused request and reading
a request's body and its client's going away."""

import json

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


async def read_body(request: HTTPRequest, limit: int) -> dict:
    """The JSON object of the body; one past ``limit`` bytes is refused (413) by
    its Content-Length before any of it is read, or as soon as the bytes read
    (a chunked body) pass the limit."""
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        chunks.append(chunk)
    raw = b"".join(chunks)
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(f"the request body is not valid JSON ({e})", code="invalid_json")
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object", code="invalid_json")
    return body
