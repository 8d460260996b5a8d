"""``mlx-mtp cache-prompt``: read a prompt once and keep its cache in a file
(``mlx_mtp.prompt_file``), for ``generate`` and ``chat --prompt-cache-file``."""

import sys
import time
from pathlib import Path
from typing import List, Optional

import typer

from . import options as o
from .app import app
from .generate import read_prompt
from .progress import PromptProgress

PromptCacheFile = typer.Option(
    ...,
    "--prompt-cache-file",
    help="Where to write the cache (mlx-lm's prompt-cache format; written "
    "atomically, never over a file that is not a prompt cache).",
)


@app.command("cache-prompt")
@o.kv_options
def cache_prompt(
    model: o.ModelPath = None,
    prompt: str = typer.Option(
        ..., "--prompt", "-p", help="Prompt text, or - to read stdin."
    ),
    prompt_cache_file: Path = PromptCacheFile,
    mtp: o.HeadPath = None,
    hidden_tap: o.HiddenTap = None,
    system: Optional[str] = typer.Option(
        None, "--system", help="System prompt for the chat template."
    ),
    no_chat_template: bool = typer.Option(
        False, "--no-chat-template", help="Cache the prompt as is."
    ),
    images: Optional[List[Path]] = typer.Option(
        None,
        "--image",
        help="An image the prompt shows (repeatable; a vision model), an image "
        "block each in front of the text; the file keeps their digests, and "
        "generate/chat continue it only with the same --image files.",
    ),
    kv=None,  # the KV cache options (o.kv_options)
):
    """Read a prompt once (trunk, MTP head, drafters) and write its cache to a file.

    generate and chat --prompt-cache-file continue from it: their prompt
    follows this one in the same user message, and the output is that of
    reading the whole prompt."""
    from mlx_mtp import prompt_file

    text = read_prompt(prompt)
    if images:  # a missing or broken image: before loading
        from mlx_mtp.vision import check_images

        check_images(images)
    _, loaded, tokenizer = o.load_model(model, mtp, hidden_tap)
    tic = time.perf_counter()
    bar = PromptProgress()
    n = prompt_file.cache_prompt(
        loaded, tokenizer, text, prompt_cache_file, system=system,
        chat_template=not no_chat_template, kv=kv, progress=bar,
        image=images or None,
    )  # fmt: skip
    bar.close()
    seconds = time.perf_counter() - tic
    print(
        f"cached {n} tokens in {prompt_cache_file} ({seconds:.2f} s, "
        f"{n / max(seconds, 1e-9):.0f} tok/s)",
        file=sys.stderr,
    )
