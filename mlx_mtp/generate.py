"""The Python API, in mlx-lm's three layers: step generator, stream, string."""

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import mlx.core as mx

from .adaptive import make_policy
from .cache import MTPCache
from .config import default_draft_max
from .defaults import (
    DEFAULT_DRAFT_P_MIN,
    DEFAULT_DRAFT_SOURCE,
    DEFAULT_MAX_TOKENS,
    DEFAULT_PREFILL_STEP,
    MAX_DRAFT_MAX,
)
from .distributed import sync_verifier
from .errors import MTPError
from .loader import MTPModel
from .ngram import make_lookup
from .prompts import context_length, encode, fit_context
from .sampling import LogitsProcessor, Sampler, SamplingConfig, make_verifier
from .speculative import speculative_generate_step
from .stats import MTPStats


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


def stream_generate(
    model: MTPModel,
    tokenizer: Any,
    prompt: Union[str, Sequence[int], mx.array],
    max_tokens: int = DEFAULT_MAX_TOKENS,
    *,
    draft_max: Optional[int] = None,
    draft_p_min: float = DEFAULT_DRAFT_P_MIN,
    mtp: bool = True,
    sampling: Optional[SamplingConfig] = None,
    sampler: Optional[Sampler] = None,
    logits_processors: Optional[Sequence[LogitsProcessor]] = None,
    verifier: Optional[Any] = None,
    prompt_cache: Optional[MTPCache] = None,
    cached_tokens: Sequence[int] = (),
    prefill_step_size: int = DEFAULT_PREFILL_STEP,
    prefill_progress: Optional[Callable[[int, int], None]] = None,
    truncate_prompt: bool = False,
    trace: bool = False,
    adaptive_draft: bool = True,
    draft_source: str = DEFAULT_DRAFT_SOURCE,
    **sampling_kwargs,
) -> Iterator[GenerationResponse]:
    """Generate from ``prompt``, yielding a ``GenerationResponse`` per token.

    ``mtp=False`` (or ``draft_max=0``) generates plainly through the same loop.
    ``trace=True`` records every round's drafts in ``response.stats.trace``.
    With a ``prompt_cache`` from an earlier call, ``prompt`` holds only the new
    tokens and ``cached_tokens`` those already in the cache.

    Sampling takes a ``SamplingConfig`` (``sampling=``), or its fields as
    keyword arguments as mlx-lm's take them (``temp=``, ``top_p=``, ..,
    ``logit_bias=``, ``seed=``, ``draft_sampling=``; penalties over the last
    20 tokens), and is lossless: the output has the main model's
    distribution. ``seed`` fixes the run; with greedy drafts the tokens are the
    same with and without MTP. ``draft_sampling="sample"`` samples drafts
    through the same chain (accepted with min(1, p/q)). A custom
    ``sampler=`` is exact-matched instead; ``verifier=`` replaces all of these.

    ``draft_source``: "mtp" drafts with the head alone, "ngram" with prompt
    lookup alone (what followed the last earlier occurrence of the latest
    tokens), "auto" (the default) with whichever is expected to keep more per
    unit of time each round; every draft goes through the same verify.
    ``draft_max`` bounds the drafts per round (default: the head's
    ``recommended_draft_max``, else ``DEFAULT_DRAFT_MAX``); each round drafts
    as many as pay for themselves by the costs ``mlx-mtp tune`` measured here
    and the acceptance so far (``adaptive_draft=False``: always ``draft_max``).

    A prompt longer than the model's context raises ``MTPError`` unless
    ``truncate_prompt`` (see ``fit_context``); generation stops at the end of
    the context. ``prefill_progress(done, total)`` hears how many prompt
    tokens the trunk has read, before the first chunk and after each.
    """
    if draft_max is not None and not 0 <= draft_max <= MAX_DRAFT_MAX:
        raise MTPError(f"draft_max must be 0 to {MAX_DRAFT_MAX}, not {draft_max}")
    if sampling is not None and sampling_kwargs:
        names = ", ".join(sorted(sampling_kwargs))
        raise TypeError(f"pass either sampling= or its fields ({names}), not both")
    tokens = encode(tokenizer, prompt)
    if not tokens or (isinstance(prompt, str) and not prompt.strip()):
        raise MTPError("the prompt is empty")
    tokens, max_tokens = fit_context(
        tokens,
        len(cached_tokens),
        max_tokens,
        context_length(model),
        truncate_prompt,
        getattr(tokenizer, "bos_token_id", None),
    )
    if verifier is None:
        if sampling is None:
            sampling = SamplingConfig(**sampling_kwargs)
        verifier = make_verifier(sampling, sampler, logits_processors)
    if draft_max is None:
        draft_max = default_draft_max(model)
    # lookups are free to make: their own bound (DEFAULT_LOOKUP_MAX), and the
    # costs and their running acceptance decide how many a round checks
    lookup = make_lookup(model, draft_source) if mtp else None
    if not mtp or draft_source == "ngram":  # no drafts / prompt lookup alone
        draft_max = 0
    policy = make_policy(model, draft_max, adaptive_draft)
    stats = MTPStats(trace=[] if trace else None)
    verifier = sync_verifier(model, verifier, stats)  # over processes: one decision
    detokenizer = tokenizer.detokenizer
    detokenizer.reset()
    stop_tokens = set(getattr(tokenizer, "eos_token_ids", ()) or ())
    steps = speculative_generate_step(
        tokens,
        model,
        max_tokens=max_tokens,
        draft_p_min=draft_p_min,
        verifier=verifier,
        draft_policy=policy,
        stop_tokens=stop_tokens,
        prompt_cache=prompt_cache,
        prefill_step_size=prefill_step_size,
        prefill_progress=prefill_progress,
        stats=stats,
        cached_tokens=cached_tokens,
        lookup=lookup,
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
