"""One stream through the decoding loop: ``speculative_generate_step``.

The loop is ``decoder.Decoder``'s, the same for one stream and a batch: each
round asks the stream's draft source for a plan (drafts from one of the
model's drafters, or a ready proposal such as a prompt lookup), verifies
``[y, d_1..d_k]`` in ONE forward of the trunk, keeps the agreeing prefix plus
one token of the main model, and rolls the caches back to it; a round with
no drafts is a plain decode step, and runs one ahead as mlx-lm's do. Here
one stream runs on its own caches (a batch of one), its prompt read in
chunks first.
"""

import time
from typing import Any, Callable, Iterator, Optional, Sequence, Tuple

import mlx.core as mx

from .cache import StreamCache
from .decoder import Decoder
from .defaults import DEFAULT_DRAFT_P_MIN, DEFAULT_PREFILL_STEP
from .drafts import NoDrafts, as_source
from .kv import KVSettings
from .prompt import as_prompt
from .round_costs import store
from .sampling import ExactMatchVerifier
from .stats import MTPStats
from .stream import Stream, start_stream


def read_prompt(
    decoder: Decoder, stream: Stream, read: int, step: int, progress=None
) -> None:
    """``stream`` (alone in ``decoder``) reads its history from ``read`` up to
    its last token, in chunks of ``step``. ``progress(done, total)`` hears
    the tokens read before each chunk and at the end."""
    total = len(stream.history) - 1 - read
    done = 0
    while done < total:
        if progress is not None:
            progress(done, total)
        takes, _, _ = decoder.read_chunk([stream.prompt], [read + done], step)
        done += takes[0]
    if progress is not None:
        progress(total, total)


def prefill(
    model,
    cache: StreamCache,
    prompt,
    step: int = DEFAULT_PREFILL_STEP,
    use_mtp: bool = True,
    progress=None,
) -> None:
    """The trunk over ``prompt[:-1]`` (token ids or a ``prompt.Prompt``) in
    chunks of ``step`` and, with ``use_mtp``, every drafter over the
    features it makes."""
    source = None if use_mtp else NoDrafts()
    stream = start_stream(model, prompt, None, source, cache=cache)
    decoder = Decoder(model, merge=False)
    decoder.add([stream])
    read_prompt(decoder, stream, 0, step, progress)
    decoder.remove([stream])


def speculative_generate_step(
    prompt: Sequence[int],
    model,
    *,
    max_tokens: int = 256,
    drafts: Optional[Any] = None,
    draft_p_min: float = DEFAULT_DRAFT_P_MIN,
    verifier: Optional[Any] = None,
    stop_tokens: Sequence[int] = (),
    prompt_cache: Optional[StreamCache] = None,
    prefill_step_size: int = DEFAULT_PREFILL_STEP,
    stats: Optional[MTPStats] = None,
    cached_tokens: Sequence[int] = (),
    prefill_progress: Optional[Callable[[int, int], None]] = None,
    logprobs: Optional[Any] = None,
    kv: Optional[KVSettings] = None,
) -> Iterator[Tuple[int, bool]]:
    """Yield ``(token, from_draft)`` until ``max_tokens`` or a stop token.

    ``prompt`` holds the tokens not yet in ``prompt_cache`` (the whole prompt
    when the cache is new): token ids, or a ``prompt.Prompt`` (tokens with
    media segments). ``stats`` is updated in place as tokens are yielded.
    ``drafts`` is the stream's draft source (``drafts.make_source``; a bare
    count policy, ``FixedDraft(k)`` or ``CostAwareDraft``, means the head's
    drafts it counts; None: ``DEFAULT_DRAFT_MAX`` head drafts a round). Each
    round asks it what to check and tells it what was kept. ``cached_tokens``
    are the tokens already in ``prompt_cache``: the sampler sees them as
    history (penalty window, noise positions) as if the whole sequence had
    been the prompt. ``prefill_progress(done, total)`` hears how many prompt
    tokens the trunk has read. ``logprobs`` (a ``stream.Logprobs``) receives
    each token's log-probability before the token is yielded. ``kv``: the
    caches' policy (quantized, bounded; ``kv.KVSettings``).
    """
    prompt = as_prompt(prompt)
    if not prompt:
        raise ValueError("the prompt must hold at least one token")
    stream = start_stream(
        model,
        prompt,
        verifier or ExactMatchVerifier(),
        as_source(drafts),
        cache=prompt_cache,
        cached_tokens=cached_tokens,
        stop_tokens=stop_tokens,
        max_tokens=max_tokens,
        stats=stats,
        logprobs=logprobs,
        kv=kv,
    )
    stats = stream.stats
    decoder = Decoder(model, draft_p_min, merge=False)
    tic = time.perf_counter()
    decoder.add([stream])
    try:
        read_prompt(
            decoder, stream, len(cached_tokens), prefill_step_size, prefill_progress
        )
        stats.prompt_tokens += len(prompt)
        stats.prompt_time += time.perf_counter() - tic
        tic = time.perf_counter()
        while not stream.done:
            tokens = decoder.step()[0]
            stats.generation_time = time.perf_counter() - tic
            stats.peak_memory = mx.get_peak_memory() / 1e9
            for i, t in enumerate(tokens):
                yield t, i < stream.accepted
    finally:  # a consumer that stops reading: the step under way is taken back
        decoder.remove([stream])
        store(model)  # what its rounds corrected, for later runs
