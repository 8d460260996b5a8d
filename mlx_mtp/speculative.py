"""The speculative loop: draft with the MTP head, verify with one trunk forward.

Positions: the trunk has read every token before ``y``; ``y`` is the last
token chosen and not yet read. Each round (``rounds``: draft, verify, settle)
drafts ``[d_1..d_k]`` with the head (or takes a prompt-lookup proposal),
verifies ``[y, d_1..d_k]`` in ONE forward of the trunk, keeps the agreeing
prefix plus one token of the main model, and rolls the caches back to it.
This loop is the single stream's: the prompt's prefill, how many drafts
each round takes (the draft policy, the lookup source), and plain steps that
run one ahead, as mlx-lm's do, while no round drafts.

After the prompt there is no other decode step: every token comes from a
round; a round with no drafts is exactly a plain decode step.
"""

import time
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

import mlx.core as mx

from .adaptive import FixedDraft, expected_tokens
from .cache import MTPCache, can_rollback
from .defaults import DEFAULT_DRAFT_MAX, DEFAULT_DRAFT_P_MIN, DEFAULT_PREFILL_STEP
from .ngram import PromptLookup
from .rounds import Logprobs, OneStream, Stream, catch_up, settle, verify
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


def _head_value(lookup: PromptLookup, policy, k: int) -> float:
    """What a lookup round must beat, in expected tokens per plain step: a plain
    step (1), or in "auto" the round the head's policy chose."""
    if lookup.mode != "auto" or k == 0 or not hasattr(policy, "costs"):
        return 1.0
    return expected_tokens(policy.acceptance, k) / policy.costs.round(k)


def _may_look(lookup: Optional[PromptLookup], last: int) -> bool:
    return lookup is not None and lookup.may_propose_next(last)


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
    draft_policy: Optional[Callable[[], int]] = None,
    draft_p_min: float = DEFAULT_DRAFT_P_MIN,
    verifier: Optional[Any] = None,
    stop_tokens: Sequence[int] = (),
    prompt_cache: Optional[MTPCache] = None,
    prefill_step_size: int = DEFAULT_PREFILL_STEP,
    stats: Optional[MTPStats] = None,
    cached_tokens: Sequence[int] = (),
    prefill_progress: Optional[Callable[[int, int], None]] = None,
    lookup: Optional[PromptLookup] = None,
    logprobs: Optional[Logprobs] = None,
) -> Iterator[Tuple[int, bool]]:
    """Yield ``(token, from_draft)`` until ``max_tokens`` or a stop token.

    ``prompt`` holds the tokens not yet in ``prompt_cache`` (the whole prompt
    when the cache is new). ``stats`` is updated in place as tokens are yielded.
    ``draft_policy`` (``FixedDraft(k)``, ``CostAwareDraft``) is the one source
    of the draft count: each round asks it how many to draft (at most its
    ``draft_max``; 0 turns MTP off) and tells it ``update(drafted, accepted)``;
    without one every round drafts ``DEFAULT_DRAFT_MAX``. ``cached_tokens`` are the
    tokens already in ``prompt_cache``: the sampler sees them as history
    (penalty window, noise positions) as if the whole sequence had been the
    prompt. ``prefill_progress`` goes to ``prefill``. ``lookup`` (a
    ``PromptLookup``) adds prompt-lookup drafts: a round checks its proposal
    instead of the head's drafts when that is expected to pay more (it is
    verified, accepted and rolled back as any draft). ``logprobs`` (a
    ``rounds.Logprobs``) receives each token's log-probability before the token
    is yielded.
    """
    prompt = [int(t) for t in prompt]
    if not prompt:
        raise ValueError("the prompt must hold at least one token")
    verifier = verifier or ExactMatchVerifier()
    cache = prompt_cache if prompt_cache is not None else model.make_cache()
    stats = stats if stats is not None else MTPStats()
    policy = draft_policy or FixedDraft(DEFAULT_DRAFT_MAX)
    stats.draft_max = policy.draft_max
    use_mtp = policy.draft_max > 0 and model.head is not None
    stop_tokens = set(stop_tokens)
    history = [int(t) for t in cached_tokens] + prompt
    lazy = hasattr(verifier, "sample")  # plain steps can run one ahead
    if lookup is not None and not can_rollback(cache.trunk):
        lookup = None  # a trunk that cannot drop rejected drafts checks none
    if lookup is not None:
        lookup.sync(history)

    tic = time.perf_counter()
    prefill(model, cache, prompt, prefill_step_size, use_mtp, prefill_progress)
    stats.prompt_tokens += len(prompt)
    stats.prompt_time += time.perf_counter() - tic
    tic = time.perf_counter()

    stream = Stream(history, cache, verifier, max_tokens, stop_tokens, stats)
    stream.logprobs = logprobs
    one, caches = [stream], OneStream(model, cache)
    ahead = None
    k = policy() if use_mtp else 0
    try:
        while not stream.done:
            remaining, y = stream.remaining, history[-1]
            k = min(k, remaining - 1) if cache.pending[0].hidden is not None else 0
            drafts, tentative, looked = [], None, []
            if lookup is not None and ahead is None and remaining > 1:
                looked = lookup.drafts(remaining - 1, _head_value(lookup, policy, k))
            if k == 0 and lazy and not looked:
                # a plain step; the next one starts before this token is read
                step = ahead or _PlainStep(model, cache, verifier, y, history)
                k, ahead = (policy() if use_mtp else 0), None
                if k == 0 and remaining > 1 and not _may_look(lookup, y):
                    ahead = step.next(model, cache, verifier, history)
                emitted = [step.token.item()]
                logits, hidden = step.logits, step.hidden
                if emitted[0] in stop_tokens and ahead is not None:
                    ahead.undo(cache)
                    ahead = None
            else:
                # a round: a lookup proposal or the head's drafts, one verify
                if looked:
                    drafts = [Draft(mx.array([t]), None) for t in looked]
                elif k > 0:
                    drafted, tentative = draft_round(
                        model, caches, one, [k], draft_p_min
                    )
                    drafts = drafted[0]
                (emitted,), logits, hidden = verify(model, caches, one, [drafts])
                if looked:
                    lookup.update(len(drafts), len(emitted) - 1)
                elif drafts:
                    policy.update(len(drafts), len(emitted) - 1)
                k = policy() if use_mtp else 0
            accepted = len(emitted) - 1
            (m,) = settle(
                model,
                caches,
                one,
                [drafts],
                tentative,
                [emitted],
                logits,
                hidden,
                use_mtp,
            )
            stats.generation_time = time.perf_counter() - tic
            stats.peak_memory = mx.get_peak_memory() / 1e9
            for i, t in enumerate(emitted[:m]):
                yield t, i < accepted
            if lookup is not None:
                lookup.sync(history)
    finally:
        if ahead is not None:  # the consumer stopped reading: unread its step
            ahead.undo(cache)
