"""The Python API, in mlx-lm's three layers: step generator, stream, string."""

import difflib
import inspect
import numbers
import time
from collections import deque
from dataclasses import dataclass, fields
from typing import Any, Callable, Deque, Iterator, Optional, Sequence, Union

import mlx.core as mx

from . import remembered
from .cache import StreamCache
from .config import no_drafts_reason
from .defaults import (
    DEFAULT_DRAFT_P_MIN,
    DEFAULT_DRAFT_SOURCE,
    DEFAULT_KV_GROUP_SIZE,
    DEFAULT_MAX_TOKENS,
    DEFAULT_PREFILL_STEP,
    DEFAULT_QUANTIZED_KV_START,
)
from .distributed import sync_verifier
from .errors import MTPError
from .kv import KVSettings
from .loader import MTPModel
from .prompt import Prompt
from .vision import with_images
from .prompts import context_length, encode_prompt, fit_prompt
from .request import DraftSettings, GenerationRequest
from .sampling import LogitsProcessor, Sampler, SamplingConfig
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
    # as mlx-lm's: log-probabilities over the vocabulary of the distribution
    # ``token`` came from, after the logits processors, before temperature and
    # filters; taken from the verify's logits, computed only when read
    logprobs: Optional[mx.array] = None


class _Rows:
    """Where a stream's kept tokens leave their log-probability rows (the
    ``stream.Logprobs`` interface), left lazy for the responses to carry."""

    def __init__(self):
        self.rows: Deque[mx.array] = deque()

    def record(self, logprobs: mx.array, tokens: Sequence[int]) -> None:
        self.rows.extend(logprobs[i] for i in range(len(tokens)))


def stream_generate(
    model: MTPModel,
    tokenizer: Any,
    prompt: Union[str, Sequence[int], mx.array, Prompt],
    max_tokens: int = DEFAULT_MAX_TOKENS,
    *,
    request: Optional[GenerationRequest] = None,
    sampler: Optional[Sampler] = None,
    verifier: Optional[Any] = None,
    prompt_cache: Optional[StreamCache] = None,
    cached_tokens: Sequence[int] = (),
    prefill_step_size: int = DEFAULT_PREFILL_STEP,
    prefill_progress: Optional[Callable[[int, int], None]] = None,
    trace: bool = False,
    remember: bool = False,
    image: Optional[Any] = None,
    **kwargs,
) -> Iterator[GenerationResponse]:
    """Generate from ``prompt`` (text, token ids, or a ``prompt.Prompt``:
    tokens with media), yielding a ``GenerationResponse`` per token.

    What to generate is a ``GenerationRequest`` (``request=``), or its fields
    as keyword arguments (see ``request_from``): sampling as mlx-lm takes it
    (``temp=``, ``top_p=``, .., ``logit_bias=``, ``seed=``, or a whole
    ``sampling=SamplingConfig``), ``draft_max=``, ``draft_p_min=``,
    ``draft_source=``, ``adaptive_draft=``, ``mtp=``, ``logits_processors=``,
    ``truncate_prompt=``, and mlx-lm's cache keywords ``kv_bits=``,
    ``kv_group_size=``, ``quantized_kv_start=``, ``max_kv_size=`` (a
    quantized or bounded cache that still rolls drafts back; see ``kv.py``).
    An unknown keyword is a ``TypeError``.

    ``mtp=False`` (or ``draft_max=0``) generates plainly through the same loop.
    ``trace=True`` records every round's drafts in ``response.stats.trace``.
    With a ``prompt_cache`` from an earlier call, ``prompt`` holds only the new
    tokens and ``cached_tokens`` those already in the cache.

    As in mlx-lm, ``prompt_tps`` is the prompt's tokens per second until the
    first token, and ``logprobs`` each token's distribution (``[V]``).

    Sampling is lossless: the output has the main model's distribution.
    ``seed`` fixes the run; with greedy drafts the tokens are the same with
    and without MTP. ``draft_sampling="sample"`` samples drafts through the
    same chain (accepted with min(1, p/q)). A custom ``sampler=`` is
    exact-matched instead; ``verifier=`` replaces all of these.

    ``draft_source``: "mtp" drafts with the head alone, "ngram" with prompt
    lookup alone (what followed the last earlier occurrence of the latest
    tokens), "auto" (the default) with whichever is expected to keep more per
    unit of time each round; every draft goes through the same verify.
    ``draft_max`` bounds the head's drafts per round (default: the head's
    ``recommended_draft_max``, else ``DEFAULT_DRAFT_MAX``); each round drafts
    as many as pay for themselves by the costs ``mlx-mtp tune`` measured here
    and the acceptance so far (``adaptive_draft=False``: always ``draft_max``).

    A prompt longer than the model's context raises ``MTPError`` unless
    ``truncate_prompt`` (see ``fit_context``); generation stops at the end of
    the context. ``prefill_progress(done, total)`` hears how many prompt
    tokens the trunk has read, before the first chunk and after each.

    ``remember=True`` starts each drafter where earlier generations with it
    on this model left it, and leaves one that cannot pay by them out, as a
    server does across its requests; those histories are kept across
    processes (``remembered``; the command line's ``generate`` and ``chat``
    keep them). Greedy output stays the same, and sampled output keeps its
    distribution: only which drafts are made changes.

    ``image`` (a path, or a list of paths), as mlx-vlm's ``generate`` takes
    it: the images a vision model (``vision.py``) reads with the text prompt
    (an image block per image goes in front where the text names none).
    """
    if request is not None and kwargs:
        names = ", ".join(sorted(kwargs))
        raise TypeError(f"pass either request= or its fields ({names}), not both")
    if request is None:
        request = request_from(max_tokens, caller="stream_generate", **kwargs)
    request.validate(model)
    request.kv.check_model(model)
    tic = time.perf_counter()
    prompt = with_images(model, tokenizer, prompt, image)
    tokens = encode_prompt(tokenizer, prompt)
    if not len(tokens) or (isinstance(prompt, str) and not prompt.strip()):
        raise MTPError("the prompt is empty")
    tokens, max_tokens = fit_prompt(
        tokens,
        len(cached_tokens),
        request.max_tokens,
        context_length(model),
        request.truncate_prompt,
        getattr(tokenizer, "bos_token_id", None),
    )
    verifier = verifier or request.verifier(sampler)
    stats = MTPStats(trace=[] if trace else None)
    verifier = sync_verifier(model, verifier, stats)  # over processes: one decision
    detokenizer = tokenizer.detokenizer
    detokenizer.reset()
    stop_tokens = set(getattr(tokenizer, "eos_token_ids", ()) or ())
    rows = _Rows()
    history = remembered.load(model) if remember else None
    steps = speculative_generate_step(
        tokens,
        model,
        max_tokens=max_tokens,
        draft_p_min=request.drafts.p_min,
        verifier=verifier,
        drafts=request.source(model, history=history),
        stop_tokens=stop_tokens,
        prompt_cache=prompt_cache,
        prefill_step_size=prefill_step_size,
        prefill_progress=prefill_progress,
        stats=stats,
        cached_tokens=cached_tokens,
        logprobs=rows,
        kv=request.kv,
    )
    n, prompt_tps = 0, 0.0
    try:
        for token, from_draft in steps:
            n += 1
            if n == 1:
                prompt_tps = stats.prompt_tokens / (time.perf_counter() - tic)
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
                prompt_tps=prompt_tps,
                generation_tokens=n,
                generation_tps=stats.generation_tps,
                peak_memory=stats.peak_memory,
                stats=stats,
                finish_reason=finish,
                logprobs=rows.rows.popleft(),
            )
    finally:  # the histories the next run starts from
        if history is not None:
            remembered.save(model, history)


# mlx-lm's keywords that mlx-mtp does not take, and what it takes instead
_INSTEAD = {
    "draft_model": "mlx-mtp drafts with the model's own MTP head (another is "
    "attached with mlx_mtp.load(..., mtp=FOLDER), --mtp on the command line) "
    "or with prompt lookup: choose with draft_source='mtp', 'ngram' or 'auto' "
    "and draft_max=",
    "num_draft_tokens": "the drafts per round are draft_max=",
    "prompt_progress_callback": "pass prefill_progress=, called as (done, total)",
    "input_embeddings": "mlx-mtp generates from tokens only",
}


def request_from(
    max_tokens: int = DEFAULT_MAX_TOKENS,
    *,
    draft_max: Optional[int] = None,
    draft_p_min: float = DEFAULT_DRAFT_P_MIN,
    draft_source: str = DEFAULT_DRAFT_SOURCE,
    adaptive_draft: bool = True,
    mtp: bool = True,
    sampling: Optional[SamplingConfig] = None,
    logits_processors: Optional[Sequence[LogitsProcessor]] = None,
    truncate_prompt: bool = False,
    kv_bits: Optional[int] = None,
    kv_group_size: int = DEFAULT_KV_GROUP_SIZE,
    quantized_kv_start: int = DEFAULT_QUANTIZED_KV_START,
    max_kv_size: Optional[int] = None,
    caller: str = "request_from",
    **sampling_kwargs,
) -> GenerationRequest:
    """The ``GenerationRequest`` of ``stream_generate``'s keyword arguments;
    sampling as a ``SamplingConfig`` (``sampling=``) or its fields; the
    caches' policy by mlx-lm's keywords (``kv.KVSettings``). A keyword that
    is none of these is a ``TypeError`` naming ``caller``."""
    check_keywords(sampling_kwargs, caller)
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, numbers.Integral):
        raise TypeError(f"{caller}(): max_tokens must be an int, not {max_tokens!r}")
    if sampling is not None and sampling_kwargs:
        names = ", ".join(sorted(sampling_kwargs))
        raise TypeError(f"pass either sampling= or its fields ({names}), not both")
    drafts = DraftSettings(draft_source, draft_max, draft_p_min, adaptive_draft, mtp)
    return GenerationRequest(
        max_tokens=int(max_tokens),
        sampling=sampling or SamplingConfig(**sampling_kwargs),
        drafts=drafts,
        logits_processors=list(logits_processors or []),
        truncate_prompt=truncate_prompt,
        kv=KVSettings.from_mlx_lm(
            kv_bits, kv_group_size, quantized_kv_start, max_kv_size
        ),
    )


def check_keywords(names, caller: str) -> None:
    """Every one of ``names`` must be a ``SamplingConfig`` field, else a
    ``TypeError`` that names ``caller`` and, for mlx-lm's keywords, what
    mlx-mtp takes instead (for a typo, the nearest name)."""
    sampling = {f.name for f in fields(SamplingConfig)}
    for name in sorted(set(names) - sampling):
        if name in _INSTEAD:
            raise TypeError(
                f"{caller}() does not take mlx-lm's {name}=: {_INSTEAD[name]}"
            )
        known = sampling | _parameters(request_from) | _parameters(stream_generate)
        close = difflib.get_close_matches(name, sorted(known - {"caller"}), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise TypeError(f"{caller}() got an unexpected keyword argument {name!r}{hint}")


def _parameters(function) -> set:
    return {
        p.name
        for p in inspect.signature(function).parameters.values()
        if p.kind is not p.VAR_KEYWORD
    }


def generate(
    model: MTPModel,
    tokenizer: Any,
    prompt: Union[str, Sequence[int], mx.array],
    verbose: bool = False,
    **kwargs,
) -> str:
    """Generate a completion and return it as one string (see ``stream_generate``,
    whose keywords it takes: ``max_tokens=``, sampling, drafts).

    As in mlx-lm, ``verbose`` (the fourth argument) prints the text as it
    comes and then mlx-lm's lines (prompt and generation speed, peak memory),
    and after them the speculative stats line."""
    if not isinstance(verbose, bool):
        hint = f"max_tokens={verbose!r}" if isinstance(verbose, int) else "..."
        raise TypeError(
            f"generate(): verbose must be a bool, not {verbose!r} (as in mlx-lm, "
            f"max_tokens is a keyword: generate(model, tokenizer, prompt, {hint}))"
        )
    max_tokens = kwargs.pop("max_tokens", DEFAULT_MAX_TOKENS)
    if kwargs.get("request") is None:
        mine = {k: kwargs.pop(k) for k in list(kwargs) if k not in _STREAM_OPTIONS}
        kwargs["request"] = request_from(max_tokens, caller="generate", **mine)
    if verbose:
        print("=" * 10)
    text = ""
    response = None
    for response in stream_generate(model, tokenizer, prompt, max_tokens, **kwargs):
        if verbose:
            print(response.text, end="", flush=True)
        text += response.text
    if verbose and response is not None:
        print()
        print("=" * 10)
        if not text:
            print("No text generated for this prompt")
        else:  # mlx_lm.generate's lines
            print(
                f"Prompt: {response.prompt_tokens} tokens, "
                f"{response.prompt_tps:.3f} tokens-per-sec"
            )
            print(
                f"Generation: {response.generation_tokens} tokens, "
                f"{response.generation_tps:.3f} tokens-per-sec"
            )
            print(f"Peak memory: {response.peak_memory:.3f} GB")
        why = no_drafts_reason(kwargs["request"].drafts.adaptive)
        print(response.stats.summary(why))
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
    _, taps = model.target.forward(tokens, model.target.make_cache())
    hidden = model.drafters[0].features(taps)  # the head's drafter is the first
    logits, _ = model.head(hidden[:, :-1], tokens[:, 1:], model.head.make_cache())
    return logits[0]


def draft_logits(
    model: MTPModel,
    tokens: Union[Sequence[int], mx.array],
    block_size: Optional[int] = None,
) -> mx.array:
    """Teacher-forced logits of the attached block drafter (DFlash) for the
    block after ``tokens``: shape ``[block_size - 1, V]`` (its own block size
    by default), row ``j`` its draft of the token ``j + 1`` places after
    ``tokens[-1]``. The context is the target's chosen layer outputs over
    ``tokens[:-1]``; the block's first input is ``tokens[-1]``."""
    drafter = next((d for d in model.drafters if hasattr(d, "block_logits")), None)
    if drafter is None:
        raise ValueError("no block drafter attached (load the model with draft=)")
    size = drafter.block_size if block_size is None else int(block_size)
    if size < 2:
        raise ValueError(f"block_size must be at least 2, not {size}")
    tokens = [
        int(t) for t in (tokens.tolist() if isinstance(tokens, mx.array) else tokens)
    ]
    if not tokens:
        raise ValueError("draft_logits needs at least one token")
    if len(tokens) > 1:
        _, taps = model.target.forward(mx.array([tokens[:-1]]), model.target.make_cache())
        features = drafter.features(taps)
    else:
        features = mx.zeros((1, 0, 1))
    return drafter.block_logits(features, tokens[-1], size - 1)


# stream_generate's own keywords (those generate passes through as they are)
_STREAM_OPTIONS = _parameters(stream_generate) - {"model", "tokenizer", "prompt"}
