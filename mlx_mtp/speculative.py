"""The speculative loop: draft with the MTP head, verify with one trunk forward.

Positions: the trunk has read every token before ``y``; ``y`` is the last
token chosen and not yet read. Each round

1) drafts: the head catches up on the hidden states it has not seen (paired
   with their successor tokens) in ONE batched call whose last output is
   already draft 1, then chains drafts 2..k through its own output;
2) verifies ``[y, d_1..d_k]`` in ONE forward of the trunk;
3) accepts the agreeing prefix plus one token of the main model;
4) rolls back: the trunk to the tokens it keeps, the head past its chain
   (chained entries came from draft hidden states, not true ones);
5) leaves the new true hidden states pending for the next round's catch-up.

After the prompt there is no plain decode step: every token comes from a
round; a round with no drafts is exactly a plain decode step.
"""

import time
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

import mlx.core as mx

from .cache import MTPCache, rollback, start_verify
from .defaults import DEFAULT_DRAFT_MAX, DEFAULT_DRAFT_P_MIN, DEFAULT_PREFILL_STEP
from .sampling import Draft, ExactMatchVerifier
from .stats import MTPStats


def _keep_pending(cache: MTPCache, hidden: mx.array, read: List[int]) -> None:
    """Queue the hidden states the trunk made reading the tokens ``read``.

    Each token read is the successor of the hidden state before it, so it
    completes the previous pending pair; the last new state stays incomplete.
    """
    if cache.pending_hidden is None:
        cache.pending_hidden, cache.pending_tokens = hidden, list(read[1:])
    else:
        cache.pending_hidden = mx.concatenate([cache.pending_hidden, hidden], axis=1)
        cache.pending_tokens.extend(read)


def _feed_head(model, cache: MTPCache, y: Optional[int] = None):
    """Run the head over every pending pair (``y`` completes the last one)."""
    tokens = cache.pending_tokens + ([] if y is None else [y])
    n = len(tokens)
    logits, h = model.head(cache.pending_hidden[:, :n], mx.array(tokens)[None], cache.head)
    rest = cache.pending_hidden[:, n:]
    cache.pending_hidden = rest if rest.shape[1] else None
    cache.pending_tokens = []
    return logits, h


def prefill(
    model, cache: MTPCache, prompt: List[int], step: int, use_mtp: bool, progress=None
):
    """Trunk over ``prompt[:-1]`` in chunks, and the head over the pairs it makes.

    ``progress(done, total)`` hears the tokens read before each chunk and at the end.
    """
    todo = prompt[:-1]
    for s in range(0, len(todo), step):
        if progress is not None:
            progress(s, len(todo))
        chunk = todo[s : s + step]
        _, hidden = model.trunk(mx.array(chunk)[None], cache.trunk)
        if use_mtp:
            _keep_pending(cache, hidden, chunk)
            if cache.pending_tokens:
                _feed_head(model, cache)
            mx.eval(cache.pending_hidden, [c.state for c in cache.state_list()])
        else:
            mx.eval([c.state for c in cache.trunk])
    if progress is not None:
        progress(len(todo), len(todo))


def draft(model, cache: MTPCache, y: int, k: int, p_min: float, verifier, history):
    """Catch the head up and chain up to ``k`` drafts; returns (drafts, chained calls)."""
    logits, h = _feed_head(model, cache, y)
    drafts: List[Draft] = []
    chained = 0
    logits, h = logits[:, -1], h[:, -1:]
    for j in range(k):
        d = verifier.draft(logits, history, drafts)
        if p_min > 0 and d.p.item() < p_min:
            break
        drafts.append(d)
        if j + 1 < k:
            logits, h = model.head(h, d.token[None], cache.head)
            logits = logits[:, -1]
            chained += 1
    return drafts, chained


def _cut(emitted: List[int], stop_tokens, limit: int) -> int:
    """How many of ``emitted`` to keep: through the first stop token, at most ``limit``."""
    for i, t in enumerate(emitted[:limit]):
        if t in stop_tokens:
            return i + 1
    return min(len(emitted), limit)


def speculative_generate_step(
    prompt: Sequence[int],
    model,
    *,
    max_tokens: int = 256,
    draft_max: int = DEFAULT_DRAFT_MAX,
    draft_p_min: float = DEFAULT_DRAFT_P_MIN,
    verifier: Optional[Any] = None,
    draft_policy: Optional[Callable[[], int]] = None,
    stop_tokens: Sequence[int] = (),
    prompt_cache: Optional[MTPCache] = None,
    prefill_step_size: int = DEFAULT_PREFILL_STEP,
    stats: Optional[MTPStats] = None,
    cached_tokens: Sequence[int] = (),
    prefill_progress: Optional[Callable[[int, int], None]] = None,
) -> Iterator[Tuple[int, bool]]:
    """Yield ``(token, from_draft)`` until ``max_tokens`` or a stop token.

    ``prompt`` holds the tokens not yet in ``prompt_cache`` (the whole prompt
    when the cache is new). ``stats`` is updated in place as tokens are yielded.
    ``draft_policy`` (e.g. ``AdaptiveDraftLength``) picks each round's draft
    length instead of ``draft_max`` and learns from ``update(drafted, accepted)``.
    ``cached_tokens`` are the tokens already in ``prompt_cache``: the sampler
    sees them as history (penalty window, noise positions) as if the whole
    sequence had been the prompt. ``prefill_progress`` goes to ``prefill``.
    """
    prompt = [int(t) for t in prompt]
    if not prompt:
        raise ValueError("the prompt must hold at least one token")
    verifier = verifier or ExactMatchVerifier()
    cache = prompt_cache if prompt_cache is not None else model.make_cache()
    stats = stats if stats is not None else MTPStats()
    stats.draft_max = draft_max
    use_mtp = draft_max > 0 and model.head is not None
    stop_tokens = set(stop_tokens)
    history = [int(t) for t in cached_tokens] + prompt

    tic = time.perf_counter()
    prefill(model, cache, prompt, prefill_step_size, use_mtp, prefill_progress)
    stats.prompt_tokens += len(prompt)
    stats.prompt_time += time.perf_counter() - tic
    tic = time.perf_counter()

    y, n = prompt[-1], 0
    while n < max_tokens:
        remaining = max_tokens - n
        # 1) draft
        drafts, chained = [], 0
        if use_mtp and cache.pending_hidden is not None and remaining > 1:
            k = min(draft_policy() if draft_policy else draft_max, remaining - 1)
            drafts, chained = draft(model, cache, y, k, draft_p_min, verifier, history)
        # 2) verify in one forward
        inputs = mx.concatenate([mx.array([y])] + [d.token for d in drafts])
        start_verify(cache.trunk)
        logits, hidden = model.trunk(inputs[None], cache.trunk)
        # 3) accept
        emitted = verifier.verify(logits[0], drafts, history)
        accepted = len(emitted) - 1
        if draft_policy is not None and drafts:
            draft_policy.update(len(drafts), accepted)
        m = _cut(emitted, stop_tokens, remaining)
        # 4) roll back: the trunk keeps y, e_1..e_{m-1}; the head drops its chain
        rollback(cache.trunk, len(drafts) + 1 - m)
        rollback(cache.head, chained)
        # 5) the kept hidden states wait for the head
        if use_mtp:
            _keep_pending(cache, hidden[:, :m], [y] + emitted[: m - 1])
        if m <= accepted:  # cut inside the drafts: only the drafts before the cut count
            stats.record_round([d.token.item() for d in drafts[: m - 1]], m - 1)
        else:
            stats.record_round([d.token.item() for d in drafts], accepted)
        stats.generation_time = time.perf_counter() - tic
        stats.peak_memory = mx.get_peak_memory() / 1e9
        for i, t in enumerate(emitted[:m]):
            yield t, i < accepted
        history.extend(emitted[:m])
        n += m
        y = emitted[m - 1]
        if emitted[m - 1] in stop_tokens:
            break
