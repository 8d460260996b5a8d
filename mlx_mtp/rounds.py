"""One speculative round, for one stream or several at once.

A round has three steps, each written once here and used by the single-stream
loop (``speculative.py``, a batch of one), by the decoding engine's batched
rounds (``decoder.py``) and by ``tune``'s timings:

1) ``draft``: each stream's MTP head catches up on the hidden states it has
   not seen (paired with their successor tokens) in ONE call per head layer,
   whose last output is already draft 1; draft j+1 comes from head layer j
   (the last layer chains on its own output when there are fewer layers than
   drafts);
2) ``verify``: ``[y, d_1..d_k]`` of every stream in ONE trunk forward, and each
   stream's verifier keeps the agreeing prefix plus one token of its own;
3) ``settle``: each stream keeps its tokens up to a stop token or its limit,
   the trunk rolls back to them, every head layer past its tentative entries,
   and the new true hidden states wait for the head's next catch-up.

The caches are reached through a ``RoundCaches``: ``OneStream`` for the caches
of one stream, ``decoder.Decoder`` for batch caches, which pad each
head call's rows to one length and roll the padding back at once.
"""

from dataclasses import dataclass, field
from typing import Any, List, Optional, Protocol, Sequence, Set, Tuple

import mlx.core as mx

from .cache import MTPCache, rollback, start_verify
from .sampling import Draft, logprobs
from .stats import MTPStats

# A head layer that has not drafted for this many positions (rounds without
# drafts, or deeper than the drafts asked for) catches up, so what waits for it
# stays small.
PENDING_LIMIT = 32

Item = Optional[Tuple[mx.array, Any]]  # (hidden [1, L, D], L tokens) or nothing


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
    """One generation: its caches' pending inputs, its verifier and where it stands.

    ``history`` is every token so far, prompt included; the trunk has read all
    but the last.
    """

    history: List[int]
    cache: MTPCache
    verifier: Any
    max_tokens: int
    stop_tokens: Set[int] = field(default_factory=set)
    stats: MTPStats = field(default_factory=MTPStats)
    generated: int = 0
    done: bool = False
    logprobs: Optional[Logprobs] = None  # kept tokens' log-probabilities, if asked
    source: Any = None  # its ``drafts.DraftSource`` (None: the head's drafts alone)

    @property
    def remaining(self) -> int:
        return self.max_tokens - self.generated


def reads_along(model, source) -> bool:
    """Whether the head reads the trunk's states as they come for a stream
    with draft source ``source`` (None: the head's drafts alone). One that
    takes no head drafts (``draft_max`` 0: plain decoding, or prompt lookup
    alone) does not pay for feeding the head, one stream or a batch."""
    return model.head is not None and (source is None or source.draft_max > 0)


def follow(model, cache: MTPCache) -> None:
    """Before a generation that reads along: a head that did not follow the
    trunk (a generation before took no head drafts) starts afresh where the
    trunk stands (``MTPCache.restart_head``), its pairs aligned again."""
    if model.head is not None and not cache.head_follows(model.head.layer_cache):
        cache.restart_head(model.make_cache().head)


class RoundCaches(Protocol):
    """The caches a round works on, for every stream of the round."""

    trunk: List[Any]
    head: List[Any]

    def read(self, j: int, items: Sequence[Item]) -> Tuple[List, List]:
        """Head layer ``j`` over each stream's item; per stream its logits at
        the last input (``[1, V]``) and its outputs (``[1, L, D]``), None for a
        stream with no item."""

    def rollback(self, caches: List[Any], counts: List[int]) -> None:
        """Drop each stream's last ``counts[b]`` tokens from ``caches``."""


class OneStream:
    """The caches of one stream (``MTPCache``) as a round reads them."""

    def __init__(self, model, cache: MTPCache):
        self.model, self.cache = model, cache

    @property
    def trunk(self) -> List[Any]:
        return self.cache.trunk

    @property
    def head(self) -> List[Any]:
        return self.cache.head

    def read(self, j: int, items: Sequence[Item]) -> Tuple[List, List]:
        (hidden, tokens), head = items[0], self.model.head
        if not isinstance(tokens, mx.array):
            tokens = mx.array(tokens)
        layer = head.layer(j)
        h, out = layer.states(hidden, tokens[None], head.layer_cache(self.head, j))
        return [layer.logits(h[:, -1:])[:, -1]], [out]

    def rollback(self, caches: List[Any], counts: List[int]) -> None:
        rollback(caches, counts[0])


def catch_up(model, caches: RoundCaches, streams: Sequence[Stream]) -> None:
    """Every head layer of every stream reads its complete pairs, passing its
    outputs up to the next layer."""
    n_layers = len(streams[0].cache.pending)
    for j in range(n_layers):
        items = []
        for s in streams:
            q = s.cache.pending[j]
            n = len(q.tokens)
            items.append((q.hidden[:, :n], list(q.tokens)) if n else None)
        if not any(items):
            continue
        _, outs = caches.read(j, items)
        for s, it, out in zip(streams, items, outs):
            if it is None:
                continue
            if j + 1 < n_layers:
                s.cache.pending[j + 1].push(out, it[1])
            s.cache.pending[j].drop_first(len(it[1]))


def draft(
    model,
    caches: RoundCaches,
    streams: Sequence[Stream],
    ks: Sequence[int],
    p_min: float = 0.0,
) -> Tuple[List[List[Draft]], List[List[int]]]:
    """Up to ``ks[b]`` drafts for stream ``b``.

    Layer 0 reads every pending pair (the stream's last token completes the
    last): its last output is draft 1. Layer ``j`` then reads its complete
    pairs and, as tentative entries at chain positions ``p + 1 .. p + j``, its
    last input completed by draft 1 and layer ``j - 1``'s tentative outputs
    with drafts ``2..j``: its last output is draft ``j + 1``. Drafts past the
    last layer chain the last layer on its own output. A stream stops taking
    part once it has its drafts (or its draft's probability falls below
    ``p_min``). Returns the drafts and, per stream and head layer, the
    tentative entries written (rolled back by ``settle``).
    """
    queues = [s.cache.pending for s in streams]
    n_layers = len(queues[0])
    drafts: List[List[Draft]] = [[] for _ in streams]
    tentative = [[0] * n_layers for _ in streams]
    active = [k > 0 and q[0].hidden is not None for k, q in zip(ks, queues)]
    if not any(active):
        return drafts, tentative
    items = [
        (q[0].hidden, q[0].tokens + [s.history[-1]]) if a else None
        for s, q, a in zip(streams, queues, active)
    ]
    logits, outs = caches.read(0, items)
    tent: List[Any] = [None] * len(streams)  # the last layer's tentative outputs
    for b, it in enumerate(items):
        if it is not None:
            if n_layers > 1:
                queues[b][1].push(outs[b], it[1])
            queues[b][0].drop_first(len(it[1]))
            tent[b] = outs[b][:, :0]
    for j in range(max(ks)):
        for b, s in enumerate(streams):
            if not active[b]:
                continue
            d = s.verifier.draft(logits[b], s.history, drafts[b])
            if p_min > 0 and d.p.item() < p_min:
                active[b] = False
                continue
            drafts[b].append(d)
            active[b] = j + 1 < ks[b]
        if not any(active):
            break
        if j + 1 < n_layers:  # layer j + 1 drafts depth j + 2
            logits, outs = _next_layer(
                caches, queues, drafts, tentative, tent, active, j + 1
            )
        else:  # past the last layer: chain it on its own output
            layer, items = n_layers - 1, [None] * len(streams)
            for b in (b for b, a in enumerate(active) if a):
                items[b] = (outs[b][:, -1:], drafts[b][-1].token)
                tentative[b][layer] += 1
            logits, new = caches.read(layer, items)
            outs = [o if n is None else n for n, o in zip(new, outs)]
    # the head computes while the caller builds the verify graph
    mx.async_eval([d.token for ds in drafts for d in ds])
    return drafts, tentative


def _next_layer(caches, queues, drafts, tentative, tent, active, layer: int):
    """Head layer ``layer`` reads, for each active stream, its complete pairs and,
    tentatively, the layer below's outputs with the drafts they made (its
    last output is the next draft); returns its logits and outputs per stream."""
    items, known = [None] * len(queues), {}
    for b in (b for b, a in enumerate(active) if a):
        queue = queues[b][layer]
        n = len(queue.tokens)
        parts = [h for h in (queue.hidden, tent[b]) if h is not None and h.shape[1]]
        hidden = mx.concatenate(parts, axis=1) if len(parts) > 1 else parts[0]
        c = hidden.shape[1] - n  # inputs read tentatively, with the last c drafts
        toks = [mx.array(queue.tokens, dtype=mx.int32)]
        toks += [x.token.astype(mx.int32) for x in drafts[b][len(drafts[b]) - c :]]
        items[b] = (hidden, mx.concatenate(toks))
        known[b] = (n, c)
    logits, outs = caches.read(layer, items)
    for b, (n, c) in known.items():
        queue = queues[b][layer]
        if n and layer + 1 < len(queues[b]):
            queues[b][layer + 1].push(outs[b][:, :n], queue.tokens)
        if n:
            queue.drop_first(n)
        tent[b] = outs[b][:, n:]
        tentative[b][layer] += c
    return logits, outs


def verify(
    model, caches: RoundCaches, streams: Sequence[Stream], drafts: List[List[Draft]]
) -> Tuple[List[List[int]], mx.array, mx.array]:
    """Verify every stream's ``[y, drafts]`` in one trunk forward.

    A stream with fewer drafts than the widest is padded after its tokens,
    where its causal mask hides the padding (``settle`` rolls it back like a
    rejected draft). Returns each stream's accepted drafts plus one token of
    the main model (its verifier's), and the trunk's logits and hidden states.
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
    logits, hidden = model.trunk(mx.stack(rows), caches.trunk)
    # the round's one host sync
    emitted = [
        s.verifier.verify(logits[b, : len(d) + 1], d, s.history)
        for b, (s, d) in enumerate(zip(streams, drafts))
    ]
    agree = getattr(caches, "agree", None)  # over processes: rank 0's tokens
    if agree is not None:
        emitted = agree(emitted, drafts)
    return emitted, logits, hidden


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
    if drafts and drafts[0].source == "lookup":
        stats.lookup_drafted += len(drafts)
        stats.lookup_accepted += accepted


def settle(
    model,
    caches: RoundCaches,
    streams: Sequence[Stream],
    drafts: List[List[Draft]],
    tentative: Optional[List[List[int]]],
    emitted: List[List[int]],
    logits: mx.array,
    hidden: mx.array,
    feed_head: bool,
) -> List[int]:
    """Keep each stream's tokens of a round and roll back the rest.

    ``emitted[b]`` are stream ``b``'s accepted drafts and its main-model token,
    ``logits`` and ``hidden`` the trunk's outputs at the round's inputs
    (``[B, width, ...]``; the logits give the kept tokens' log-probabilities
    to a stream that asks for them).
    Each stream keeps through its first stop token and at most its remaining
    tokens; the trunk goes back to the tokens kept, every head layer past its
    tentative entries, and (``feed_head``) the kept states of each stream that
    reads along (``reads_along``) wait for the head.
    Extends each stream's history and stats; returns how many each kept.
    """
    width = 1 + max(len(d) for d in drafts)
    kept = []
    for s, d, e in zip(streams, drafts, emitted):
        m = kept_count(e, s.stop_tokens, s.remaining)
        count_round(s.stats, d, len(e) - 1, m)
        kept.append(m)
    # the trunk keeps y, e_1..e_{m-1}; the head its true entries
    if width > 1:
        caches.rollback(caches.trunk, [width - m for m in kept])
    if tentative is not None and model.head is not None:
        for j in range(model.head.num_layers):
            counts = [t[j] for t in tentative]
            if any(counts):
                caches.rollback(model.head.layer_cache(caches.head, j), counts)
    for b, (s, m) in enumerate(zip(streams, kept)):
        if s.logprobs is not None:
            rows = logprobs(s.verifier, logits[b, :m], s.history, emitted[b][:m])
            s.logprobs.record(rows, emitted[b][:m])
        if feed_head and reads_along(model, s.source):
            read = [s.history[-1]] + emitted[b][: m - 1]
            s.cache.pending[0].push(hidden[b : b + 1, :m], read)
        s.history.extend(emitted[b][:m])
        s.generated += m
        s.done = s.history[-1] in s.stop_tokens or s.generated >= s.max_tokens
    if feed_head and any(
        q.size > PENDING_LIMIT for s in streams for q in s.cache.pending
    ):
        catch_up(model, caches, streams)  # layers that did not draft for a while
        mx.async_eval([c.state for c in caches.head])
    return kept
