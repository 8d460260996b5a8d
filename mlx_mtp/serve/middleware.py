"""ASGI middleware around the routes: the access log."""

import logging
import time
from typing import Optional

logger = logging.getLogger("mlx_mtp.serve")

_USAGE = "mlx_mtp.usage"


def note_usage(http, usage: Optional[dict]) -> None:
    """Hands a request's usage to its access log line."""
    http.scope[_USAGE] = usage


class AccessLog:
    """One INFO line per request once its response is sent: status, tokens, MTP
    acceptance, time."""

    def __init__(self, app):
        self.app = app

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
