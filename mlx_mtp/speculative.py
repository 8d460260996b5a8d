"""The speculative loop: draft with the MTP head, verify with one trunk forward.

Positions: the trunk has read every token before ``y``; ``y`` is the last
token chosen and not yet read. Each round (``rounds``: draft, verify, settle)
asks the stream's draft source (``drafts.py``) for a plan: ``[d_1..d_k]``
from the head, or a ready proposal such as a prompt lookup; it
verifies ``[y, d_1..d_k]`` in ONE forward of the trunk, keeps the agreeing
prefix plus one token of the main model, and rolls the caches back to it.
This loop is the single stream's fast path (a batch goes through
``decoder.Decoder``, the same rounds): the prompt's prefill, and plain steps
that run one ahead, as mlx-lm's do, while no round drafts.

After the prompt there is no other decode step: every token comes from a
round; a round with no drafts is exactly a plain decode step.
"""

import time
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

import mlx.core as mx

from .cache import MTPCache
from .defaults import DEFAULT_DRAFT_P_MIN, DEFAULT_PREFILL_STEP
from .drafts import Plan, as_source
from .rounds import (
    Logprobs,
    OneStream,
    Stream,
    catch_up,
    follow,
    reads_along,
    settle,
    verify,
)
from .rounds import draft as draft_round
from .sampling import Draft, ExactMatchVerifier
from .stats import MTPStats


def prefill(
    model, cache: MTPCache, prompt: List[int], step: int, use_mtp: bool, progress=None
):
    """Trunk over ``prompt[:-1]`` in chunks, and the head over the pairs it makes.

    ``progress(done, total)`` hears the tokens read before each chunk and at the end.
    """
    todo = prompt[:-1]
    one = [Stream([], cache, None, 0)]
    for s in range(0, len(todo), step):
        if progress is not None:
            progress(s, len(todo))
        chunk = todo[s : s + step]
        _, hidden = model.trunk(mx.array(chunk)[None], cache.trunk)
        if use_mtp:
            cache.pending[0].push(hidden, chunk)
            catch_up(model, OneStream(model, cache), one)
            pending = [q.hidden for q in cache.pending if q.hidden is not None]
            mx.eval(pending, [c.state for c in cache.state_list()])
        else:
            mx.eval([c.state for c in cache.trunk])
    if progress is not None:
        progress(len(todo), len(todo))


def draft(
    model, cache: MTPCache, y: int, k: int, p_min: float, verifier, history
) -> Tuple[List[Draft], List[int]]:
    """One stream's head catches up and drafts up to ``k`` tokens after
    ``history`` (whose last token is ``y``): ``rounds.draft`` for a batch of
    one. Returns the drafts and the tentative entries per head layer."""
    history = list(history)
    if not history or history[-1] != y:
        history.append(y)
    one = [Stream(history, cache, verifier, k + 1)]
    drafts, tentative = draft_round(model, OneStream(model, cache), one, [k], p_min)
    return drafts[0], tentative[0]


class _PlainStep:
    """One plain decode step, its token sampled but not read.

    ``next()`` starts the step after it on its lazy token (as mlx-lm overlaps
    building step n + 1 with step n's compute); that step keeps what undoing
    it takes, should this token end the generation.
    """

    def __init__(self, model, cache: MTPCache, verifier, token, history, before=None):
        token = mx.array([token]) if isinstance(token, int) else token
        self.before = before  # the trunk before this step, when it may be undone
        self.logits, self.hidden = model.trunk(token.reshape(1, 1), cache.trunk)
        pending = [token] if before else []
        self.token = verifier.sample(self.logits[0, -1:], history, pending)
        mx.async_eval(self.token)

    def next(self, model, cache: MTPCache, verifier, history):
        before = cache.snapshot(trunk_only=True)
        if before is None:  # a cache that cannot be brought back
            return None
        return _PlainStep(model, cache, verifier, self.token, history, before)

    def undo(self, cache: MTPCache) -> None:
        cache.restore(self.before)


def speculative_generate_step(
    prompt: Sequence[int],
    model,
    *,
    max_tokens: int = 256,
    drafts: Optional[Any] = None,
    draft_p_min: float = DEFAULT_DRAFT_P_MIN,
    verifier: Optional[Any] = None,
    stop_tokens: Sequence[int] = (),
    prompt_cache: Optional[MTPCache] = None,
    prefill_step_size: int = DEFAULT_PREFILL_STEP,
    stats: Optional[MTPStats] = None,
    cached_tokens: Sequence[int] = (),
    prefill_progress: Optional[Callable[[int, int], None]] = None,
    logprobs: Optional[Logprobs] = None,
) -> Iterator[Tuple[int, bool]]:
    """Yield ``(token, from_draft)`` until ``max_tokens`` or a stop token.

    ``prompt`` holds the tokens not yet in ``prompt_cache`` (the whole prompt
    when the cache is new). ``stats`` is updated in place as tokens are yielded.
    ``drafts`` is the stream's draft source (``drafts.make_source``; a bare
    count policy, ``FixedDraft(k)`` or ``CostAwareDraft``, means the head's
    drafts it counts; None: ``DEFAULT_DRAFT_MAX`` head drafts a round). Each
    round asks it what to check and tells it what was kept. ``cached_tokens``
    are the tokens already in ``prompt_cache``: the sampler sees them as
    history (penalty window, noise positions) as if the whole sequence had
    been the prompt. ``prefill_progress`` goes to ``prefill``. ``logprobs`` (a
    ``rounds.Logprobs``) receives each token's log-probability before the
    token is yielded.
    """
    prompt = [int(t) for t in prompt]
    if not prompt:
        raise ValueError("the prompt must hold at least one token")
    verifier = verifier or ExactMatchVerifier()
    cache = prompt_cache if prompt_cache is not None else model.make_cache()
    stats = stats if stats is not None else MTPStats()
    source = as_source(drafts)
    stats.draft_max = source.draft_max
    use_mtp = reads_along(model, source)
    history = [int(t) for t in cached_tokens] + prompt
    lazy = hasattr(verifier, "sample")  # plain steps can run one ahead

    tic = time.perf_counter()
    if use_mtp:
        follow(model, cache)
    prefill(model, cache, prompt, prefill_step_size, use_mtp, prefill_progress)
    stats.prompt_tokens += len(prompt)
    stats.prompt_time += time.perf_counter() - tic
    tic = time.perf_counter()

    stream = Stream(history, cache, verifier, max_tokens, set(stop_tokens), stats)
    stream.logprobs, stream.source = logprobs, source
    one, caches = [stream], OneStream(model, cache)
    ahead = None
    k = source.count() if use_mtp else 0
    try:
        while not stream.done:
            # 1) the plan: a ready proposal, the head's drafts, or a plain step
            remaining, y = stream.remaining, history[-1]
            k = min(k, remaining - 1) if cache.pending[0].hidden is not None else 0
            plan = Plan()
            if ahead is None:
                plan = source.plan(history, remaining - 1, k)
            drafts, tentative = [], None
            if not plan.tokens and not plan.head and lazy:
                # 2a) a plain step; the next one starts before this token is read
                step = ahead or _PlainStep(model, cache, verifier, y, history)
                k, ahead = (source.count() if use_mtp else 0), None
                if k == 0 and remaining > 1 and not source.may_propose_after(history):
                    ahead = step.next(model, cache, verifier, history)
                emitted = [step.token.item()]
                logits, hidden = step.logits, step.hidden
                if emitted[0] in stream.stop_tokens and ahead is not None:
                    ahead.undo(cache)
                    ahead = None
            else:
                # 2b) a round: draft (or take the proposal), one verify
                if plan.tokens:
                    drafts = [
                        Draft(mx.array([t]), None, source=plan.source)
                        for t in plan.tokens
                    ]
                elif plan.head:
                    drafted, tentative = draft_round(
                        model, caches, one, [plan.head], draft_p_min
                    )
                    drafts = drafted[0]
                (emitted,), logits, hidden = verify(model, caches, one, [drafts])
                if drafts:
                    source.update(drafts[0].source, len(drafts), len(emitted) - 1)
                k = source.count() if use_mtp else 0
            # 3) keep the agreeing tokens, roll the rest back
            accepted = len(emitted) - 1
            (m,) = settle(
                model, caches, one, [drafts], tentative, [emitted], logits, hidden,
                use_mtp,
            )  # fmt: skip
            stats.generation_time = time.perf_counter() - tic
            stats.peak_memory = mx.get_peak_memory() / 1e9
            for i, t in enumerate(emitted[:m]):
                yield t, i < accepted
    finally:
        if ahead is not None:  # the consumer stopped reading: unread its step
            ahead.undo(cache)
