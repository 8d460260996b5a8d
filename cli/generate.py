"""``mlx-mtp generate``: stream a completion, then the speculative stats."""

import json
import sys
from typing import Optional

import typer

from mlx_mtp.generate import DEFAULT_MAX_TOKENS, stream_generate
from mlx_mtp.speculative import DEFAULT_DRAFT_MAX, DEFAULT_DRAFT_P_MIN

from . import options as o
from .app import OUTPUT, app, fail


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
    model: o.ModelPath = None,
    prompt: str = typer.Option(..., "--prompt", "-p", help="Prompt text, or - to read stdin."),
    mtp: o.HeadPath = None,
    hidden_tap: o.HiddenTap = None,
    sharding: o.ShardingOption = o.Sharding.auto,
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
    no_mtp: o.NoMTP = False,
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object (text, tokens, stats) instead of streaming.", rich_help_panel=OUTPUT),
):
    """Generate text with MTP speculative decoding."""
    group = o.processes()
    sampling = o.sampling_kwargs(
        temp, top_p, top_k, min_p, repetition_penalty, presence_penalty,
        frequency_penalty, logit_bias, seed, draft_sampling, adaptive_draft,
    )
    if prompt == "-" and group.size() > 1:
        # mlx.launch hands its input to every process but never closes it
        raise fail("under mlx.launch the prompt cannot come from stdin: pass it")
    text = read_prompt(prompt)
    _, loaded, tokenizer = o.load_model(model, mtp, hidden_tap, no_mtp, sharding)
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
