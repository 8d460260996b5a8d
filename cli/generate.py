"""``mlx-mtp generate``: stream a completion, then the speculative stats."""

import json
import sys
from pathlib import Path
from typing import Optional

import typer

from mlx_mtp.default_model import default_model_path
from mlx_mtp.generate import DEFAULT_MAX_TOKENS, stream_generate
from mlx_mtp.loader import load
from mlx_mtp.speculative import DEFAULT_DRAFT_MAX, DEFAULT_DRAFT_P_MIN
from mlx_mtp.trunk import HIDDEN_TAPS

from . import options as o
from .app import MODEL, OUTPUT, SPECULATIVE, app, fail


def read_prompt(prompt: str) -> str:
    return sys.stdin.read() if prompt == "-" else prompt


def apply_template(tokenizer, prompt: str, system: Optional[str], use_template: bool):
    """The chat template applied to one user message, when the tokenizer has one."""
    if not use_template or getattr(tokenizer, "chat_template", None) is None:
        return prompt
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": prompt})
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )


@app.command()
def generate(
    model: Optional[Path] = typer.Option(None, "--model", "-m", help="MLX model folder (default: SmolLM2-135M-Instruct with its shipped MTP head).", rich_help_panel=MODEL),
    prompt: str = typer.Option(..., "--prompt", "-p", help="Prompt text, or - to read stdin."),
    mtp: Optional[Path] = typer.Option(None, "--mtp", help="Attach the MTP head from this folder or file.", rich_help_panel=MODEL),
    hidden_tap: Optional[str] = typer.Option(None, "--hidden-tap", help="Hidden state fed to the head: post (after the final norm) or pre.", rich_help_panel=MODEL),
    system: Optional[str] = typer.Option(None, "--system", help="System prompt for the chat template."),
    no_chat_template: bool = typer.Option(False, "--no-chat-template", help="Use the prompt as is."),
    max_tokens: int = typer.Option(DEFAULT_MAX_TOKENS, "--max-tokens", "-n", min=1, help="Tokens to generate at most."),
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
    no_mtp: bool = typer.Option(False, "--no-mtp", help="Generate without MTP (same loop, no drafts).", rich_help_panel=SPECULATIVE),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object (text, tokens, stats) instead of streaming.", rich_help_panel=OUTPUT),
):
    """Generate text with MTP speculative decoding."""
    if hidden_tap is not None and hidden_tap not in HIDDEN_TAPS:
        raise fail(f"--hidden-tap must be one of {', '.join(HIDDEN_TAPS)}")
    sampling = o.sampling_kwargs(
        temp, top_p, top_k, min_p, repetition_penalty, presence_penalty,
        frequency_penalty, logit_bias, seed, draft_sampling, adaptive_draft,
    )
    text = read_prompt(prompt)
    if model is None:
        model = default_model_path(lambda line: print(line, file=sys.stderr))
    loaded, tokenizer = load(model, mtp=mtp, hidden_tap=hidden_tap)
    if loaded.notice and not no_mtp:
        print(f"notice: {loaded.notice}", file=sys.stderr)
    text = apply_template(tokenizer, text, system, not no_chat_template)
    tokens, pieces, response = [], [], None
    for response in stream_generate(
        loaded,
        tokenizer,
        text,
        max_tokens,
        draft_max=draft_max,
        draft_p_min=draft_p_min,
        mtp=not no_mtp,
        **sampling,
    ):
        tokens.append(response.token)
        pieces.append(response.text)
        if not as_json:
            print(response.text, end="", flush=True)
    stats = response.stats if response is not None else None
    if as_json:
        out = {"text": "".join(pieces), "tokens": tokens, "stats": stats.to_dict()}
        print(json.dumps(out))
    else:
        print()
        print(stats.summary(), file=sys.stderr)
