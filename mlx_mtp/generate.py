"""The Python API, in mlx-lm's three layers: step generator, stream, string."""

from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Sequence, Union

import mlx.core as mx

from .cache import MTPCache
from .distributed import sync_verifier
from .loader import MTPModel
from .adaptive import AdaptiveDraftLength
from .sampling import LogitsProcessor, Sampler, SamplingConfig, make_verifier
from .speculative import (
    DEFAULT_DRAFT_MAX,
    DEFAULT_DRAFT_P_MIN,
    DEFAULT_PREFILL_STEP,
    speculative_generate_step,
)
from .stats import MTPStats

DEFAULT_MAX_TOKENS = 256


@dataclass
class GenerationResponse:
    """One streamed token.

    ``text`` is the next segment of decoded text (may be empty); ``from_draft``
    says the token was an accepted draft; ``stats`` is the running
    ``MTPStats`` (the same object throughout one generation).
    """

    text: str
    token: int
    from_draft: bool
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    peak_memory: float
    stats: MTPStats
    finish_reason: Optional[str] = None


def _encode(tokenizer, prompt: Union[str, Sequence[int], mx.array]) -> List[int]:
    if isinstance(prompt, str):
        bos = getattr(tokenizer, "bos_token", None)
        add_special = bos is None or not prompt.startswith(bos)
        return tokenizer.encode(prompt, add_special_tokens=add_special)
    if isinstance(prompt, mx.array):
        return prompt.tolist()
    return [int(t) for t in prompt]


def stream_generate(
    model: MTPModel,
    tokenizer: Any,
    prompt: Union[str, Sequence[int], mx.array],
    max_tokens: int = DEFAULT_MAX_TOKENS,
    *,
    draft_max: int = DEFAULT_DRAFT_MAX,
    draft_p_min: float = DEFAULT_DRAFT_P_MIN,
    mtp: bool = True,
    sampler: Optional[Sampler] = None,
    logits_processors: Optional[Sequence[LogitsProcessor]] = None,
    verifier: Optional[Any] = None,
    prompt_cache: Optional[MTPCache] = None,
    cached_tokens: Sequence[int] = (),
    prefill_step_size: int = DEFAULT_PREFILL_STEP,
    trace: bool = False,
    temp: float = 0.0,
    top_p: float = 0.0,
    top_k: int = 0,
    min_p: float = 0.0,
    repetition_penalty: Optional[float] = None,
    presence_penalty: Optional[float] = None,
    frequency_penalty: Optional[float] = None,
    logit_bias: Optional[Dict[int, float]] = None,
    seed: Optional[int] = None,
    draft_sampling: str = "greedy",
    adaptive_draft: bool = False,
) -> Iterator[GenerationResponse]:
    """Generate from ``prompt``, yielding a ``GenerationResponse`` per token.

    ``mtp=False`` (or ``draft_max=0``) generates plainly through the same loop.
    ``trace=True`` records every round's drafts in ``response.stats.trace``.
    With a ``prompt_cache`` from an earlier call, ``prompt`` holds only the new
    tokens and ``cached_tokens`` those already in the cache.

    Sampling takes mlx-lm's settings (``temp`` .. ``logit_bias``, penalties
    over the last 20 tokens) and is lossless: the output has the main model's
    distribution. ``seed`` fixes the run; with greedy drafts the tokens are the
    same with and without MTP. ``draft_sampling="sample"`` samples drafts
    through the same chain (accepted with min(1, p/q)). ``adaptive_draft``
    picks each round's draft length (at most ``draft_max``) from the running
    per-position acceptance. A custom ``sampler=`` is exact-matched instead;
    ``verifier=`` replaces all of these.
    """
    tokens = _encode(tokenizer, prompt)
    if verifier is None:
        config = SamplingConfig(
            temp=temp,
            top_p=top_p,
            top_k=top_k,
            min_p=min_p,
            repetition_penalty=repetition_penalty,
            presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty,
            logit_bias=logit_bias,
            seed=seed,
            draft_sampling=draft_sampling,
        )
        verifier = make_verifier(config, sampler, logits_processors)
    policy = AdaptiveDraftLength(draft_max) if adaptive_draft and mtp else None
    stats = MTPStats(trace=[] if trace else None)
    verifier = sync_verifier(model, verifier, stats)  # over processes: one decision
    detokenizer = tokenizer.detokenizer
    detokenizer.reset()
    stop_tokens = set(getattr(tokenizer, "eos_token_ids", ()) or ())
    steps = speculative_generate_step(
        tokens,
        model,
        max_tokens=max_tokens,
        draft_max=draft_max if mtp else 0,
        draft_p_min=draft_p_min,
        verifier=verifier,
        draft_policy=policy,
        stop_tokens=stop_tokens,
        prompt_cache=prompt_cache,
        prefill_step_size=prefill_step_size,
        stats=stats,
        cached_tokens=cached_tokens,
    )
    n = 0
    for token, from_draft in steps:
        n += 1
        finish = None
        if token in stop_tokens:
            finish = "stop"
        elif n == max_tokens:
            finish = "length"
        if finish != "stop":
            detokenizer.add_token(token)
        if finish is not None:
            detokenizer.finalize()
        yield GenerationResponse(
            text=detokenizer.last_segment,
            token=token,
            from_draft=from_draft,
            prompt_tokens=stats.prompt_tokens,
            prompt_tps=stats.prompt_tps,
            generation_tokens=n,
            generation_tps=stats.generation_tps,
            peak_memory=stats.peak_memory,
            stats=stats,
            finish_reason=finish,
        )


def generate(
    model: MTPModel,
    tokenizer: Any,
    prompt: Union[str, Sequence[int], mx.array],
    max_tokens: int = DEFAULT_MAX_TOKENS,
    verbose: bool = False,
    **kwargs,
) -> str:
    """Generate a completion and return it as one string (see ``stream_generate``)."""
    text = ""
    response = None
    for response in stream_generate(model, tokenizer, prompt, max_tokens, **kwargs):
        if verbose:
            print(response.text, end="", flush=True)
        text += response.text
    if verbose and response is not None:
        print()
        print(response.stats.summary())
    return text


def mtp_logits(model: MTPModel, tokens: Union[Sequence[int], mx.array]) -> mx.array:
    """Teacher-forced depth-1 MTP logits at every position of ``tokens``.

    Row ``i`` is the head's prediction of ``tokens[i + 2]`` from the trunk's
    hidden state at ``i`` and the true ``tokens[i + 1]``: shape ``[L - 1, V]``
    (the last row predicts the token after the sequence).
    """
    if model.head is None:
        raise ValueError("this model has no MTP head")
    tokens = mx.array(tokens).reshape(1, -1)
    _, hidden = model.trunk(tokens, model.trunk.make_cache())
    logits, _ = model.head(hidden[:, :-1], tokens[:, 1:], model.head.make_cache())
    return logits[0]
