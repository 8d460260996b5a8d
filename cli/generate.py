"""``mlx-mtp generate``: stream a completion, then the speculative stats."""

import dataclasses
import json
import sys
from pathlib import Path
from typing import List, Optional

import typer

from mlx_mtp.defaults import DEFAULT_MAX_TOKENS

from . import options as o
from .app import OUTPUT, app, fail
from .progress import PromptProgress


def read_prompt(prompt: str) -> str:
    """The prompt text (``-``: stdin), checked before any model is loaded."""
    if prompt == "-":
        data = sys.stdin.buffer.read()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise fail(
                f"stdin is not UTF-8 text (byte 0x{data[e.start]:02x} "
                f"at offset {e.start})"
            ) from None
    else:
        text = prompt
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # undecodable bytes in the command line
            raise fail("--prompt is not UTF-8 text") from None
    if not text.strip():
        raise fail("the prompt is empty")
    return text


def read_prompts(path: str) -> list:
    """The prompts of a JSON Lines file (``-``: stdin), checked before any
    model is loaded."""
    from mlx_mtp.prompts import read_jsonl_prompts

    try:
        lines = sys.stdin.readlines() if path == "-" else open(path).readlines()
    except FileNotFoundError:
        raise fail(f"--prompts {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise fail(f"--prompts {path}: cannot read it ({type(e).__name__})") from None
    return read_jsonl_prompts(lines, "stdin" if path == "-" else path)


def answer_all(loaded, tokenizer, texts: list, request) -> None:
    """Generate every prompt in one batch; one JSON line per answer."""
    from mlx_mtp.batch import batch_generate

    r = batch_generate(loaded, tokenizer, texts, request=request, return_token_ids=True)
    for text, tokens, finish, stats in zip(
        r.texts, r.token_ids, r.finish_reasons, r.mtp_stats
    ):
        answer = {"text": text, "tokens": tokens, "finish_reason": finish}
        print(json.dumps({**answer, "stats": stats.to_dict()}), flush=True)


def dropped_notice(tokenizer, text: str, kept: int) -> None:
    """Say how much of the prompt ``--truncate-prompt`` dropped, if any."""
    from mlx_mtp.prompts import encode

    total = len(encode(tokenizer, text))
    if kept < total:
        print(
            f"notice: --truncate-prompt dropped the oldest {total - kept} of "
            f"{total} prompt tokens",
            file=sys.stderr,
            flush=True,
        )


@app.command()
@o.generation_options
def generate(
    model: o.ModelPath = None,
    prompt: Optional[str] = typer.Option(
        None, "--prompt", "-p", help="Prompt text, or - to read stdin."
    ),
    prompts: Optional[str] = typer.Option(
        None,
        "--prompts",
        help="A JSON Lines file (- : stdin) of prompts, each a JSON string or "
        '{"prompt": ...}: they are generated together (batched) and each answer '
        "is printed as one JSON line, in order.",
    ),
    mtp: o.HeadPath = None,
    draft: o.DraftPath = None,
    hidden_tap: o.HiddenTap = None,
    sharding: o.ShardingOption = o.Sharding.auto,
    system: Optional[str] = typer.Option(
        None, "--system", help="System prompt for the chat template."
    ),
    no_chat_template: bool = typer.Option(
        False, "--no-chat-template", help="Use the prompt as is."
    ),
    max_tokens: int = typer.Option(
        DEFAULT_MAX_TOKENS,
        "--max-tokens",
        "-n",
        min=1,
        help="Tokens to generate at most (generation also stops at the end of the "
        "model's context).",
    ),
    truncate_prompt: bool = typer.Option(
        False,
        "--truncate-prompt",
        help="Drop the oldest tokens of a prompt longer than the model's context "
        "(keeping a leading BOS) instead of refusing it.",
    ),
    prompt_cache_file: Optional[Path] = typer.Option(
        None,
        "--prompt-cache-file",
        help="Continue from a prompt read by mlx-mtp cache-prompt: --prompt "
        "follows it in the same user message (only the rest is read).",
    ),
    images: Optional[List[Path]] = typer.Option(
        None,
        "--image",
        help="An image the prompt shows (repeatable): a vision model (Qwen3.5/3.6, "
        "with mlx-mtp[vision]) reads it, an image block each in front of the text.",
    ),
    as_json: bool = typer.Option(
        False,
        "--json",
        help="Print one JSON object (text, tokens, stats) instead of streaming.",
        rich_help_panel=OUTPUT,
    ),
    request=None,  # the generation options (o.generation_options)
):
    """Generate text with MTP speculative decoding."""
    from mlx_mtp.config import no_drafts_reason
    from mlx_mtp import prompt_file
    from mlx_mtp.generate import stream_generate
    from mlx_mtp.prompts import user_prompt

    group = o.processes()
    request = dataclasses.replace(
        request, max_tokens=max_tokens, truncate_prompt=truncate_prompt
    )
    if (prompt is None) == (prompts is None):
        raise fail("pass one of --prompt and --prompts")
    if prompts is not None and prompt_cache_file is not None:
        raise fail("--prompt-cache-file continues one prompt, not --prompts")
    if prompt_cache_file is not None:  # a damaged or foreign file: before loading
        prompt_file.check(prompt_cache_file)
    if images:  # a missing or broken image: before loading
        from mlx_mtp.vision import check_images

        if prompts is not None:
            raise fail("--image goes with --prompt (not --prompts)")
        check_images(images)
    if prompts is not None:
        if group.size() > 1:
            raise fail("--prompts runs in one process, not under mlx.launch")
        texts = read_prompts(prompts)
        name, loaded, tokenizer = o.load_model(
            model, mtp, hidden_tap, not request.drafts.mtp, draft=draft
        )
        if not no_chat_template:
            _say_if_raw(name, tokenizer)
            texts = [user_prompt(tokenizer, t, system) for t in texts]
        return answer_all(loaded, tokenizer, texts, request)
    if prompt == "-" and group.size() > 1:
        # mlx.launch hands its input to every process but never closes it
        raise fail("under mlx.launch the prompt cannot come from stdin: pass it")
    text = read_prompt(prompt)
    name, loaded, tokenizer = o.load_model(
        model, mtp, hidden_tap, not request.drafts.mtp, sharding, draft
    )
    resume = {}
    if prompt_cache_file is not None:
        cached = prompt_file.load(prompt_cache_file, loaded)
        text, have, cache = prompt_file.continue_from(
            cached, loaded, tokenizer, text, system, images or None
        )
        images = None  # read with the cached prompt
        resume = {"prompt_cache": cache, "cached_tokens": have}
    else:
        if images:  # the image blocks go inside the user's message
            from mlx_mtp.vision import image_blocks

            text = image_blocks(loaded, tokenizer, text, images)
        if not no_chat_template:
            _say_if_raw(name, tokenizer)
            text = user_prompt(tokenizer, text, system)
    if images:
        from mlx_mtp.vision import with_images

        text = with_images(loaded, tokenizer, text, images)
    tokens, pieces, response, finish = [], [], None, None
    bar = PromptProgress(o.speed_notice(loaded, request))
    try:
        for response in stream_generate(
            loaded,
            tokenizer,
            text,
            request=request,
            prefill_progress=bar,
            remember=True,  # what the drafters were worth in earlier runs
            **resume,
        ):
            if truncate_prompt and not tokens and isinstance(text, str):
                dropped_notice(tokenizer, text, response.prompt_tokens)
            tokens.append(response.token)
            pieces.append(response.text)
            finish = response.finish_reason
            if not as_json:
                print(response.text, end="", flush=True)
    except KeyboardInterrupt:  # end the line, then the stats so far
        bar.close()
        finish = "interrupted"
    stats = response.stats if response is not None else None
    if as_json:
        out = {
            "text": "".join(pieces),
            "tokens": tokens,
            "finish_reason": finish,
            "stats": stats.to_dict() if stats is not None else None,
        }
        print(json.dumps(out))
    else:
        print(flush=True)
        if finish == "length":
            print(f"[cut at {len(tokens)} tokens]", file=sys.stderr)
        if stats is not None:
            why = no_drafts_reason(request.drafts.adaptive)
            print(stats.summary(why), file=sys.stderr)
    if finish == "interrupted":
        print("interrupted", file=sys.stderr)
        raise typer.Exit(130)


def _say_if_raw(name, tokenizer) -> None:
    """Once per command: a model with no chat template gets the prompt as it is."""
    from mlx_mtp.prompts import raw_prompt_notice

    notice = raw_prompt_notice(name, tokenizer)
    if notice is not None:
        print(notice, file=sys.stderr, flush=True)
