"""Speculative rounds for several streams at once.

One trunk forward verifies every stream's drafts, and each stream keeps its
own number of tokens. A round follows the single-stream loop
(``speculative.py``) step by step, per stream; the streams only share the
forward passes:

1) drafts: each head call reads, for every stream, what that stream's own
   loop would read; the inputs are right-padded to one length and the
   padding is rolled back at once;
2) verifies ``[y, d_1..d_K]`` of every stream in ONE trunk forward (a stream
   with fewer drafts is padded; its padding goes like a rejected draft);
3) accepts per stream, with the stream's own verifier;
4) rolls back per stream: the trunk to the tokens each keeps, every head
   layer past that stream's tentative entries;
5) leaves each stream's kept hidden states pending for its head.

Padding always sits after a stream's real tokens, where its causal mask
hides it, and is gone before the next round, so each stream's tokens are
those it would get alone. The caches are ``batch_cache``'s.
"""

import time
from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence, Set, Tuple

import mlx.core as mx

from ..cache import MTPCache, start_verify
from ..sampling import Draft
from ..speculative import PENDING_LIMIT, count_round, kept_count
from ..stats import MTPStats
from .batch_cache import RaggedKVCache, merge, rollback
from ..adaptive import AcceptanceEstimate
from .policy import BatchDraftLength


@dataclass
class Stream:
    """One generation: its settings, its verifier and where it stands.

    ``history`` is every token so far, prompt included; the trunk has read all
    but the last. ``cache`` holds the stream's own caches until it joins a
    batch; in the batch it keeps only the head's pending inputs.
    """

    history: List[int]
    cache: MTPCache
    verifier: Any
    max_tokens: int
    draft_max: int
    stop_tokens: Set[int] = field(default_factory=set)
    stats: MTPStats = field(default_factory=MTPStats)
    generated: int = 0
    done: bool = False
    prior: Optional[List[float]] = None  # the head's measured acceptance per depth
    rates: AcceptanceEstimate = field(init=False)  # running acceptance per depth

    def __post_init__(self):
        self.rates = AcceptanceEstimate(self.draft_max, self.prior)
        self.stats.draft_max = self.draft_max


def _read(model, caches: List[Any], j: int, items: Sequence[Optional[Tuple]]):
    """Head layer ``j`` over each stream's ``(hidden [1, L_b, D], tokens)`` (or None).

    Returns each stream's logits at its last input (``[1, V]``) and its
    outputs (``[1, L_b, D]``); None for a stream with nothing to read.
    """
    head = model.head
    lengths = [0 if it is None else it[0].shape[1] for it in items]
    L = max(lengths)
    like = next(it[0] for it in items if it is not None)
    hidden, tokens = [], []
    for it, n in zip(items, lengths):
        h, t = it if it is not None else (like[:, :0], [])
        if not isinstance(t, mx.array):
            t = mx.array(t, dtype=mx.int32)
        if n < L:
            h = mx.concatenate([h, mx.zeros((1, L - n, h.shape[2]), h.dtype)], axis=1)
            t = mx.concatenate([t.astype(mx.int32), mx.zeros((L - n,), mx.int32)])
        hidden.append(h)
        tokens.append(t.astype(mx.int32))
    layer_caches = head.layer_cache(caches, j)
    logits, out = head.layer(j)(mx.concatenate(hidden), mx.stack(tokens), layer_caches)
    rollback(layer_caches, [L - n for n in lengths])
    last = [logits[b : b + 1, n - 1] if n else None for b, n in enumerate(lengths)]
    outs = [out[b : b + 1, :n] if n else None for b, n in enumerate(lengths)]
    return last, outs


def catch_up(model, streams: List[Stream], caches: List[Any]) -> None:
    """Every head layer of every stream reads its complete pairs (as in
    ``speculative.catch_up``)."""
    n_layers = len(streams[0].cache.pending)
    for j in range(n_layers):
        items = []
        for s in streams:
            q = s.cache.pending[j]
            n = len(q.tokens)
            items.append((q.hidden[:, :n], list(q.tokens)) if n else None)
        if not any(items):
            continue
        _, outs = _read(model, caches, j, items)
        for s, it, out in zip(streams, items, outs):
            if it is None:
                continue
            if j + 1 < n_layers:
                s.cache.pending[j + 1].push(out, it[1])
            s.cache.pending[j].drop_first(len(it[1]))


def draft(model, streams: List[Stream], caches: List[Any], ks: List[int], p_min: float):
    """Up to ``ks[b]`` drafts for stream ``b``, as ``speculative.draft`` drafts them.

    A stream stops taking part once it has its drafts (or its draft falls
    below ``p_min``); its rows of later head calls are padding. Returns the
    drafts and, per stream and head layer, the tentative entries written.
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
    logits, outs = _read(model, caches, 0, items)
    tent = [None] * len(streams)  # each stream's tentative outputs of the last layer
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
        items = [None] * len(streams)
        if j + 1 < n_layers:  # layer j + 1 drafts depth j + 2
            layer, known = j + 1, {}
            for b in (b for b, a in enumerate(active) if a):
                queue = queues[b][layer]
                n = len(queue.tokens)
                parts = [
                    h for h in (queue.hidden, tent[b]) if h is not None and h.shape[1]
                ]
                hidden = mx.concatenate(parts, axis=1) if len(parts) > 1 else parts[0]
                c = (
                    hidden.shape[1] - n
                )  # inputs read tentatively, with the last c drafts
                toks = [mx.array(queue.tokens, dtype=mx.int32)]
                toks += [
                    x.token.astype(mx.int32) for x in drafts[b][len(drafts[b]) - c :]
                ]
                items[b] = (hidden, mx.concatenate(toks))
                known[b] = (n, c)
            logits, outs = _read(model, caches, layer, items)
            for b, (n, c) in known.items():
                queue = queues[b][layer]
                if n and layer + 1 < n_layers:
                    queues[b][layer + 1].push(outs[b][:, :n], queue.tokens)
                if n:
                    queue.drop_first(n)
                tent[b] = outs[b][:, n:]
                tentative[b][layer] += c
        else:  # past the last layer: chain it on its own output
            layer = n_layers - 1
            for b in (b for b, a in enumerate(active) if a):
                items[b] = (outs[b][:, -1:], drafts[b][-1].token)
                tentative[b][layer] += 1
            logits, new = _read(model, caches, layer, items)
            outs = [n if n is not None else o for n, o in zip(new, outs)]
    return drafts, tentative


def _extract(cache, b: int, kind: type):
    if isinstance(cache, RaggedKVCache):
        return cache.extract(b)
    return cache.extract(b, kind)  # a recurrent layer's own cache class


class BatchDecoder:
    """Streams decoded together, one speculative round at a time."""

    def __init__(self, model, draft_p_min: float = 0.0, adaptive: bool = True):
        """``adaptive``: each round drafts as deep as pays (``BatchDraftLength``);
        otherwise every stream drafts its ``draft_max`` every round."""
        self.model = model
        self.draft_p_min = draft_p_min
        self.streams: List[Stream] = []
        self.trunk: List[Any] = []  # batch caches, one per trunk layer
        self.head: List[Any] = []  # batch caches, the head's flat list
        self.kinds: List[type] = []  # the trunk's single-stream cache classes
        self.policy = BatchDraftLength() if adaptive else None
        self.peak = 0  # the most streams a round has decoded

    def __len__(self) -> int:
        return len(self.streams)

    def add(self, streams: List[Stream]) -> None:
        """Join ``streams`` (prefilled, each with its own caches) to the batch."""
        trunk = [merge(layer) for layer in zip(*(s.cache.trunk for s in streams))]
        head = [merge(layer) for layer in zip(*(s.cache.head for s in streams))]
        if self.streams:
            for mine, theirs in zip(self.trunk + self.head, trunk + head):
                mine.extend(theirs)
        else:
            self.trunk, self.head = trunk, head
            self.kinds = [type(c) for c in streams[0].cache.trunk]
        for s in streams:
            s.cache.trunk, s.cache.head = [], []
        self.streams += streams

    def remove(self, streams: List[Stream], extract: bool = True) -> None:
        """Let ``streams`` leave; with ``extract`` each gets its caches back."""
        index = {id(s): b for b, s in enumerate(self.streams)}
        gone = [index[id(s)] for s in streams]
        if extract:
            for s, b in zip(streams, gone):
                s.cache.trunk = [
                    _extract(c, b, t) for c, t in zip(self.trunk, self.kinds)
                ]
                s.cache.head = [c.extract(b) for c in self.head]
        keep = [b for b in range(len(self.streams)) if b not in set(gone)]
        for c in self.trunk + self.head:
            c.filter(keep)
        self.streams = [self.streams[b] for b in keep]

    def prefill(self, tokens: List[List[int]]) -> None:
        """Stream ``b`` reads ``tokens[b]``; all of the same length, so the
        recurrent layers run unpadded (as ``speculative.prefill`` reads a chunk)."""
        model = self.model
        _, hidden = model.trunk(mx.array(tokens), self.trunk)
        if model.head is None:
            mx.eval([c.state for c in self.trunk])
            return
        for b, (s, chunk) in enumerate(zip(self.streams, tokens)):
            s.cache.pending[0].push(hidden[b : b + 1], chunk)
        catch_up(model, self.streams, self.head)
        pending = [q.hidden for s in self.streams for q in s.cache.pending]
        mx.eval(pending, [c.state for c in self.trunk + self.head])

    def _cap(self, s: Stream) -> int:
        """The most drafts stream ``s`` may take this round."""
        if self.model.head is None:
            return 0
        return max(0, min(s.draft_max, s.max_tokens - s.generated - 1))

    def step(self) -> List[List[int]]:
        """One round of every stream; returns the tokens each emits."""
        model, streams = self.model, self.streams
        tic = time.perf_counter()
        self.peak = max(self.peak, len(streams))
        caps = [self._cap(s) for s in streams]
        k = max(caps)
        if self.policy is not None:
            k = self.policy.choose(len(streams), [s.rates.rates for s in streams], caps)
        # 1) draft
        drafts, tentative = [[] for _ in streams], None
        if k > 0:
            ks = [min(c, k) for c in caps]
            drafts, tentative = draft(model, streams, self.head, ks, self.draft_p_min)
        # 2) verify in one forward
        width = 1 + max(len(d) for d in drafts)
        rows = []
        for s, d in zip(streams, drafts):
            row = [mx.array([s.history[-1]], dtype=mx.int32)]
            row += [x.token.astype(mx.int32) for x in d]
            if len(d) + 1 < width:
                row.append(mx.zeros((width - 1 - len(d),), mx.int32))
            rows.append(mx.concatenate(row))
        start_verify(self.trunk)
        logits, hidden = model.trunk(mx.stack(rows), self.trunk)
        # 3) accept, each stream with its own verifier
        kept, out = [], []
        for b, (s, d) in enumerate(zip(streams, drafts)):
            emitted = s.verifier.verify(logits[b, : len(d) + 1], d, s.history)
            accepted = len(emitted) - 1
            m = kept_count(emitted, s.stop_tokens, s.max_tokens - s.generated)
            if caps[b]:  # undrafted positions drift back up: a low rate is retried
                s.rates.update(len(d), accepted)
            count_round(s.stats, d, accepted, m)
            kept.append(m)
            out.append(emitted[:m])
        # 4) roll back: each stream's trunk to the tokens it keeps, its head
        # layers past their tentative entries
        rollback(self.trunk, [width - m for m in kept])
        if tentative is not None:
            for j in range(model.head.num_layers):
                layer = model.head.layer_cache(self.head, j)
                rollback(layer, [t[j] for t in tentative])
        # 5) the kept hidden states wait for the head
        for b, (s, m) in enumerate(zip(streams, kept)):
            if model.head is not None:
                read = [s.history[-1]] + out[b][: m - 1]
                s.cache.pending[0].push(hidden[b : b + 1, :m], read)
            s.history.extend(out[b])
            s.generated += m
            s.done = out[b][-1] in s.stop_tokens or s.generated >= s.max_tokens
        if model.head is not None and any(
            q.size > PENDING_LIMIT for s in streams for q in s.cache.pending
        ):
            catch_up(model, streams, self.head)
        seconds = time.perf_counter() - tic
        if self.policy is not None:
            self.policy.record(len(streams), k, seconds)
        for s in streams:
            s.stats.generation_time += seconds
        return out
