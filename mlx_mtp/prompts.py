"""Prompts: encoding, chat templates, fitting the context, the shipped prompt set.

The command line, the server, ``bench`` and ``tune`` all turn text into
tokens here, so that a prompt is encoded the same way wherever it comes from.
"""

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Union

import mlx.core as mx

from .errors import MTPError
from .prompt import Prompt

# where a model's config gives the most tokens it reads, first found wins
CONTEXT_KEYS = ("max_position_embeddings", "max_sequence_length", "seq_length")


def encode(tokenizer, prompt: Union[str, Sequence[int], mx.array]) -> List[int]:
    """Token ids of ``prompt``: text is encoded with the tokenizer's special
    tokens unless it already starts with its BOS; ids pass through."""
    if isinstance(prompt, str):
        bos = getattr(tokenizer, "bos_token", None)
        add_special = bos is None or not prompt.startswith(bos)
        return tokenizer.encode(prompt, add_special_tokens=add_special)
    if isinstance(prompt, mx.array):
        return prompt.tolist()
    return [int(t) for t in prompt]


def encode_prompt(tokenizer, prompt) -> Prompt:
    """``prompt`` as a ``Prompt``: one as it is (tokens with media), else the
    token ids of text or ids (``encode``)."""
    if isinstance(prompt, Prompt):
        return prompt
    return Prompt(tuple(encode(tokenizer, prompt)))


def fit_prompt(
    prompt: Prompt,
    cached: int,
    max_tokens: int,
    context: Optional[int],
    truncate: bool,
    bos: Optional[int] = None,
) -> tuple:
    """``fit_context`` for a ``Prompt``: one with media is never truncated
    (its oldest positions may be an image's)."""
    tokens, limit = fit_context(
        list(prompt.tokens), cached, max_tokens, context,
        truncate and not prompt.segments, bos,
    )  # fmt: skip
    if len(tokens) != len(prompt):
        prompt = Prompt(tuple(tokens))
    return prompt, limit


def has_chat_template(tokenizer) -> bool:
    return getattr(tokenizer, "chat_template", None) is not None


def raw_prompt_notice(name, tokenizer) -> Optional[str]:
    """The line that says a model without a chat template (a base model) gets
    the prompt as it is; None when it has one."""
    if has_chat_template(tokenizer):
        return None
    return f"{name} has no chat template: the prompt is sent as it is"


def chat_text(tokenizer, messages: List[Dict[str, str]]) -> str:
    """The conversation through the chat template, ready for the answer."""
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )


def user_prompt(tokenizer, prompt: str, system: Optional[str] = None) -> str:
    """One user message (after ``system``) through the chat template; the
    text unchanged when the tokenizer has no template."""
    if not has_chat_template(tokenizer):
        return prompt
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": prompt})
    return chat_text(tokenizer, messages)


def context_length(model) -> Optional[int]:
    """The most tokens the model reads (its config's position limit), if known."""
    for config in (model.config, model.config.get("text_config") or {}):
        for key in CONTEXT_KEYS:
            if isinstance(config.get(key), int) and config[key] > 0:
                return config[key]
    return None


def fit_context(
    tokens: List[int],
    cached: int,
    max_tokens: int,
    context: Optional[int],
    truncate: bool,
    bos: Optional[int] = None,
) -> tuple:
    """``(tokens, max_tokens)`` that fit in ``context`` with ``cached`` tokens before.

    A prompt longer than the context is an error unless ``truncate``: then
    its oldest tokens go (a leading ``bos`` stays) so that the prompt and
    ``max_tokens`` fit, keeping at least half the context for the prompt.
    Generation stops where the context ends.
    """
    if context is None:
        return tokens, max_tokens
    if cached + len(tokens) > context:
        if not truncate or cached:
            raise MTPError(
                f"the prompt holds {cached + len(tokens)} tokens, more than the "
                f"model's context of {context} tokens"
            )
        keep = max(context - max_tokens, context // 2)
        head = tokens[:1] if bos is not None and tokens[0] == bos else []
        tokens = head + tokens[len(tokens) - keep + len(head) :]
    # the last new token is predicted at position context - 1
    return tokens, min(max_tokens, context + 1 - cached - len(tokens))


# -- prompt sets -----------------------------------------------------------------


@dataclass
class BenchPrompt:
    kind: str
    prompt: str


def load_prompts(path: Optional[Path] = None) -> List[BenchPrompt]:
    """The shipped prompts (code, prose, chat), or those in ``path``.

    A ``.json`` file holds a list of ``{"kind": ..., "prompt": ...}`` objects
    or of strings; any other file holds one prompt per non-empty line.
    """
    if path is None:
        text = resources.files("mlx_mtp").joinpath("bench_prompts.json").read_text()
        return _parse_prompts(json.loads(text), "bench_prompts.json")
    path = Path(path)
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise MTPError(
            f"{path}: cannot read prompts ({e.__class__.__name__})"
        ) from None
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise MTPError(f"{path}: not valid JSON ({e})") from None
        return _parse_prompts(data, path)
    prompts = [BenchPrompt("file", line) for line in text.splitlines() if line.strip()]
    if not prompts:
        raise MTPError(f"{path}: no prompts")
    return prompts


def read_jsonl_prompts(lines: Sequence[str], where: str) -> List[str]:
    """The prompts of JSON Lines: each non-empty line a JSON string or an
    object with a string ``"prompt"``. ``where`` names the source in errors."""
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise MTPError(f"{where}:{n}: not valid JSON ({e.msg})") from None
        if isinstance(item, dict):
            item = item.get("prompt")
        if not isinstance(item, str) or not item.strip():
            raise MTPError(
                f'{where}:{n}: expected a non-empty string or {{"prompt": "..."}}'
            )
        out.append(item)
    if not out:
        raise MTPError(f"{where}: no prompts")
    return out


def _parse_prompts(data, where) -> List[BenchPrompt]:
    if not isinstance(data, list) or not data:
        raise MTPError(f"{where}: expected a non-empty list of prompts")
    out = []
    for item in data:
        if isinstance(item, str):
            out.append(BenchPrompt("file", item))
        elif isinstance(item, dict) and isinstance(item.get("prompt"), str):
            out.append(BenchPrompt(str(item.get("kind", "file")), item["prompt"]))
        else:
            raise MTPError(
                f'{where}: each prompt must be a string or {{"prompt": ...}}'
            )
    return out


def encoded_prompts(tokenizer, prompts: Sequence[BenchPrompt]) -> List[List[int]]:
    """Each prompt as one user message through the chat template, encoded."""
    return [encode(tokenizer, user_prompt(tokenizer, p.prompt)) for p in prompts]
