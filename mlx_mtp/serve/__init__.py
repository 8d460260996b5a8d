"""An OpenAI-compatible HTTP server with MTP, decoding several streams at once.

``run(model, tokenizer, ...)`` serves a loaded model with uvicorn;
``create_app`` builds the Starlette app over an ``Engine`` (``engine.py``),
which batches the requests (``mlx_mtp.decoder``); both live in ``app.py``.

This module itself imports neither MLX nor the web stack (``create_app`` and
``run`` are imported from ``app.py`` on first use), so the command line can
show these defaults cheaply.
"""

import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional, Tuple

from ..draft_settings import DraftSettings

if TYPE_CHECKING:  # (``kv`` loads MLX)
    from ..kv import KVSettings

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8080
DEFAULT_MAX_BATCH = 8
DEFAULT_PROMPT_CACHE_ENTRIES = 8
DEFAULT_PROMPT_CACHE_MB = 2048
# the prompt cache's entries on disk (``--prompt-cache-dir``), at most this
DEFAULT_PROMPT_CACHE_DISK_GB = 16.0
# Prompt tokens read per turn of the engine's loop while other streams decode.
DEFAULT_SERVE_PREFILL_STEP = 512
# A request that names no max_tokens stops here (or at the end of the context).
DEFAULT_SERVE_MAX_TOKENS = 512
# On SIGINT/SIGTERM running streams go on this long, then end ("length").
DEFAULT_SHUTDOWN_TIMEOUT = 30.0
# A request body past this is refused (413) before it is read.
DEFAULT_MAX_BODY_MB = 16
# The lookup memory of recent prompts and answers that every request's drafts
# may come from (0: none).
DEFAULT_LOOKUP_MEMORY_MB = 64
# Images a request may hold (0: none), each at most so many bytes and pixels;
# a fetched image URL's fetch (``--allow-image-urls``) gives up after so long.
DEFAULT_MAX_IMAGES = 8
DEFAULT_MAX_IMAGE_MB = 10
DEFAULT_MAX_IMAGE_PIXELS = 4096 * 4096
DEFAULT_IMAGE_FETCH_TIMEOUT = 10.0
# Where ``--api-key`` may come from instead, out of the process list.
API_KEY_ENV = "MLX_MTP_API_KEY"


@dataclass
class ServeConfig:
    """How the server runs; per-request fields override the drafts'
    ``draft_max`` and ``source``, and ``max_tokens``.

    ``drafts``: the server's draft settings (``DraftSettings``), where every
    request's start: its ``draft_max`` None is the head's recommended count;
    ``adaptive``: each batched round drafts as deep as pays at the current
    batch size (measured), a stream served alone as ``CostAwareDraft``
    chooses; otherwise every stream drafts its ``draft_max`` every round;
    ``mtp`` False: no request drafts, whatever it asks. ``shutdown_timeout``: seconds the streams
    running at SIGINT/SIGTERM may go on before they end (a second signal
    ends them at once).

    ``lookup_memory_bytes``: the memory of recent prompts and answers that
    drafts are looked up in (``ngram.LookupMemory``; 0: none).
    ``reasoning_parser``: how a thinking model's thinking is told from its
    answer ("auto": from the chat template; "none": it is not;
    ``reasoning.PARSERS``).

    ``max_body_bytes``: larger request bodies get a 413 before they are read.
    ``api_key``: every endpoint but ``/health`` wants it (``Authorization:
    Bearer`` or ``x-api-key``). ``cors_origins``: browser origins answered
    (``"*"``: any). ``strict_model_names``: a ``model`` that does not name the
    served model is a 404 on the OpenAI endpoints (else any name is served).
    ``kv``: how every stream's caches hold its context (quantized, bounded;
    None: full precision). ``prompt_cache_dir``: where the prompt cache keeps
    its entries on disk as well (at most ``prompt_cache_disk_bytes``), across
    restarts (None: in memory only).

    Images (``serve/images.py``): ``max_images`` per request, each at most
    ``max_image_bytes`` and ``max_image_pixels``; ``allow_image_urls``: http(s)
    image URLs are fetched (within ``image_fetch_timeout`` seconds), and
    ``image_dir``: local image files under it are read (both off by default:
    a server that fetches or reads what a request names can be made to reach
    what its clients cannot).
    """

    drafts: DraftSettings = field(default_factory=DraftSettings)
    max_tokens: int = DEFAULT_SERVE_MAX_TOKENS
    max_batch: int = DEFAULT_MAX_BATCH
    prompt_cache_entries: int = DEFAULT_PROMPT_CACHE_ENTRIES
    prompt_cache_bytes: int = DEFAULT_PROMPT_CACHE_MB << 20
    prefill_step: int = DEFAULT_SERVE_PREFILL_STEP
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT
    max_body_bytes: int = DEFAULT_MAX_BODY_MB << 20
    api_key: Optional[str] = None
    cors_origins: Tuple[str, ...] = ()
    strict_model_names: bool = False
    lookup_memory_bytes: int = DEFAULT_LOOKUP_MEMORY_MB << 20
    reasoning_parser: str = "auto"
    kv: Optional["KVSettings"] = None
    prompt_cache_dir: Optional[str] = None
    prompt_cache_disk_bytes: int = int(DEFAULT_PROMPT_CACHE_DISK_GB * 2**30)
    max_images: int = DEFAULT_MAX_IMAGES
    max_image_bytes: int = DEFAULT_MAX_IMAGE_MB << 20
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    allow_image_urls: bool = False
    image_dir: Optional[str] = None
    image_fetch_timeout: float = DEFAULT_IMAGE_FETCH_TIMEOUT

    def validate(self) -> None:
        at_least_one = ("max_tokens", "max_batch", "prefill_step", "max_body_bytes",
                        "max_image_bytes", "max_image_pixels")  # fmt: skip
        for name in at_least_one:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        names = ("prompt_cache_entries", "prompt_cache_bytes",
                 "lookup_memory_bytes", "prompt_cache_disk_bytes")  # fmt: skip
        for name in names + ("shutdown_timeout", "max_images"):
            if (getattr(self, name) or 0) < 0:
                raise ValueError(f"{name} must be at least 0")
        if not self.image_fetch_timeout > 0:
            raise ValueError("image_fetch_timeout must be more than 0")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty")
        self.drafts.validate()  # the one check of the server's draft defaults


def __getattr__(name: str):
    # the server itself, imported on first use (it loads MLX and the web stack)
    if name in ("create_app", "run"):
        return getattr(importlib.import_module(f"{__name__}.app"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
