"""ASGI middleware around the routes: the access log and the API key."""

import hmac
import logging
import time
from typing import Callable, Optional

from starlette.datastructures import Headers

from .http import APIError

logger = logging.getLogger("mlx_mtp.serve")

_USAGE = "mlx_mtp.usage"


def note_usage(http, usage: Optional[dict]) -> None:
    """Hands a request's usage to its access log line."""
    http.scope[_USAGE] = usage


class AccessLog:
    """One INFO line per request once its response is sent: status, tokens, MTP
    acceptance, time; and ``count(endpoint(path), status)``, for the metrics."""

    def __init__(self, app, count: Optional[Callable] = None, endpoint=None):
        self.app = app
        self.count, self.endpoint = count, endpoint or (lambda path: path)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status = time.perf_counter(), [None]

        async def sending(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            client = scope.get("client") or ("-",)
            line = f'{client[0]} "{scope["method"]} {scope["path"]}" {status[0]}'
            usage = scope.get(_USAGE)
            if usage:
                line += (
                    f", {usage['prompt_tokens']} + {usage['completion_tokens']} tokens"
                )
                mtp = usage.get("mtp") or {}
                if mtp.get("drafted"):
                    line += f", MTP acceptance {mtp['acceptance_rate']:.2f}"
            logger.info("%s, %.2f s", line, time.perf_counter() - start)
            if self.count is not None and status[0] is not None:
                self.count(self.endpoint(scope["path"]), status[0])


class APIKey:
    """Every path but ``/health`` wants ``key``, as ``Authorization: Bearer
    KEY`` (OpenAI's clients) or ``x-api-key: KEY`` (Anthropic's), either on
    either API; else a 401 that ``refuse(path, error)`` shapes."""

    def __init__(self, app, key: str, refuse: Callable):
        self.app, self.key, self.refuse = app, key.encode(), refuse

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] == "/health":
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        bearer = headers.get("authorization", "")
        given = [headers.get("x-api-key", "")]
        if bearer[:7].lower() == "bearer ":
            given.append(bearer[7:].strip())
        # every candidate is compared, in constant time each
        ok = [hmac.compare_digest(g.encode(), self.key) for g in given]
        if any(ok):
            return await self.app(scope, receive, send)
        message = "a valid API key is needed (Authorization: Bearer KEY, or x-api-key)"
        error = APIError(message, code="invalid_api_key", status=401)
        await self.refuse(scope["path"], error)(scope, receive, send)
