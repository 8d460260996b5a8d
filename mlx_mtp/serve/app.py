"""The HTTP server (Starlette, run by uvicorn): its routes and its life.

OpenAI's ``POST /v1/chat/completions``, ``POST /v1/completions`` and
``GET /v1/models`` (``openai.py``), Anthropic's ``POST /v1/messages``
(``anthropic.py``) and ``GET /health``. Requests are checked and tokenized on
the event loop (``parse.py``); the engine thread generates (``engine.py``),
and its events come back through an asyncio queue per request
(``service.py``). ``docs/serve.md`` lists every field and what it does.
"""

import logging
import signal
import socket
import threading
from contextlib import asynccontextmanager, contextmanager
from typing import Optional

import mlx.core as mx
import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse
from starlette.routing import Route

from ..errors import MTPError
from . import DEFAULT_HOST, DEFAULT_PORT, ServeConfig, anthropic, openai
from .engine import Engine
from .http import APIError
from .middleware import AccessLog, logger
from .service import Service


def _service(http: HTTPRequest) -> Service:
    return http.app.state.service


async def chat(http: HTTPRequest):
    return await openai.complete(_service(http), http, "chat")


async def completions(http: HTTPRequest):
    return await openai.complete(_service(http), http, "text")


async def messages(http: HTTPRequest):
    return await anthropic.messages(_service(http), http)


async def count_tokens(http: HTTPRequest):
    return await anthropic.messages(_service(http), http, count=True)


async def models(http: HTTPRequest):
    return await openai.models(_service(http), http)


async def model(http: HTTPRequest):
    return await openai.model(_service(http), http)


async def health(http: HTTPRequest):
    service = _service(http)
    engine = service.engine
    return JSONResponse(
        {"status": "ok", "model": service.name, **engine.counts(), **engine.describe()}
    )


ROUTES = [
    ("/v1/chat/completions", chat, "POST"),
    ("/v1/completions", completions, "POST"),
    ("/v1/messages", messages, "POST"),
    ("/v1/messages/count_tokens", count_tokens, "POST"),
    ("/v1/models", models, "GET"),
    ("/v1/models/{name:path}", model, "GET"),
    ("/health", health, "GET"),
]


async def _http_error(http: HTTPRequest, e: HTTPException):
    code = "not_found" if e.status_code == 404 else "method_not_allowed"
    message = f"{http.method} {http.url.path}: {e.detail}"
    return APIError(message, code=code, status=e.status_code).response()


async def _server_error(http: HTTPRequest, e: Exception):
    body = openai.internal_error(f"{type(e).__name__}: {e}")
    return JSONResponse(body, status_code=500)


@asynccontextmanager
async def _lifespan(app):
    engine = app.state.service.engine
    engine.start()
    if app.state.on_start is not None:
        app.state.on_start()
    try:
        yield
    finally:
        engine.stop()


def create_app(
    model, tokenizer, name: str, config: Optional[ServeConfig] = None
) -> Starlette:
    """The Starlette app serving ``model`` under the model id ``name``."""
    config = config or ServeConfig()
    config.validate()
    app = Starlette(
        routes=[Route(path, f, methods=[method]) for path, f, method in ROUTES],
        middleware=[Middleware(AccessLog)],
        exception_handlers={HTTPException: _http_error, Exception: _server_error},
        lifespan=_lifespan,
    )
    app.state.on_start = None
    app.state.service = Service(model, tokenizer, name, config)
    return app


def listen(host: str = DEFAULT_HOST, port: int = DEFAULT_PORT) -> socket.socket:
    """A socket listening on ``host:port``; ``MTPError`` where it cannot (a port
    in use): call it before loading the model, so that this fails at once."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)  # connections wait in the backlog until uvicorn accepts
    except OSError as e:
        sock.close()
        raise MTPError(f"cannot listen on {host}:{port} ({e.strerror})") from None
    return sock


class _Server(uvicorn.Server):
    """uvicorn's server, whose SIGINT or SIGTERM drains instead of aborting.

    The first signal stops accepting connections and lets running streams go
    on for ``shutdown_timeout`` seconds (then they end with "length"); a
    second one ends them at once. Either way the engine thread is joined
    (lifespan shutdown) and the process exits 0, instead of re-raising the
    signal as uvicorn does.
    """

    def __init__(self, config: uvicorn.Config, engine: Engine, timeout: float):
        super().__init__(config)
        self.engine, self.timeout = engine, timeout

    def handle_exit(self, sig: int, frame) -> None:
        self.engine.drain(0 if self.should_exit else self.timeout)
        self.should_exit = True

    @contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        before = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in before.items():
                signal.signal(sig, handler)


def run(
    model,
    tokenizer,
    name: str,
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    config: ServeConfig = None,
    log=None,
    sock: Optional[socket.socket] = None,
) -> None:
    """Serve until interrupted, on ``sock`` (from ``listen``) or ``host:port``.

    ``log`` hears one line once the port is open; the access log (logger
    ``mlx_mtp.serve``, one line per request) goes to stderr unless that logger
    has handlers of its own.
    """
    if sock is None:
        sock = listen(host, port)
    app = create_app(model, tokenizer, name, config)
    host, port = sock.getsockname()[:2]
    if log is not None:
        app.state.on_start = lambda: log(f"serving {name} on http://{host}:{port}/v1")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
    timeout = app.state.service.config.shutdown_timeout
    # uvicorn's own limit is a backstop: the engine ends the streams first
    settings = uvicorn.Config(
        app, log_level="warning", timeout_graceful_shutdown=int(timeout) + 10
    )
    _Server(settings, app.state.service.engine, timeout).run(sockets=[sock])
    mx.synchronize()
    mx.clear_streams()  # this thread's, before the interpreter's teardown
