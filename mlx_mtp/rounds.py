"""One speculative round, for one stream or several at once.

A round has three steps, each written once here; the decoding loop
(``decoder.Decoder``: one stream or a batch) runs them:

1) ``draft``: each stream's draft source has planned its part (``drafts.Plan``):
   a ready proposal (tokens found without a model call, such as a prompt
   lookup) or ``k`` drafts from one of the model's drafters, which proposes
   for all its streams at once (``drafter.Drafter.propose``);
2) ``verify``: ``[y, d_1..d_k]`` of every stream in ONE trunk forward, and each
   stream's verifier keeps the agreeing prefix plus one token of its own;
3) ``settle``: each stream keeps its tokens up to a stop token or its limit,
   the trunk rolls back to them, every drafter past what its proposal wrote,
   and the target's features at the kept tokens go to the drafters each
   stream reads along with.

The caches are reached through a ``drafter.DraftView`` (``decoder.Decoder``:
a stream's own caches, or a batch's).
"""

from typing import Any, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx

from .cache import StreamCache, start_verify
from .drafter import DraftView
from .sampling import Draft, logprobs
from .stats import MTPStats
from .stream import Stream


def reads_along(drafter, source) -> bool:
    """Whether ``drafter`` reads the trunk's features as they come for a
    stream with draft source ``source`` (None: every drafter). One whose
    drafts the source never takes (plain decoding, prompt lookup alone) does
    not pay for feeding it, one stream or a batch."""
    return source is None or drafter.name in source.drafters


def keeps_layers(model, streams: Sequence[Stream]) -> bool:
    """Whether a trunk forward for ``streams`` keeps its tapped layers'
    outputs: some drafter that reads them reads along with some stream. One
    given up, or left out, costs a plain step nothing (``Target.forward``)."""
    return any(
        d.reads.layers and any(reads_along(d, s.source) for s in streams)
        for d in model.drafters
    )


def follow(model, cache: StreamCache, source) -> None:
    """Before a generation: each drafter it reads along with that did not
    follow the trunk (a generation before took none of its drafts) starts
    afresh where the trunk stands."""
    for d in model.drafters:
        if reads_along(d, source):
            d.follow(cache)


def draft(
    model,
    caches: DraftView,
    streams: Sequence[Stream],
    plans: Sequence[Any],
    p_min: float = 0.0,
) -> Tuple[List[List[Draft]], Dict[str, List[List[int]]]]:
    """Each stream's drafts by its plan: its ready tokens, or up to ``plan.k``
    from the drafter ``plan.drafter``, each drafter proposing for all its
    streams in one go. Returns the drafts and, per drafter, what its proposal
    wrote to its caches (``settle`` rolls it back)."""
    drafts = [
        [Draft(mx.array([t]), None, source=p.source) for t in p.tokens] for p in plans
    ]
    tentative = {}
    for d in model.drafters:
        ks = [p.k if p.drafter == d.name and not p.tokens else 0 for p in plans]
        if max(ks, default=0) == 0:
            continue
        proposed, tentative[d.name] = d.propose(caches, streams, ks, p_min)
        for b, k in enumerate(ks):
            if k:
                drafts[b] = proposed[b]
    return drafts, tentative


def verify(
    model, caches, streams: Sequence[Stream], drafts: List[List[Draft]]
) -> Tuple[List[List[int]], mx.array, Any]:
    """Verify every stream's ``[y, drafts]`` in one trunk forward.

    A stream with fewer drafts than the widest is padded after its tokens,
    where its causal mask hides the padding (``settle`` rolls it back like a
    rejected draft). Returns each stream's accepted drafts plus one token of
    the main model (its verifier's), and the trunk's logits and taps.
    """
    width = 1 + max(len(d) for d in drafts)
    rows = []
    for s, d in zip(streams, drafts):
        row = [mx.array([s.history[-1]], dtype=mx.int32)]
        row += [x.token.astype(mx.int32) for x in d]
        if len(d) + 1 < width:
            row.append(mx.zeros((width - 1 - len(d),), mx.int32))
        rows.append(mx.concatenate(row) if len(row) > 1 else row[0])
    if width > 1:
        start_verify(caches.trunk)
    logits, taps = model.target.forward(
        mx.stack(rows), caches.trunk, keep_layers=keeps_layers(model, streams)
    )
    # the round's one host sync
    emitted = [
        s.verifier.verify(logits[b, : len(d) + 1], d, s.history)
        for b, (s, d) in enumerate(zip(streams, drafts))
    ]
    agree = getattr(caches, "agree", None)  # over processes: rank 0's tokens
    if agree is not None:
        emitted = agree(emitted, drafts)
    return emitted, logits, taps


def kept_count(emitted: List[int], stop_tokens, limit: int) -> int:
    """How many of ``emitted`` to keep: through the first stop token, at most ``limit``."""
    for i, t in enumerate(emitted[:limit]):
        if t in stop_tokens:
            return i + 1
    return min(len(emitted), limit)


def count_round(stats: MTPStats, drafts: List[Draft], accepted: int, m: int) -> None:
    """Record a round that kept ``m`` of its ``accepted + 1`` tokens."""
    if m <= accepted:  # cut inside the drafts: only the drafts before the cut count
        drafts, accepted = drafts[: m - 1], m - 1
    stats.record_round([d.token.item() for d in drafts], accepted)
    if drafts:
        stats.record_source(drafts[0].source, len(drafts), accepted)


def settle(
    model,
    caches,
    streams: Sequence[Stream],
    drafts: List[List[Draft]],
    tentative: Optional[Dict[str, List[List[int]]]],
    emitted: List[List[int]],
    logits: mx.array,
    taps: Any,
) -> List[int]:
    """Keep each stream's tokens of a round and roll back the rest.

    ``emitted[b]`` are stream ``b``'s accepted drafts and its main-model token,
    ``logits`` and ``taps`` the trunk's outputs at the round's inputs
    (``[B, width, ...]``; the logits give the kept tokens' log-probabilities
    to a stream that asks for them). Each stream keeps through its first stop
    token and at most its remaining tokens; the trunk goes back to the tokens
    kept, every drafter past what its proposal wrote, and the target's
    features at the kept tokens go to the drafters each stream reads along
    with (``reads_along``). Extends each stream's history and stats; returns
    how many each kept.
    """
    width = 1 + max(len(d) for d in drafts)
    kept = []
    for s, d, e in zip(streams, drafts, emitted):
        m = kept_count(e, s.stop_tokens, s.remaining)
        count_round(s.stats, d, len(e) - 1, m)
        kept.append(m)
        s.accepted = min(len(e) - 1, m)
    # the trunk keeps y, e_1..e_{m-1}; each drafter its true entries
    if width > 1:
        caches.rollback(caches.trunk, [width - m for m in kept])
    for d in model.drafters:
        if tentative and d.name in tentative:
            d.undo(caches, tentative[d.name])
    for b, (s, m) in enumerate(zip(streams, kept)):
        if s.logprobs is not None:
            rows = logprobs(s.verifier, logits[b, :m], s.history, emitted[b][:m])
            s.logprobs.record(rows, emitted[b][:m])
    for d in model.drafters:
        reading = [reads_along(d, s.source) for s in streams]
        for b, s in enumerate(streams):
            if not reading[b]:  # given up: what waited is never read
                d.forget(s)
        if not any(reading):
            continue
        features = d.features(taps)
        for b, (s, m) in enumerate(zip(streams, kept)):
            if reading[b]:
                d.observe(
                    s, features[b : b + 1, :m], [s.history[-1]] + emitted[b][: m - 1]
                )
    for b, (s, m) in enumerate(zip(streams, kept)):
        s.history.extend(emitted[b][:m])
        s.generated += m
        s.done = s.history[-1] in s.stop_tokens or s.generated >= s.max_tokens
    for d in model.drafters:
        if d.overdue(streams):  # layers that did not draft for a while
            d.catch_up(caches, streams)
            mx.async_eval([c.state for c in caches.caches(d)])
    return kept
