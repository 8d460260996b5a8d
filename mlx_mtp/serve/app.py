"""The HTTP server (Starlette, run by uvicorn): its routes and its life.

OpenAI's ``POST /v1/chat/completions``, ``POST /v1/completions`` and
``GET /v1/models`` (``openai.py``), Anthropic's ``POST /v1/messages``
(``anthropic.py``), ``GET /health`` and ``GET /metrics`` (Prometheus,
``metrics.py``); each ``/v1`` path also without ``/v1``.
Around them: the access log, CORS (``cors_origins``) and the API key.
Requests are checked and tokenized in worker threads (``parse.py``); the
engine thread generates (``engine.py``), and its events come back through an
asyncio queue per request (``service.py``). ``docs/serve.md`` lists every
field and what it does.
"""

import ipaddress
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
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route

from ..errors import MTPError
from . import DEFAULT_HOST, DEFAULT_PORT, ServeConfig, anthropic, openai, reasoning
from . import responses
from .engine import Engine
from .http import APIError
from .middleware import AccessLog, APIKey, logger
from .service import Service


def _service(http: HTTPRequest) -> Service:
    return http.app.state.service


async def chat(http: HTTPRequest):
    return await openai.complete(_service(http), http, "chat")


async def completions(http: HTTPRequest):
    return await openai.complete(_service(http), http, "text")


async def create_response(http: HTTPRequest):
    return await responses.create(_service(http), http)


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
    fmt = service.reasoning.format.name if service.reasoning else None
    return JSONResponse(
        {"status": "ok", "model": service.name, **engine.counts(),
         **engine.describe(), "reasoning_parser": fmt}
    )  # fmt: skip


async def metrics(http: HTTPRequest):
    engine = _service(http).engine
    return PlainTextResponse(
        engine.metrics.render(engine), media_type="text/plain; version=0.0.4"
    )


ROUTES = [
    ("/v1/chat/completions", chat, "POST"),
    ("/v1/completions", completions, "POST"),
    ("/v1/responses", create_response, "POST"),
    ("/v1/messages", messages, "POST"),
    ("/v1/messages/count_tokens", count_tokens, "POST"),
    ("/v1/models", models, "GET"),
    ("/v1/models/{name:path}", model, "GET"),
    ("/health", health, "GET"),
    ("/metrics", metrics, "GET"),
]
ANTHROPIC_PATHS = {"/v1/messages", "/v1/messages/count_tokens"}


def _routes() -> list:
    """Every route, as ``/v1/...`` and as ``/...`` (mlx_lm.server and
    llama-server take both)."""
    routes = []
    for path, endpoint, method in ROUTES:
        routes.append(Route(path, endpoint, methods=[method]))
        if path.startswith("/v1/"):
            routes.append(Route(path[3:], endpoint, methods=[method]))
    return routes


def _refusal(path: str, e: APIError):
    """``e`` in the error shape of the API that ``path`` belongs to."""
    if path in ANTHROPIC_PATHS or f"/v1{path}" in ANTHROPIC_PATHS:
        return anthropic.error_response(e)
    return e.response()


def _endpoint(path: str) -> str:
    """The route ``path`` asks for, as ``/metrics`` counts it (not the path
    itself: any path would make a count of its own)."""
    path = path if path.startswith("/v1/") else "/v1" + path
    if path.startswith("/v1/models/"):
        return "/v1/models/{name}"
    known = {p for p, _, _ in ROUTES}
    if path in known:
        return path
    return path[3:] if path[3:] in known else "other"


def _middleware(config: ServeConfig, metrics) -> list:
    # CORS outside the key: a browser's preflight carries no key, and a 401
    # must carry the CORS headers for the page to read it
    middleware = [Middleware(AccessLog, count=metrics.answered, endpoint=_endpoint)]
    if config.cors_origins:
        middleware.append(
            Middleware(
                CORSMiddleware,
                allow_origins=list(config.cors_origins),
                allow_methods=["GET", "POST", "OPTIONS"],
                allow_headers=["*"],
                max_age=600,
            )
        )
    if config.api_key:
        middleware.append(Middleware(APIKey, key=config.api_key, refuse=_refusal))
    return middleware


async def _http_error(http: HTTPRequest, e: HTTPException):
    code = "not_found" if e.status_code == 404 else "method_not_allowed"
    message = f"{http.method} {http.url.path}: {e.detail}"
    return APIError(message, code=code, status=e.status_code).response()


async def _server_error(http: HTTPRequest, e: Exception):
    error = APIError(f"{type(e).__name__}: {e}", code="internal_error", status=500,
                     type="server_error")  # fmt: skip
    return _refusal(http.url.path, error)


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
    model,
    tokenizer,
    name: str,
    config: Optional[ServeConfig] = None,
    engine: Optional[Engine] = None,
) -> Starlette:
    """The Starlette app serving ``model`` under the model id ``name``
    (``engine``: a ``cluster.ClusterEngine`` over processes)."""
    config = config or ServeConfig()
    config.validate()
    reasoning.check_parser(config.reasoning_parser)
    service = Service(model, tokenizer, name, config, engine)
    middleware = _middleware(config, service.engine.metrics)
    guard = getattr(engine, "guard", None)  # over processes: 503 once a rank is lost
    if guard is not None:
        middleware.insert(1, Middleware(guard, engine=engine))
    app = Starlette(
        routes=_routes(),
        middleware=middleware,
        exception_handlers={HTTPException: _http_error, Exception: _server_error},
        lifespan=_lifespan,
    )
    app.state.on_start = None
    app.state.service = service
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
    signal as uvicorn does. ``say`` hears one line per signal.
    """

    def __init__(self, config: uvicorn.Config, engine: Engine, timeout: float, say):
        super().__init__(config)
        self.engine, self.timeout, self.say = engine, timeout, say

    def handle_exit(self, sig: int, frame) -> None:
        if self.should_exit:
            self.say("shutting down now: the running requests end here")
        else:
            self.say(
                f"shutting down: running requests may go on for {self.timeout:g} s "
                "(Ctrl-C again ends them now)"
            )
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


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _started(app, name: str, host: str, port: int, say) -> None:
    """What is said once the port is open."""
    for line in app.state.service.engine.notices():
        say(line)
    say(f"serving {name} on http://{host}:{port}/v1")
    if not app.state.service.config.api_key and not _loopback(host):
        say(
            f"warning: {host} is reachable from other machines and no API key is "
            "set (--api-key): anyone who reaches this port may use the model"
        )


def run(
    model,
    tokenizer,
    name: str,
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    config: ServeConfig = None,
    log=None,
    sock: Optional[socket.socket] = None,
    engine: Optional[Engine] = None,
) -> None:
    """Serve until interrupted, on ``sock`` (from ``listen``) or ``host:port``.

    ``log`` hears one line once the port is open (and a warning when the
    server is open beyond this machine with no API key), and one per
    SIGINT/SIGTERM; without it those lines go to the access log, logger
    ``mlx_mtp.serve`` (one line per request), which writes to stderr unless
    it has handlers of its own.
    """
    if sock is None:
        sock = listen(host, port)
    app = create_app(model, tokenizer, name, config, engine)
    host, port = sock.getsockname()[:2]
    say = log if log is not None else logger.warning
    app.state.on_start = lambda: _started(app, name, host, port, say)
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
    _Server(settings, app.state.service.engine, timeout, say).run(sockets=[sock])
    mx.synchronize()
    mx.clear_streams()  # this thread's, before the interpreter's teardown
