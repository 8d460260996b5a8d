"""The speculative loop: draft with the MTP head, verify with one trunk forward.

Positions: the trunk has read every token before ``y``; ``y`` is the last
token chosen and not yet read. Each round

1) drafts: the head catches up on the hidden states it has not seen (paired
   with their successor tokens) in ONE batched call whose last output is
   already draft 1; draft j+1 comes from head layer j (the last layer chains
   on its own output when there are fewer layers than drafts);
2) verifies ``[y, d_1..d_k]`` in ONE forward of the trunk;
3) accepts the agreeing prefix plus one token of the main model;
4) rolls back: the trunk to the tokens it keeps, every head layer past its
   tentative entries (they came from drafts, not from true tokens);
5) leaves the new true hidden states pending for the next round's catch-up.

After the prompt there is no plain decode step: every token comes from a
round; a round with no drafts is exactly a plain decode step.
"""

import time
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

import mlx.core as mx

from .adaptive import FixedDraft, expected_tokens
from .cache import MTPCache, can_rollback, rollback, start_verify
from .defaults import DEFAULT_DRAFT_MAX, DEFAULT_DRAFT_P_MIN, DEFAULT_PREFILL_STEP
from .ngram import PromptLookup
from .sampling import Draft, ExactMatchVerifier
from .stats import MTPStats

# A head layer that has not drafted for this many positions (rounds without
# drafts, or deeper than the drafts asked for) catches up, so what waits for it
# stays small.
PENDING_LIMIT = 32


def _read(model, cache: MTPCache, j: int, hidden: mx.array, tokens) -> Tuple:
    """Head layer ``j`` over ``hidden`` paired with ``tokens`` (ints or an array)."""
    head = model.head
    if not isinstance(tokens, mx.array):
        tokens = mx.array(tokens)
    return head.layer(j)(hidden, tokens[None], head.layer_cache(cache.head, j))


def catch_up(model, cache: MTPCache) -> None:
    """Every head layer reads its complete pairs, passing its outputs up."""
    for j, queue in enumerate(cache.pending):
        n = len(queue.tokens)
        if n == 0:
            continue
        _, out = _read(model, cache, j, queue.hidden[:, :n], queue.tokens)
        if j + 1 < len(cache.pending):
            cache.pending[j + 1].push(out, queue.tokens)
        queue.drop_first(n)


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
            cache.pending[0].push(hidden, chunk)
            catch_up(model, cache)
            pending = [q.hidden for q in cache.pending if q.hidden is not None]
            mx.eval(pending, [c.state for c in cache.state_list()])
        else:
            mx.eval([c.state for c in cache.trunk])
    if progress is not None:
        progress(len(todo), len(todo))


def draft(model, cache: MTPCache, y: int, k: int, p_min: float, verifier, history):
    """Catch the head up and draft up to ``k`` tokens.

    Layer 0 reads every pending pair (``y`` completes the last): its last
    output is draft 1. Layer ``j`` then reads its complete pairs and, as
    tentative entries at chain positions ``p + 1 .. p + j``, its last input
    completed by draft 1 and layer ``j - 1``'s tentative outputs with drafts
    ``2..j``: its last output is draft ``j + 1``. Drafts past the last layer
    chain the last layer on its own output. Returns the drafts and how many
    tentative entries each layer wrote (rolled back after the verify).
    """
    queues = cache.pending
    n_layers = len(queues)
    tentative = [0] * n_layers
    drafts: List[Draft] = []
    tokens = queues[0].tokens + [y]
    logits, out = _read(model, cache, 0, queues[0].hidden, tokens)
    if n_layers > 1:
        queues[1].push(out, tokens)
    queues[0].drop_first(len(tokens))
    tent = out[:, :0]  # this layer's tentative outputs
    for j in range(k):
        d = verifier.draft(logits[:, -1], history, drafts)
        if p_min > 0 and d.p.item() < p_min:
            break
        drafts.append(d)
        if j + 1 == k:
            break
        if j + 1 < n_layers:  # layer j + 1 drafts depth j + 2
            layer, queue = j + 1, queues[j + 1]
            n = len(queue.tokens)
            hidden = [h for h in (queue.hidden, tent) if h is not None and h.shape[1]]
            hidden = mx.concatenate(hidden, axis=1) if len(hidden) > 1 else hidden[0]
            c = hidden.shape[1] - n  # inputs read tentatively, with the last c drafts
            known = mx.array(queue.tokens, dtype=d.token.dtype)
            toks = [known] + [x.token for x in drafts[len(drafts) - c :]]
            logits, out = _read(model, cache, layer, hidden, mx.concatenate(toks))
            if n and layer + 1 < n_layers:
                queues[layer + 1].push(out[:, :n], queue.tokens)
            if n:
                queue.drop_first(n)
            tent = out[:, n:]
        else:  # past the last layer: chain it on its own output
            layer = n_layers - 1
            logits, out = _read(model, cache, layer, out[:, -1:], d.token)
            c = 1
        tentative[layer] += c
    return drafts, tentative


def kept_count(emitted: List[int], stop_tokens, limit: int) -> int:
    """How many of ``emitted`` to keep: through the first stop token, at most ``limit``."""
    for i, t in enumerate(emitted[:limit]):
        if t in stop_tokens:
            return i + 1
    return min(len(emitted), limit)


def count_round(
    stats: MTPStats, drafts: List[Draft], accepted: int, m: int, lookup: bool = False
) -> None:
    """Record a round that kept ``m`` of its ``accepted + 1`` tokens
    (``lookup``: its drafts were a prompt-lookup proposal)."""
    if m <= accepted:  # cut inside the drafts: only the drafts before the cut count
        drafts, accepted = drafts[: m - 1], m - 1
    stats.record_round([d.token.item() for d in drafts], accepted)
    if lookup:
        stats.lookup_drafted += len(drafts)
        stats.lookup_accepted += accepted


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
    verified, accepted and rolled back as any draft).
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

    y, n, ahead = prompt[-1], 0, None
    k = policy() if use_mtp else 0
    try:
        while n < max_tokens:
            remaining = max_tokens - n
            k = min(k, remaining - 1) if cache.pending[0].hidden is not None else 0
            drafts, tentative, looked = [], [], []
            if lookup is not None and ahead is None and remaining > 1:
                looked = lookup.drafts(remaining - 1, _head_value(lookup, policy, k))
            if k == 0 and lazy and not looked:
                # a plain step; the next one starts before this token is read
                step = ahead or _PlainStep(model, cache, verifier, y, history)
                k, ahead = (policy() if use_mtp else 0), None
                if k == 0 and remaining > 1 and not _may_look(lookup, y):
                    ahead = step.next(model, cache, verifier, history)
                emitted, hidden = [step.token.item()], step.hidden
                if emitted[0] in stop_tokens and ahead is not None:
                    ahead.undo(cache)
                    ahead = None
            else:
                # 1) draft: a lookup proposal, or the head, which computes
                # while the verify graph is built
                if looked:
                    drafts = [Draft(mx.array([t]), None) for t in looked]
                elif k > 0:
                    drafts, tentative = draft(
                        model, cache, y, k, draft_p_min, verifier, history
                    )
                    mx.async_eval([d.token for d in drafts])
                # 2) verify in one forward
                if drafts:
                    start_verify(cache.trunk)
                inputs = mx.concatenate([mx.array([y])] + [d.token for d in drafts])
                logits, hidden = model.trunk(inputs[None], cache.trunk)
                # 3) accept: the round's one host sync
                emitted = verifier.verify(logits[0], drafts, history)
                if looked:
                    lookup.update(len(drafts), len(emitted) - 1)
                elif drafts:
                    policy.update(len(drafts), len(emitted) - 1)
                k = policy() if use_mtp else 0
            accepted = len(emitted) - 1
            m = kept_count(emitted, stop_tokens, remaining)
            # 4) roll back: the trunk keeps y, e_1..e_{m-1}; the head its true entries
            if drafts:
                rollback(cache.trunk, len(drafts) + 1 - m)
            for j, t in enumerate(tentative):
                rollback(model.head.layer_cache(cache.head, j), t)
            # 5) the kept hidden states wait for the head
            if use_mtp:
                cache.pending[0].push(hidden[:, :m], [y] + emitted[: m - 1])
                if any(q.size > PENDING_LIMIT for q in cache.pending):
                    catch_up(model, cache)  # layers that did not draft for a while
                    mx.async_eval([c.state for c in cache.head])
            count_round(stats, drafts, accepted, m, lookup=bool(looked))
            stats.generation_time = time.perf_counter() - tic
            stats.peak_memory = mx.get_peak_memory() / 1e9
            for i, t in enumerate(emitted[:m]):
                yield t, i < accepted
            history.extend(emitted[:m])
            if lookup is not None:
                lookup.sync(history)
            n += m
            y = emitted[m - 1]
            if y in stop_tokens:
                break
    finally:
        if ahead is not None:  # the consumer stopped reading: unread its step
            ahead.undo(cache)
