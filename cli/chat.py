"""``mlx-mtp chat``: a terminal chat; the conversation logic is ``mlx_mtp.chat``."""

from typing import Optional

import typer
from rich.console import Console

from mlx_mtp.chat import ChatSession
from mlx_mtp.generate import DEFAULT_MAX_TOKENS
from mlx_mtp.speculative import DEFAULT_DRAFT_MAX, DEFAULT_DRAFT_P_MIN
from mlx_mtp.stats import MTPStats

from . import options as o
from .app import OUTPUT, app, fail

HELP = """\
/reset  forget the conversation (the system prompt stays)
/stats  speculative decoding totals for this conversation
/help   this list
/quit   leave (Ctrl-D too)
Ctrl-C stops the answer; the interrupted turn is dropped from the conversation."""
DRAFT_STYLE = "green"


def footer(stats: MTPStats) -> str:
    """One line after each answer: speed, acceptance, memory."""
    return (
        f"{stats.generation_tokens} tokens, {stats.generation_tps:.1f} tok/s | "
        f"prompt {stats.prompt_tokens} tokens, {stats.prompt_tps:.1f} tok/s | "
        f"acceptance {stats.acceptance_rate:.2f} "
        f"({stats.accepted}/{stats.drafted}), "
        f"mean accepted length {stats.mean_accepted_length:.2f} | "
        f"peak {stats.peak_memory:.3f} GB"
    )


def _answer(console: Console, session: ChatSession, text: str, show_drafts: bool):
    """Stream one answer; Ctrl-C stops it and the session drops the turn."""
    stream = session.send(text)
    response = None
    try:
        for response in stream:
            style = DRAFT_STYLE if show_drafts and response.from_draft else None
            console.print(
                response.text, end="", style=style, markup=False, soft_wrap=True
            )
    except KeyboardInterrupt:
        stream.close()
        console.print(
            "\n[interrupted: this turn is dropped]", style="yellow", markup=False
        )
        return
    console.print()
    if response is not None:
        console.print(footer(response.stats), style="dim", markup=False, soft_wrap=True)


def _command(console: Console, session: ChatSession, line: str) -> bool:
    """Run a /command; returns False when the chat should end."""
    name = line.split()[0].lower()
    if name in ("/quit", "/exit"):
        return False
    if name == "/reset":
        session.reset()
        console.print("conversation reset", style="dim")
    elif name == "/stats":
        console.print(session.total.summary(), markup=False, soft_wrap=True)
        console.print(
            f"cached tokens: {len(session.cached_tokens)}, "
            f"reused in the last prompt: {session.last.reused_tokens}"
            f"/{session.last.prompt_tokens}",
            markup=False,
        )
    elif name == "/help":
        console.print(HELP, markup=False)
    else:
        console.print(f"unknown command {name} (/help lists them)", markup=False)
    return True


def _read(console: Console) -> Optional[str]:
    """One line from the user; None on end of input."""
    try:
        return console.input("[bold]>>> [/]")
    except EOFError:
        return None
    except KeyboardInterrupt:
        console.print("\n(/quit or Ctrl-D to leave)", style="dim")
        return ""


@app.command()
def chat(
    model: o.ModelPath = None,
    mtp: o.HeadPath = None,
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
    temp: o.Temp = 0.0,
    top_p: o.TopP = 0.0,
    top_k: o.TopK = 0,
    min_p: o.MinP = 0.0,
    repetition_penalty: o.RepetitionPenalty = None,
    presence_penalty: o.PresencePenalty = None,
    frequency_penalty: o.FrequencyPenalty = None,
    logit_bias: o.LogitBias = None,
    seed: o.Seed = None,
    draft_max: o.DraftMax = DEFAULT_DRAFT_MAX,
    draft_p_min: o.DraftPMin = DEFAULT_DRAFT_P_MIN,
    draft_sampling: o.DraftSamplingOption = o.DraftSampling.greedy,
    adaptive_draft: o.AdaptiveDraft = False,
    no_mtp: o.NoMTP = False,
    show_drafts: bool = typer.Option(
        False,
        "--show-drafts",
        help=f"Colour tokens that came from accepted drafts ({DRAFT_STYLE}).",
        rich_help_panel=OUTPUT,
    ),
):
    """Chat with a model in the terminal, with MTP speculative decoding."""
    o.processes()
    sampling = o.sampling_kwargs(
        temp,
        top_p,
        top_k,
        min_p,
        repetition_penalty,
        presence_penalty,
        frequency_penalty,
        logit_bias,
        seed,
        draft_sampling,
        adaptive_draft,
    )
    model, loaded, tokenizer = o.load_model(model, mtp, hidden_tap, no_mtp, sharding)
    if getattr(tokenizer, "chat_template", None) is None:
        raise fail(f"{model}: the tokenizer has no chat template")
    session = ChatSession(
        loaded,
        tokenizer,
        system=system,
        max_tokens=max_tokens,
        draft_max=draft_max,
        draft_p_min=draft_p_min,
        mtp=not no_mtp,
        **sampling,
    )
    console = Console(highlight=False)
    console.print("Type a message; /help lists the commands.", style="dim")
    if show_drafts:
        console.print("tokens from accepted drafts", style=DRAFT_STYLE)
    while True:
        line = _read(console)
        if line is None:
            break
        line = line.strip()
        if not line:
            continue
        if line.startswith("/"):
            if not _command(console, session, line):
                break
            continue
        _answer(console, session, line, show_drafts)
