"""Speculative rounds for several streams at once.

One trunk forward verifies every stream's drafts, and each stream keeps its
own number of tokens. The round is ``rounds``' (the single-stream loop's,
step by step, per stream); the streams only share the forward passes. Here
are the batch caches it works on (``BatchDecoder``): each head call's rows
are right-padded to one length and the padding is rolled back at once;
padding always sits after a stream's real tokens, where its causal mask
hides it, and is gone before the next round, so each stream's tokens are
those it would get alone. The caches are ``batch_cache``'s.
"""

import time
from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence, Tuple

import mlx.core as mx

from .. import rounds
from ..adaptive import AcceptanceEstimate, expected_tokens
from ..ngram import PromptLookup
from ..rounds import Item
from ..sampling import Draft
from .batch_cache import RaggedKVCache, merge, rollback
from .policy import BatchDraftLength


@dataclass
class Stream(rounds.Stream):
    """A served stream: a round's ``Stream`` with its draft cap and its
    running acceptance. Until it joins a batch ``cache`` holds the stream's
    own caches; in the batch it keeps only the head's pending inputs."""

    draft_max: int = 0
    prior: Optional[List[float]] = None  # the head's measured acceptance per depth
    rates: AcceptanceEstimate = field(init=False)  # running acceptance per depth
    lookup: Optional[PromptLookup] = None  # prompt-lookup drafts, where asked for

    def __post_init__(self):
        self.rates = AcceptanceEstimate(self.draft_max, self.prior)
        self.stats.draft_max = self.draft_max


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

    # -- what a round reads and rolls back (``rounds.RoundCaches``) ----------

    def read(self, j: int, items: Sequence[Item]) -> Tuple[List, List]:
        """Head layer ``j`` over each stream's ``(hidden [1, L_b, D], tokens)``
        (or None), right-padded to one length; the padding is rolled back."""
        head = self.model.head
        lengths = [0 if it is None else it[0].shape[1] for it in items]
        L = max(lengths)
        like = next(it[0] for it in items if it is not None)
        hidden, tokens = [], []
        for it, n in zip(items, lengths):
            h, t = it if it is not None else (like[:, :0], [])
            t = t.astype(mx.int32) if isinstance(t, mx.array) else mx.array(t, mx.int32)
            if n < L:
                pad = mx.zeros((1, L - n, h.shape[2]), h.dtype)
                h = mx.concatenate([h, pad], axis=1)
                t = mx.concatenate([t, mx.zeros((L - n,), mx.int32)])
            hidden.append(h)
            tokens.append(t)
        layer_caches = head.layer_cache(self.head, j)
        logits, out = head.layer(j)(
            mx.concatenate(hidden), mx.stack(tokens), layer_caches
        )
        rollback(layer_caches, [L - n for n in lengths])
        last = [logits[b : b + 1, n - 1] if n else None for b, n in enumerate(lengths)]
        outs = [out[b : b + 1, :n] if n else None for b, n in enumerate(lengths)]
        return last, outs

    def rollback(self, caches: List[Any], counts: List[int]) -> None:
        rollback(caches, counts)

    # -- rounds --------------------------------------------------------------

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
        rounds.catch_up(model, self, self.streams)
        pending = [q.hidden for s in self.streams for q in s.cache.pending]
        mx.eval(pending, [c.state for c in self.trunk + self.head])

    def _cap(self, s: Stream) -> int:
        """The most drafts stream ``s`` may take this round."""
        if self.model.head is None:
            return 0
        return max(0, min(s.draft_max, s.max_tokens - s.generated - 1))

    def _looked(self, s: Stream, cap: int, k: int) -> List[int]:
        """Stream ``s``'s prompt-lookup drafts this round, where checking them
        is expected to pay more than a plain step, or (in "auto") than the
        head's ``min(cap, k)`` drafts, by the single-stream costs.

        With other streams in the batch, a proposal rides within the round's
        width ``k``, which the batch's draft length found worth its cost:
        a wider one would widen every stream's verify (and ``k`` 0, a batch
        where drafts do not pay, takes none).
        """
        if s.lookup is None or s.remaining < 2:
            return []
        limit = s.remaining - 1 if len(self.streams) == 1 else min(s.remaining - 1, k)
        if limit < 1:
            return []
        against, kb = 1.0, min(cap, k)
        if s.lookup.mode == "auto" and kb > 0:
            against = expected_tokens(s.rates.rates, kb) / s.lookup.costs.round(kb)
        return s.lookup.drafts(limit, against)

    def step(self) -> List[List[int]]:
        """One round of every stream; returns the tokens each emits."""
        model, streams = self.model, self.streams
        tic = time.perf_counter()
        self.peak = max(self.peak, len(streams))
        caps = [self._cap(s) for s in streams]
        k = max(caps)
        if self.policy is not None:
            k = self.policy.choose(len(streams), [s.rates.rates for s in streams], caps)
        looked = [self._looked(s, c, k) for s, c in zip(streams, caps)]
        drafts, tentative = [[] for _ in streams], None
        ks = [0 if lk else min(c, k) for c, lk in zip(caps, looked)]
        if max(ks) > 0:
            drafts, tentative = rounds.draft(model, self, streams, ks, self.draft_p_min)
        for b, lk in enumerate(looked):
            if lk:
                drafts[b] = [Draft(mx.array([t]), None) for t in lk]
        emitted, logits, hidden = rounds.verify(model, self, streams, drafts)
        for s, d, e, cap, lk in zip(streams, drafts, emitted, caps, looked):
            if lk:
                s.lookup.update(len(d), len(e) - 1)
            elif cap:  # undrafted positions drift back up: a low rate is retried
                s.rates.update(len(d), len(e) - 1)
        feed = model.head is not None
        kept = rounds.settle(
            model, self, streams, drafts, tentative, emitted, logits, hidden, feed
        )
        for s in streams:
            if s.lookup is not None:
                s.lookup.sync(s.history)
        seconds = time.perf_counter() - tic
        # a round widened by lookup drafts is no sample of the head's K
        if self.policy is not None and max(map(len, drafts)) <= k:
            self.policy.record(len(streams), k, seconds)
        for s in streams:
            s.stats.generation_time += seconds
        return [e[:m] for e, m in zip(emitted, kept)]
