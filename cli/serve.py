"""``mlx-mtp serve``: an OpenAI-compatible HTTP server (``mlx_mtp.serve``)."""

import signal
import sys
from pathlib import Path
from typing import List, Optional

import typer

from mlx_mtp.serve import (
    API_KEY_ENV,
    DEFAULT_HOST,
    DEFAULT_IMAGE_FETCH_TIMEOUT,
    DEFAULT_LOOKUP_MEMORY_MB,
    DEFAULT_MAX_BATCH,
    DEFAULT_MAX_BODY_MB,
    DEFAULT_MAX_IMAGE_MB,
    DEFAULT_MAX_IMAGE_PIXELS,
    DEFAULT_MAX_IMAGES,
    DEFAULT_PORT,
    DEFAULT_PROMPT_CACHE_DISK_GB,
    DEFAULT_PROMPT_CACHE_ENTRIES,
    DEFAULT_PROMPT_CACHE_MB,
    DEFAULT_SERVE_MAX_TOKENS,
    DEFAULT_SHUTDOWN_TIMEOUT,
)

from . import options as o
from .app import SPECULATIVE, app, fail

SERVER = "Server"
IMAGES = "Images (a vision model)"


@app.command()
@o.kv_options
def serve(
    model: o.ModelPath = None,
    mtp: o.HeadPath = None,
    draft: o.DraftPath = None,
    hidden_tap: o.HiddenTap = None,
    host: str = typer.Option(
        DEFAULT_HOST,
        "--host",
        help="Address to listen on (127.0.0.1: this machine only).",
        rich_help_panel=SERVER,
    ),
    port: int = typer.Option(
        DEFAULT_PORT,
        "--port",
        min=0,
        max=65535,
        help="Port to listen on.",
        rich_help_panel=SERVER,
    ),
    max_tokens: int = typer.Option(
        DEFAULT_SERVE_MAX_TOKENS,
        "--max-tokens",
        "-n",
        min=1,
        help="Tokens per answer when a request names no max_tokens.",
        rich_help_panel=SERVER,
    ),
    max_batch: int = typer.Option(
        DEFAULT_MAX_BATCH,
        "--max-batch",
        min=1,
        help="Requests decoded together at most; more wait their turn.",
        rich_help_panel=SERVER,
    ),
    prompt_cache_entries: int = typer.Option(
        DEFAULT_PROMPT_CACHE_ENTRIES,
        "--prompt-cache-entries",
        min=0,
        help="Caches of earlier requests kept for reuse (0: none).",
        rich_help_panel=SERVER,
    ),
    prompt_cache_mb: int = typer.Option(
        DEFAULT_PROMPT_CACHE_MB,
        "--prompt-cache-mb",
        min=0,
        help="Memory those caches may take together, in MiB.",
        rich_help_panel=SERVER,
    ),
    lookup_memory_mb: int = typer.Option(
        DEFAULT_LOOKUP_MEMORY_MB,
        "--lookup-memory-mb",
        min=0,
        help="Memory for recent prompts and answers that drafts are looked up "
        "in, in MiB (0: none; it lets one user's request time tell what "
        "others sent: docs/serve.md).",
        rich_help_panel=SERVER,
    ),
    reasoning_parser: str = typer.Option(
        "auto",
        "--reasoning-parser",
        metavar="NAME",
        help="How a thinking model's thinking is told from its answer: auto "
        "(from the chat template), none, think (<think>...</think>), kimi, "
        "gpt_oss; or vLLM's qwen3, deepseek_r1, glm45.",
        rich_help_panel=SERVER,
    ),
    prompt_cache_dir: Optional[str] = typer.Option(
        None,
        "--prompt-cache-dir",
        metavar="DIR",
        help="Keep the prompt cache's entries on disk too: finished and evicted "
        "prefixes outlive the memory bound and a restart (entries of other "
        "models or settings there are skipped, never served).",
        rich_help_panel=SERVER,
    ),
    prompt_cache_disk_gb: float = typer.Option(
        DEFAULT_PROMPT_CACHE_DISK_GB,
        "--prompt-cache-disk-gb",
        min=0.0,
        help="Disk those entries may take, in GiB (least recently used go first).",
        rich_help_panel=SERVER,
    ),
    shutdown_timeout: float = typer.Option(
        DEFAULT_SHUTDOWN_TIMEOUT,
        "--shutdown-timeout",
        min=0,
        help="On Ctrl-C or SIGTERM, seconds the running requests may go on "
        "before they end (a second Ctrl-C ends them at once).",
        rich_help_panel=SERVER,
    ),
    max_body_mb: int = typer.Option(
        DEFAULT_MAX_BODY_MB,
        "--max-body-mb",
        min=1,
        help="Request bodies larger than this many MiB get a 413 before they are read.",
        rich_help_panel=SERVER,
    ),
    api_key: Optional[str] = typer.Option(
        None,
        "--api-key",
        metavar="KEY",
        envvar=API_KEY_ENV,
        help="Every endpoint but /health wants this key (Authorization: Bearer "
        f"KEY, or x-api-key). Set {API_KEY_ENV} instead to keep it out of the "
        "process list.",
        rich_help_panel=SERVER,
    ),
    cors_origin: Optional[List[str]] = typer.Option(
        None,
        "--cors-origin",
        metavar="ORIGIN",
        help="Let web pages from this origin call the server (repeat for more; "
        "'*': any).",
        rich_help_panel=SERVER,
    ),
    strict_model_names: bool = typer.Option(
        False,
        "--strict-model-names",
        help="Refuse (404) OpenAI requests whose model does not name the served "
        "model, instead of serving it under any name.",
        rich_help_panel=SERVER,
    ),
    max_images: int = typer.Option(
        DEFAULT_MAX_IMAGES,
        "--max-images",
        min=0,
        help="Images one request may hold (0: none).",
        rich_help_panel=IMAGES,
    ),
    max_image_mb: float = typer.Option(
        DEFAULT_MAX_IMAGE_MB,
        "--max-image-mb",
        min=0.001,
        help="Bytes each image may take, in MiB (larger: a 400 before decoding).",
        rich_help_panel=IMAGES,
    ),
    max_image_pixels: int = typer.Option(
        DEFAULT_MAX_IMAGE_PIXELS,
        "--max-image-pixels",
        min=1,
        help="Pixels each image may have (from its header, before decoding).",
        rich_help_panel=IMAGES,
    ),
    allow_image_urls: bool = typer.Option(
        False,
        "--allow-image-urls",
        help="Fetch http(s) image URLs (off: data: URLs only). A server that "
        "fetches URLs can be made to reach hosts its clients cannot: allow it "
        "only where its clients may reach what it can.",
        rich_help_panel=IMAGES,
    ),
    allow_image_files: Optional[Path] = typer.Option(
        None,
        "--allow-image-files",
        metavar="DIR",
        help="Read images named by a path or file:// URL under DIR (and only "
        "there).",
        rich_help_panel=IMAGES,
    ),
    image_fetch_timeout: float = typer.Option(
        DEFAULT_IMAGE_FETCH_TIMEOUT,
        "--image-fetch-timeout",
        min=0.001,
        help="Seconds an image URL's fetch may take, all of it.",
        rich_help_panel=IMAGES,
    ),
    draft_max: o.DraftMax = None,
    draft_source: o.DraftSourceOption = o.DraftSource.auto,
    fixed_draft: bool = typer.Option(
        False,
        "--fixed-draft",
        help="Draft --draft-max tokens every round, instead of as deep as pays "
        "at the current number of streams.",
        rich_help_panel=SPECULATIVE,
    ),
    no_mtp: o.NoMTP = False,
    sharding: o.ShardingOption = o.Sharding.auto,
    kv=None,  # the KV cache options (o.kv_options)
):
    """Serve a model over an OpenAI-compatible API, with MTP, many requests at once.

    Under mlx.launch, one server over every process: rank 0 listens."""
    from mlx_mtp.draft_settings import DraftSettings
    from mlx_mtp.serve import ServeConfig
    from mlx_mtp.serve.app import listen, run
    from mlx_mtp.serve.reasoning import check_parser

    group = o.processes()
    if api_key is not None and not api_key.strip():
        raise fail(f"the API key is empty (--api-key or {API_KEY_ENV})")
    try:
        check_parser(reasoning_parser)
    except ValueError as e:
        raise fail(f"--reasoning-parser: {e}") from None
    if allow_image_files is not None and not allow_image_files.is_dir():
        raise fail(f"--allow-image-files: {allow_image_files} is not a folder")
    config = ServeConfig(
        drafts=DraftSettings(
            source=o.DraftSource(draft_source).value,
            draft_max=draft_max,
            adaptive=not fixed_draft,
            mtp=not no_mtp,
        ),
        max_tokens=max_tokens,
        max_batch=max_batch,
        prompt_cache_entries=prompt_cache_entries,
        prompt_cache_bytes=prompt_cache_mb << 20,
        shutdown_timeout=shutdown_timeout,
        max_body_bytes=max_body_mb << 20,
        api_key=api_key.strip() if api_key else None,
        cors_origins=tuple(cors_origin or ()),
        strict_model_names=strict_model_names,
        lookup_memory_bytes=lookup_memory_mb << 20,
        reasoning_parser=reasoning_parser,
        kv=kv,
        prompt_cache_dir=prompt_cache_dir,
        prompt_cache_disk_bytes=int(prompt_cache_disk_gb * 2**30),
        max_images=max_images,
        max_image_bytes=max(1, int(max_image_mb * 2**20)),
        max_image_pixels=max_image_pixels,
        allow_image_urls=allow_image_urls,
        image_dir=str(allow_image_files) if allow_image_files else None,
        image_fetch_timeout=image_fetch_timeout,
    )
    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    if group.size() > 1:
        if prompt_cache_dir is not None:
            raise fail("--prompt-cache-dir serves one process, not under mlx.launch")
        # what must match on every rank besides the model folder: the options
        # that change what the engine does (the HTTP ones matter on rank 0 only)
        settings = {
            "--mtp": mtp, "--hidden-tap": hidden_tap, "--no-mtp": no_mtp,
            "--sharding": o.Sharding(sharding).value, "--max-tokens": max_tokens,
            "--max-batch": max_batch, "--prompt-cache-entries": prompt_cache_entries,
            "--prompt-cache-mb": prompt_cache_mb, "--draft-max": draft_max,
            "--draft-source": config.drafts.source, "--fixed-draft": fixed_draft,
            "--lookup-memory-mb": lookup_memory_mb,
            "--reasoning-parser": reasoning_parser,
            **{f"--{k.replace('_', '-')}": v for k, v in kv.metadata().items()},
        }  # fmt: skip
        loading = (model, mtp, hidden_tap, no_mtp, sharding, draft)
        _serve_cluster(group, config, settings, loading, (host, port), log)
        return
    sock = listen(host, port)  # a busy port fails before the model loads
    path, loaded, tokenizer = o.load_model(model, mtp, hidden_tap, no_mtp, draft=draft)
    run(
        loaded,
        tokenizer,
        path.name,
        config=config,
        log=log,
        sock=sock,
    )


def _serve_cluster(group, config, settings: dict, loading, address, log) -> None:
    """``serve`` under mlx.launch: every rank checks that it runs rank 0's
    command before anything loads (``settings``: option -> value; ``loading``:
    ``load_model``'s arguments); rank 0 listens on ``address``."""
    from mlx_mtp.serve import cluster, ranks
    from mlx_mtp.serve.app import listen

    settings = {flag: str(value) for flag, value in settings.items()}
    liveness = ranks.handshake(group, ranks.fingerprint(loading[0], settings))
    sock = None
    if group.rank() == 0:
        try:
            sock = listen(*address)  # a busy port fails before the model loads
        except Exception:
            liveness.close()
            raise
    path, loaded, tokenizer = o.load_model(*loading)
    if group.rank() != 0:  # a terminal's Ctrl-C reaches every process: rank 0
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # ends the others
    cluster.serve(loaded, tokenizer, path.name, config, liveness, sock, log)
