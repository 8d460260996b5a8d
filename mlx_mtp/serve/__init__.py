"""An OpenAI-compatible HTTP server with MTP, decoding several streams at once.

``run(model, tokenizer, ...)`` serves a loaded model with uvicorn;
``create_app`` builds the Starlette app (``app.py``) over an ``Engine``
(``engine.py``), which batches the requests (``batch.py``).

This module itself imports neither MLX nor the web stack, so the command
line can show these defaults cheaply.
"""

from dataclasses import dataclass
from typing import Optional

from ..errors import MTPError

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8080
DEFAULT_MAX_BATCH = 8
DEFAULT_PROMPT_CACHE_ENTRIES = 8
DEFAULT_PROMPT_CACHE_MB = 2048
# Prompt tokens read per turn of the engine's loop while other streams decode.
DEFAULT_SERVE_PREFILL_STEP = 512
# A request that names no max_tokens stops here (or at the end of the context).
DEFAULT_SERVE_MAX_TOKENS = 512


@dataclass
class ServeConfig:
    """How the server runs; per-request fields override ``draft_max`` and
    ``max_tokens``.

    ``draft_max`` None is the head's recommended count, else
    ``DEFAULT_DRAFT_MAX``. ``adaptive_draft``: each batched round drafts as
    deep as pays at the current batch size (measured), a stream served alone
    as ``CostAwareDraft`` chooses; otherwise every stream drafts its
    ``draft_max`` every round.
    """

    draft_max: Optional[int] = None
    max_tokens: int = DEFAULT_SERVE_MAX_TOKENS
    max_batch: int = DEFAULT_MAX_BATCH
    prompt_cache_entries: int = DEFAULT_PROMPT_CACHE_ENTRIES
    prompt_cache_bytes: int = DEFAULT_PROMPT_CACHE_MB << 20
    prefill_step: int = DEFAULT_SERVE_PREFILL_STEP
    adaptive_draft: bool = True
    mtp: bool = True  # False: no request drafts, whatever it asks

    def validate(self) -> None:
        for name in ("max_tokens", "max_batch", "prefill_step"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        for name in ("draft_max", "prompt_cache_entries", "prompt_cache_bytes"):
            if (getattr(self, name) or 0) < 0:
                raise ValueError(f"{name} must be at least 0")


def create_app(model, tokenizer, name: str, config: ServeConfig = None):
    """The Starlette app serving ``model`` under the model id ``name``."""
    from .app import create_app as _create

    return _create(model, tokenizer, name, config or ServeConfig())


def run(
    model,
    tokenizer,
    name: str,
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    config: ServeConfig = None,
    log=None,
) -> None:
    """Serve until interrupted. ``log`` hears one line once the port is open."""
    import socket

    import uvicorn

    app = create_app(model, tokenizer, name, config)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)  # connections wait in the backlog until uvicorn accepts
    except OSError as e:
        sock.close()
        raise MTPError(f"cannot listen on {host}:{port} ({e.strerror})") from None
    port = sock.getsockname()[1]
    if log is not None:
        app.state.on_start = lambda: log(f"serving {name} on http://{host}:{port}/v1")
    uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])
