"""A stream: one generation as the decoding loop runs it, built in one place.

``open_stream`` turns a ``GenerationRequest`` and a prompt into a
``Stream``: its caches, its verifier, its draft source, its limits and
stop tokens; ``start_stream`` builds one from a verifier and a draft source
(the low-level ``speculative_generate_step``, the timings). The
single-stream API, ``batch_generate``, the server's engine and ``tune``
all start their streams here.
"""

import dataclasses
from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence, Set, Tuple

import mlx.core as mx

from .cache import StreamCache
from .kv import KVSettings
from .prompt import Prompt, Segment, as_prompt
from .stats import MTPStats


@dataclass
class Logprobs:
    """Where a stream's kept tokens leave their log-probabilities (from the
    verify's logits, no extra forward): per token ``(token, logprob, top)``,
    ``top`` the ``top`` likeliest ``(token, logprob)`` at its position."""

    top: int = 0
    entries: List[Tuple[int, float, List[Tuple[int, float]]]] = field(
        default_factory=list
    )

    def record(self, logprobs: mx.array, tokens: Sequence[int]) -> None:
        """``logprobs[i]`` (``[T, V]``) is the distribution ``tokens[i]`` came from."""
        picked = mx.take_along_axis(logprobs, mx.array(tokens)[:, None], axis=-1)
        if self.top > 0:
            top = min(self.top, logprobs.shape[-1])
            order = mx.argpartition(-logprobs, kth=top - 1, axis=-1)[:, :top]
            best = mx.take_along_axis(logprobs, order, axis=-1)
            tops = [
                sorted(zip(o, b), key=lambda x: -x[1])
                for o, b in zip(order.tolist(), best.tolist())
            ]
        else:
            tops = [[] for _ in tokens]
        for t, lp, top in zip(tokens, picked[:, 0].tolist(), tops):
            self.entries.append((int(t), lp, top))


@dataclass
class Stream:
    """One generation: its caches, its verifier, its draft source and where
    it stands.

    ``history`` is every token so far, prompt included; the trunk has read all
    but the last. ``segments``: the prompt's media (``prompt.Segment``), at
    their positions in ``history``.
    """

    history: List[int]
    cache: StreamCache
    verifier: Any
    max_tokens: int
    stop_tokens: Set[int] = field(default_factory=set)
    stats: MTPStats = field(default_factory=MTPStats)
    generated: int = 0
    done: bool = False
    logprobs: Optional[Any] = None  # kept tokens' log-probabilities, if asked
    source: Any = None  # its ``drafts.DraftSource`` (None: every drafter's drafts)
    accepted: int = 0  # drafts kept in its last round
    # the context class (``timing.context_bucket``) whose costs its source has
    costed_at: Optional[int] = None
    segments: Tuple[Segment, ...] = ()
    # a drafter of it that reads its last input alone (``Drafter.reads_last``)
    # holds none of the prompt's features: its next round drafts nothing
    blind: bool = False

    @property
    def remaining(self) -> int:
        return self.max_tokens - self.generated

    @property
    def prompt(self) -> Prompt:
        """Its history as a prompt: the tokens with their media."""
        return Prompt(tuple(self.history), self.segments)

    def keys(self, n: Optional[int] = None) -> List[int]:
        """What prompt caches key its first ``n`` positions by (all: None)."""
        return self.prompt.keys()[:n]


@dataclass
class Serving:
    """Where a request's stream is served: ``batched``, its draft length is
    the batch's; ``memory``, a server's lookup memory of earlier requests
    (``ngram.LookupMemory``), which its draft source consults; ``history``,
    what the drafters' drafts were worth there
    (``adaptive.AcceptanceHistory``), where its acceptance starts."""

    batched: bool = False
    memory: Any = None
    history: Any = None


ALONE = Serving()


def open_stream(
    model,
    prompt,
    request,
    *,
    cache: Optional[StreamCache] = None,
    stop_tokens: Sequence[int] = (),
    max_tokens: Optional[int] = None,
    sampler=None,
    seed_offset: int = 0,
    serving: Serving = ALONE,
    kv: Optional[KVSettings] = None,
) -> Stream:
    """The stream of ``request`` (a ``GenerationRequest``) after ``prompt``
    on ``model``: its verifier from its sampling and constraints (or from
    ``sampler``), its draft source as ``serving`` serves it, its limit
    unless ``max_tokens``, its log-probabilities, its caches' policy unless
    ``kv`` (a server's). ``seed_offset`` gives a seeded request's streams
    seeds of their own (prompt ``i`` of a batch). ``cache`` holds what comes
    before ``prompt`` (None: a new cache)."""
    sampling = request.sampling
    if seed_offset and sampling.seed is not None:
        sampling = dataclasses.replace(sampling, seed=sampling.seed + seed_offset)
        request = dataclasses.replace(request, sampling=sampling)
    return start_stream(
        model,
        prompt,
        request.verifier(sampler),
        request.source(model, serving.batched, serving.memory, serving.history),
        cache=cache,
        stop_tokens=stop_tokens,
        max_tokens=request.max_tokens if max_tokens is None else max_tokens,
        logprobs=None if request.logprobs is None else Logprobs(request.logprobs),
        kv=kv or request.kv,
    )


def start_stream(
    model,
    prompt,
    verifier,
    source,
    *,
    cache: Optional[StreamCache] = None,
    cached_tokens: Sequence[int] = (),
    stop_tokens: Sequence[int] = (),
    max_tokens: int = 0,
    stats: Optional[MTPStats] = None,
    logprobs: Optional[Logprobs] = None,
    kv: Optional[KVSettings] = None,
) -> Stream:
    """The stream that generates after ``prompt`` on ``model`` with
    ``verifier`` and the draft source ``source`` (None: every drafter's
    drafts): the one place a ``Stream`` is built. ``cache`` holds
    ``cached_tokens`` already (None: a new cache); ``prompt`` is what it
    does not hold. The caches follow ``kv``: the one place a cache policy
    (quantized, bounded) enters a stream. ``prompt`` and ``cached_tokens``
    are token ids or ``prompt.Prompt`` s (tokens with media)."""
    cache = cache if cache is not None else model.make_cache()
    if kv is not None:
        kv.apply(cache)
    cached, prompt = as_prompt(cached_tokens), as_prompt(prompt)
    stream = Stream(
        history=list(cached.tokens) + list(prompt.tokens),
        segments=cached.segments
        + tuple(s.shifted(len(cached)) for s in prompt.segments),
        cache=cache,
        verifier=verifier,
        max_tokens=max_tokens,
        stop_tokens=set(stop_tokens),
        stats=stats if stats is not None else MTPStats(),
        logprobs=logprobs,
        source=source,
    )
    stream.prompt.check_ends_in_text()
    # what the run could draft: as asked (a drafter that cannot pay here is
    # left out of the source, and the stats say no drafts were made)
    drafted = (
        0 if source is None else max(source.draft_max, getattr(source, "asked", 0))
    )
    stream.stats.draft_max = drafted
    return stream
