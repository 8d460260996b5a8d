"""``mlx-mtp chat``: a terminal chat; the conversation logic is ``mlx_mtp.chat``."""

import dataclasses
import sys
from pathlib import Path
from typing import Optional

import typer

from mlx_mtp.defaults import DEFAULT_MAX_TOKENS
from mlx_mtp.errors import MTPError

from . import options as o
from .app import OUTPUT, app, fail
from .progress import PromptProgress

HELP = """\
/image PATH  show an image with the next message (a vision model; repeatable)
/reset  forget the conversation (the system prompt stays)
/stats  speculative decoding totals for this conversation
/help   this list
/quit   leave (Ctrl-D too)
Up and down arrows recall earlier lines; Ctrl-C stops the answer (the
interrupted turn is dropped from the conversation). After each answer: its
tokens and speed, the prompt's, the drafts accepted and the tokens per verify
pass (mean accepted length), the peak memory; before it [cut at N tokens]
where -n cut the answer short."""
DRAFT_STYLE = "green"
PROMPT = ">>> "


def footer(stats, width: int = 80) -> str:
    """One line after each answer, at most ``width`` columns where it can be.

    Tokens and speed of the answer and of the prompt, drafts accepted, then as
    room allows the tokens per verify pass (mean accepted length) and memory.
    """
    prompt = f"prompt {stats.prompt_tokens}"
    if stats.prompt_tps:
        prompt += f", {stats.prompt_tps:.0f} tok/s"
    line = (
        f"{stats.generation_tokens} tokens, {stats.generation_tps:.1f} tok/s | "
        f"{prompt} | accepted {stats.accepted}/{stats.drafted}"
    )
    for extra in (
        f", {stats.mean_accepted_length:.2f}/pass",
        f" | {stats.peak_memory:.1f} GB",
    ):
        if len(line) + len(extra) <= width:
            line += extra
    return line


def line_editing() -> None:
    """Line editing and history for ``input`` on a terminal (where readline exists)."""
    if not sys.stdin.isatty():
        return
    try:
        import readline  # noqa: F401  (importing it is what turns it on)
    except ImportError:  # Windows
        pass


class _Waiting:
    """A spinner on a terminal until the first token arrives (reading the prompt
    can take a while); nothing where the output is not a terminal."""

    def __init__(self, console, message: str):
        terminal = console.is_terminal
        self.status = console.status(message, spinner_style="dim") if terminal else None
        if self.status is not None:
            self.status.start()

    def stop(self) -> None:
        if self.status is not None:
            self.status.stop()
            self.status = None


def _answer(console, err, session, text: str, show_drafts: bool, progress,
            images=()):  # fmt: skip
    """Stream one answer; Ctrl-C stops it and the session drops the turn.

    The footer goes to ``err`` (stderr), as ``generate`` writes its stats;
    ``progress`` (the session's ``prefill_progress``) shows in the spinner.
    """
    stream = session.send(text, image=list(images) or None)
    response = None
    waiting = _Waiting(console, "thinking")
    progress.status, progress.after = waiting.status, "thinking"
    try:
        for response in stream:
            waiting.stop()
            style = DRAFT_STYLE if show_drafts and response.from_draft else None
            console.print(
                response.text, end="", style=style, markup=False, soft_wrap=True
            )
    except KeyboardInterrupt:
        waiting.stop()
        progress.close()
        stream.close()
        console.print(
            "\n[interrupted: this turn is dropped]", style="yellow", markup=False
        )
        return
    except MTPError as e:  # e.g. the conversation outgrew the context
        waiting.stop()
        progress.close()
        console.print(
            f"error: {e} (/reset starts afresh)", markup=False, soft_wrap=True
        )
        return
    waiting.stop()
    console.print()
    if response is not None:
        if response.finish_reason == "length":
            err.print(f"[cut at {response.generation_tokens} tokens]", markup=False)
        width = max(err.width, 80) if err.is_terminal else 80
        err.print(footer(response.stats, width), style="dim", markup=False)


def _command(console, session, line: str, why: str | None, images=None) -> bool:
    """Run a /command; returns False when the chat should end (``why``: why
    the session drafts nothing, where that is known; ``images``: those the
    next message shows, which ``/image`` adds to)."""
    name = line.split()[0].lower()
    images = images if images is not None else []
    if name in ("/quit", "/exit"):
        return False
    if name == "/image":
        _add_image(console, session, line[len(name) :].strip(), images)
    elif name == "/reset":
        session.reset()
        images.clear()
        console.print("conversation reset", style="dim")
    elif name == "/stats":
        console.print(session.total.summary(why), markup=False, soft_wrap=True)
        answered = session.answered  # a dropped turn counts nowhere
        console.print(
            f"cached tokens: {len(session.cached_tokens)}, "
            f"reused in the last answered prompt: {answered.reused_tokens}"
            f"/{answered.prompt_tokens}",
            markup=False,
        )
    elif name == "/help":
        console.print(HELP, markup=False)
    else:
        console.print(f"unknown command {name} (/help lists them)", markup=False)
    return True


def _add_image(console, session, path: str, images: list) -> None:
    """``/image PATH``: read the image now (a bad one is said at once), shown
    with the next message."""
    from mlx_mtp.vision import image_blocks, read_image

    if not path:
        console.print("usage: /image PATH", markup=False)
        return
    try:
        image_blocks(session.model, session.tokenizer, "", [path])  # or why not
        images.append(read_image(Path(path).expanduser()))
    except MTPError as e:
        console.print(f"error: {e}", markup=False, soft_wrap=True)
        return
    console.print(
        f"{path}: shown with the next message", style="dim", markup=False,
        soft_wrap=True,  # a long path must not break the line
    )


def _read(console) -> Optional[str]:
    """One line from the user; None on end of input.

    Piped input is echoed after the prompt, so that the output reads as the
    conversation it was, and its end leaves no prompt behind; on a terminal
    the prompt's line is ended at the end, so that the shell's prompt does
    not land on it.
    """
    try:
        if not sys.stdin.isatty():
            sys.stdout.flush()  # as input() does: what came before is seen
            line = sys.stdin.readline()
            if not line:
                return None
            line = line.rstrip("\r\n")
            console.print(PROMPT + line, markup=False, highlight=False, soft_wrap=True)
            return line
        # input() itself prints the prompt, so that readline can redraw it
        line = input(PROMPT)
    except EOFError:
        console.print()
        return None
    except KeyboardInterrupt:
        console.print("\n(/quit or Ctrl-D to leave)", style="dim")
        return ""
    except UnicodeDecodeError:
        console.print("error: that line is not UTF-8 text", markup=False)
        return ""
    return line


@app.command()
@o.generation_options
def chat(
    model: o.ModelPath = None,
    mtp: o.HeadPath = None,
    draft: o.DraftPath = None,
    hidden_tap: o.HiddenTap = None,
    sharding: o.ShardingOption = o.Sharding.auto,
    system: Optional[str] = typer.Option(None, "--system", help="System prompt."),
    max_tokens: int = typer.Option(
        DEFAULT_MAX_TOKENS,
        "--max-tokens",
        "-n",
        min=1,
        help="Tokens per answer at most.",
    ),
    prompt_cache_file: Optional[Path] = typer.Option(
        None,
        "--prompt-cache-file",
        help="Start from a prompt read by mlx-mtp cache-prompt: the first "
        "message follows it in the same user message.",
    ),
    show_drafts: bool = typer.Option(
        False,
        "--show-drafts",
        help=f"Colour tokens that came from accepted drafts ({DRAFT_STYLE}).",
        rich_help_panel=OUTPUT,
    ),
    request=None,  # the generation options (o.generation_options)
):
    """Chat with a model in the terminal, with MTP speculative decoding."""
    from rich.console import Console

    from mlx_mtp.chat import ChatSession
    from mlx_mtp.config import no_drafts_reason
    from mlx_mtp.prompts import has_chat_template

    from mlx_mtp import prompt_file

    o.processes()
    request = dataclasses.replace(request, max_tokens=max_tokens)
    if prompt_cache_file is not None:  # a damaged or foreign file: before loading
        prompt_file.check(prompt_cache_file)
    loading = _Waiting(Console(stderr=True), "loading the model")
    try:
        model, loaded, tokenizer = o.load_model(
            model, mtp, hidden_tap, not request.drafts.mtp, sharding, draft
        )
    finally:
        loading.stop()
    if not has_chat_template(tokenizer):
        raise fail(
            f"{model} has no chat template: chat needs one (generate sends the "
            "prompt as it is)"
        )
    request.validate(loaded)  # against the model (a logit bias's ids): before a turn
    why = no_drafts_reason(request.drafts.adaptive)
    notice = o.speed_notice(loaded, request)
    if notice is not None:
        print(notice, file=sys.stderr, flush=True)
    progress = PromptProgress()
    cached = None
    if prompt_cache_file is not None:
        cached = prompt_file.load(prompt_cache_file, loaded)
        if not cached.chat_template:
            raise fail(f"{prompt_cache_file}: written without the chat template")
        if cached.segments:
            raise fail(
                f"{prompt_cache_file}: read with images, which chat does not "
                "continue (generate --prompt-cache-file --image does)"
            )
        system = system if system is not None else cached.system
    session = ChatSession(
        loaded,
        tokenizer,
        system=system,
        max_tokens=max_tokens,
        request=request,
        prefill_progress=progress,
        remember=True,  # what the drafters were worth in earlier runs
    )
    if cached is not None:
        session.resume(cached.cache, cached.tokens, cached.prompt)
    console = Console(highlight=False)
    err = Console(stderr=True, highlight=False)
    line_editing()
    console.print("Type a message; /help lists the commands.", style="dim")
    if show_drafts:
        console.print("tokens from accepted drafts", style=DRAFT_STYLE)
    images = []  # shown with the next message (/image)
    while True:
        line = _read(console)
        if line is None:
            break
        line = line.strip()
        if not line:
            continue
        if line.startswith("/"):
            if not _command(console, session, line, why, images):
                break
            continue
        _answer(console, err, session, line, show_drafts, progress, images)
        images.clear()
