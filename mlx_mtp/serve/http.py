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


async def read_body(request: HTTPRequest) -> dict:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(f"the request body is not valid JSON ({e})", code="invalid_json")
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object", code="invalid_json")
    return body
