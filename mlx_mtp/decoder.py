"""The decoding loop: speculative rounds for one stream or a batch of streams.

One trunk forward verifies every stream's drafts, and each stream keeps its
own number of tokens. The round is ``rounds``' (draft, verify, settle, per
stream); the streams only share the forward passes. Each stream's draft
source (``drafts.py``) plans its part of the round; the round's draft length
comes from the batch's policy (``batch_policy.BatchDraftLength``: expected
tokens per measured second at this batch size) or, without one, from each
stream's own count (``adaptive.CostAwareDraft``, ``FixedDraft``): the single
stream's way.

The caches: where the model's caches have batch forms (``batch_cache``) and
the decoder merges (``merge``, the default), each drafter call's rows are
right-padded to one length and the padding is rolled back at once; padding
always sits after a stream's real tokens, where its causal mask hides it,
and is gone before the next round, so each stream's tokens are those it
would get alone (a drafter's cache that holds nothing per position, a Gemma
4 assistant's, which reads each stream's rows of the batch's trunk caches,
takes its padding before the inputs instead). Otherwise (``merge=False``: the
single-stream API; or caches with no batch form here: a bounded cache) the
decoder runs a batch of one on the stream's own caches, through the same
rounds.

A round without drafts (no stream drafts, as the policy picks where drafts
do not pay) runs one ahead, as mlx-lm's generation does: the next round's
forward starts on this round's tokens, still lazy, before they are read, so
building it and the caller's work on the tokens overlap the computation
(``_Ahead``). A stream that leaves while such a round is under way has its
extra token taken back from its cache before it gets it: by length in batch
caches of attention layers, from a snapshot of its own caches otherwise (a
recurrent state is brought back whole).
"""

import statistics
import time
from collections import deque
from typing import Any, Deque, Dict, List, Optional, Sequence

import mlx.core as mx

from . import round_costs, rounds, timing
from .batch_cache import RaggedKVCache, batchable, extract_stream, merge
from .batch_cache import rollback as batch_rollback
from .batch_policy import BatchDraftLength
from .cache import Snapshot, start_verify
from .cache import rollback as own_rollback
from .drafter import DraftView, Item
from .kv import KVSettings, QuantizingKVCache, quantizes_later, width_limit
from .prompt import Piece, Prompt, as_prompt
from .round_costs import LOOKUP
from .stream import Stream

# ``Decoder.wait_cost`` from the medians of the latest ``TIMED_ROUNDS`` plain
# rounds of each kind, once there are ``TIMED_MIN``
TIMED_ROUNDS = 16
TIMED_MIN = 3


class _Ahead:
    """A round without drafts that has started and is not read yet.

    The trunk has read each stream's next token: its history's last, or the
    token of the round before it, still lazy (``pending``). ``tokens[b]`` is
    stream ``b``'s next token, sampled and left lazy. Its rows are the
    decoder's streams (a stream that joins first has it read: ``Decoder.add``).
    ``undo``: on a stream's own caches, their snapshot from before it.
    """

    def __init__(self, model, trunk, streams, inputs: mx.array, pending, undo=None):
        self.undo: Optional[Snapshot] = undo
        self.logits, self.taps = model.target.forward(
            inputs.reshape(-1, 1), trunk, keep_layers=rounds.keeps_layers(model, streams)
        )
        self.tokens = mx.concatenate(
            [
                s.verifier.sample(self.logits[b, -1:], s.history, p).reshape(1)
                for b, (s, p) in enumerate(zip(streams, pending))
            ]
        ).astype(mx.int32)
        mx.async_eval(self.tokens)

    def read(self) -> List[int]:
        """The tokens, once computed. An op of its own would queue behind the
        next round's and wait for it: ``tokens`` is read as it is."""
        return self.tokens.tolist()

    def keep(self, rows: List[int]) -> None:
        """Keep only the rows ``rows``, in that order."""
        idx = mx.array(rows, dtype=mx.int32)
        self.logits = self.logits[idx]
        self.taps = type(self.taps)(
            self.taps.hidden[idx], {i: x[idx] for i, x in self.taps.layers.items()}
        )
        self.tokens = self.tokens[idx]
        mx.async_eval(self.tokens)


def one_ragged(call, items: Sequence[Item], caches: List[Any]):
    """``DraftView.ragged`` for one stream: its item as it is."""
    hidden, tokens = items[0]
    if not isinstance(tokens, mx.array):
        tokens = mx.array(tokens)
    h, out = call(hidden, tokens.reshape(1, -1).astype(mx.int32), caches)
    return h[:, -1:], [out]


class Decoder(DraftView):
    """Streams decoded together, one speculative round at a time."""

    def __init__(
        self,
        model,
        draft_p_min: float = 0.0,
        policy: Optional[BatchDraftLength] = None,
        merge: bool = True,
        convert: bool = True,
        kv: Optional[KVSettings] = None,
    ):
        """``policy``: each round drafts as deep as pays at this batch size
        (a ``BatchDraftLength``; one shared by several decoders keeps what it
        measured); None: as deep as each stream's own count asks.
        ``merge=False``: one stream, on its own caches. ``convert=False``:
        caches of a quantizing policy stay in full precision in the batch (a
        reader of prompts whose caches have not turned yet: ``turning``).
        ``kv``: the policy the streams' caches follow (a bounded cache has
        no batch form: one stream at a time)."""
        self.model = model
        self.draft_p_min = draft_p_min
        self.streams: List[Stream] = []
        self._trunk: List[Any] = []  # batch caches, one per trunk layer
        self._drafts: Dict[str, List[Any]] = {}  # each drafter's batch caches
        self.kinds: List[type] = []  # the trunk's single-stream cache classes
        self.policy = policy
        self.peak = 0  # the most streams a round has decoded
        self.agree = None  # over processes: rank 0's tokens (``serve.cluster``)
        self.ahead: Optional[_Ahead] = None  # the round under way, not read yet
        self.next_k: Optional[int] = None  # the next round's K, once chosen
        self.landed: Optional[dict] = None  # tokens read by ``add``, by stream
        self.convert = convert
        # one stream's latest plain rounds' seconds: started cold, run ahead
        self.plain_seconds: Dict[bool, Deque[float]] = {
            True: deque(maxlen=TIMED_ROUNDS),
            False: deque(maxlen=TIMED_ROUNDS),
        }
        cache = model.make_cache()
        if kv is not None:
            kv.apply(cache)
        self.batched = merge and batchable(cache.state_list())

    def __len__(self) -> int:
        return len(self.streams)

    @property
    def capacity(self) -> int:
        """The most streams this decoder holds at once (0: any)."""
        return 0 if self.batched else 1

    @property
    def trunk(self) -> List[Any]:
        if self.batched or not self.streams:
            return self._trunk
        return self.streams[0].cache.trunk

    def add(self, streams: List[Stream]) -> None:
        """Join ``streams`` (prefilled, each with its own caches) to the batch."""
        for s in streams:
            rounds.follow(self.model, s.cache, s.source)
        if self.ahead is not None:  # read the round under way: they have no row
            out = self._plain(time.perf_counter(), start_next=False)
            self.landed = dict(zip(map(id, self.streams), out))
        if not self.batched:  # a batch of one, on the stream's own caches
            if len(self.streams) + len(streams) > 1:
                raise ValueError("this decoder runs one stream at a time")
            self.streams += streams
            return
        convert = self.convert
        trunk = [
            merge(layer, convert) for layer in zip(*(s.cache.trunk for s in streams))
        ]
        drafts = {
            d.name: [
                merge(layer, convert)
                for layer in zip(*(s.cache.drafts[d.name].caches for s in streams))
            ]
            for d in self.model.drafters
        }
        if self.streams:
            for mine, theirs in zip(self._trunk, trunk):
                mine.extend(theirs)
            for name, caches in drafts.items():
                for mine, theirs in zip(self._drafts[name], caches):
                    mine.extend(theirs)
        else:
            self._trunk, self._drafts = trunk, drafts
            self.kinds = [type(c) for c in streams[0].cache.trunk]
            for c in (c for cs in drafts.values() for c in cs):
                if hasattr(c, "link"):  # it reads the trunk's caches: the batch's
                    c.link(self._trunk)
        for s in streams:
            s.cache.trunk = []
            for state in s.cache.drafts.values():
                state.caches = []
        self.streams += streams

    def remove(self, streams: List[Stream], extract: bool = True) -> None:
        """Let ``streams`` leave; with ``extract`` each gets its caches back.
        (What the rounds measured of the costs is stored off the requests'
        path: ``round_costs.store``.)"""
        if not self.batched:  # its caches never left it
            if self.ahead is not None:  # the trunk read one token past its history
                if self.ahead.undo is not None:
                    self.streams[0].cache.restore(self.ahead.undo)
                self.ahead = None
            gone = {id(s) for s in streams}
            self.streams = [s for s in self.streams if id(s) not in gone]
            return
        index = {id(s): b for b, s in enumerate(self.streams)}
        gone = [index[id(s)] for s in streams]
        if self.ahead is not None:  # leaving streams' rows go, their tokens unread
            if extract:  # the trunk read one token past each one's history
                batch_rollback(self._trunk, [int(b in gone) for b in range(len(self))])
            left = [b for b in range(len(self)) if b not in set(gone)]
            if left:
                self.ahead.keep(left)
            else:
                self.ahead = None
        if extract:
            for s, b in zip(streams, gone):
                s.cache.trunk = [
                    extract_stream(c, b, t) for c, t in zip(self._trunk, self.kinds)
                ]
                for name, caches in self._drafts.items():
                    s.cache.drafts[name].caches = [c.extract(b) for c in caches]
                s.cache.link()
        keep = [b for b in range(len(self.streams)) if b not in set(gone)]
        for c in self._trunk + [c for cs in self._drafts.values() for c in cs]:
            c.filter(keep)
        self.streams = [self.streams[b] for b in keep]

    def turning(self) -> List[Stream]:
        """Streams whose caches (held in full precision, ``convert=False``)
        turn quantized at their next write: a reader hands them on."""
        for c in self._trunk:
            like = getattr(c, "like", None)
            if isinstance(like, QuantizingKVCache) and not like.quantized:
                return [s for s, n in zip(self.streams, c.lengths) if n >= like.turn]
        return []

    # -- what a round reads and rolls back (``drafter.DraftView``) -------------

    def caches(self, drafter) -> List[Any]:
        if self.batched:
            return self._drafts[drafter.name]
        return self.streams[0].cache.drafts[drafter.name].caches

    def ragged(self, call, items: Sequence[Item], caches: List[Any]):
        """``call`` over each stream's ``(features [1, L_b, F], tokens)`` (or
        None), right-padded to one length; the padding is rolled back."""
        if not self.batched:
            return one_ragged(call, items, caches)
        lengths = [0 if it is None else it[0].shape[1] for it in items]
        L = max(lengths)
        # caches that hold nothing per position (a Gemma 4 assistant's count)
        # take their padding before each row's inputs: its last input is last
        left = bool(caches) and all(getattr(c, "pads_left", False) for c in caches)
        like = next(it[0] for it in items if it is not None)
        hidden, tokens = [], []
        for it, n in zip(items, lengths):
            h, t = it if it is not None else (like[:, :0], [])
            t = t.astype(mx.int32) if isinstance(t, mx.array) else mx.array(t, mx.int32)
            if n < L:
                pad = mx.zeros((1, L - n, h.shape[2]), h.dtype)
                h = mx.concatenate([pad, h] if left else [h, pad], axis=1)
                zeros = mx.zeros((L - n,), mx.int32)
                t = mx.concatenate([zeros, t] if left else [t, zeros])
            hidden.append(h)
            tokens.append(t)
        h, out = call(mx.concatenate(hidden), mx.stack(tokens), caches)
        if L > min(lengths):
            self.rollback(caches, [L - n for n in lengths])
        # each stream's state at its last input (a drafter may give its states
        # at its last inputs only: a Gemma 4 assistant)
        skip = L - h.shape[1]
        if left:
            last = h[:, -1:]
            first = [max(L - n - skip, 0) for n in lengths]
        else:
            at = mx.array([max(n - 1 - skip, 0) for n in lengths], dtype=mx.int32)
            last = mx.take_along_axis(h, at[:, None, None], axis=1)
            first = [0] * len(lengths)
        outs = [
            out[b : b + 1, i : i + n] if n else None
            for b, (n, i) in enumerate(zip(lengths, first))
        ]
        return last, outs

    def rollback(self, caches: List[Any], counts: List[int]) -> None:
        if self.batched:
            batch_rollback(caches, counts)
        else:
            own_rollback(caches, counts[0])

    # -- prompts -----------------------------------------------------------------

    def prefill(
        self, tokens: List[List[int]], pieces: Optional[List[List[Piece]]] = None
    ) -> None:
        """Stream ``b`` reads ``tokens[b]``, with its media ``pieces[b]``
        (``prompt.Piece``: read as input embeddings, at positions within the
        chunk), and the drafters it reads along with the features it made.
        Chunks of one length run unpadded (the recurrent layers need it);
        shorter ones are right-padded, which only attention caches take
        (``chunks``): a causal mask keeps the padding from every real token,
        and each stream's padding is rolled back after."""
        model = self.model
        width = max(map(len, tokens))
        pads = [width - len(t) for t in tokens]
        padded = [t + [0] * p for t, p in zip(tokens, pads)]
        within = any(pads) and not self._attention()  # (``_exact_chunks``)
        if within:
            start_verify(self.trunk)
        _, taps = model.target.forward(
            mx.array(padded),
            self.trunk,
            pieces=pieces,
            keep_layers=rounds.keeps_layers(model, self.streams),
        )
        if any(pads):
            self.rollback(self.trunk, pads)
        fed = []
        for d in model.drafters:
            reading = [rounds.reads_along(d, s.source) for s in self.streams]
            if not any(reading):
                continue
            features = d.features(taps)
            if d.reads_last:
                # it would read the last prompt feature alone, which costs the
                # whole forward: the trunk's layers whose outputs no cache
                # keeps (Gemma 4's K/V-sharing ones) then run over every
                # position. It holds placeholders, and the round that reads the
                # prompt's last token makes the features it drafts from.
                features = mx.zeros(features.shape, features.dtype)
            for b, (s, chunk) in enumerate(zip(self.streams, tokens)):
                if reading[b]:
                    d.observe(s, features[b : b + 1, : len(chunk)], chunk)
                    s.blind = s.blind or d.reads_last
            # the prompt's features wait for the drafter's first proposal (one
            # left out, or never asked, reads none), unless too many wait
            if d.overdue(self.streams):
                d.catch_up(self, self.streams)
            fed.append(d)
        if not fed:
            mx.eval([c.state for c in self.trunk])
            return
        pending = [
            q.hidden
            for s in self.streams
            for d in fed
            for q in d.state(s).pending
            if q.size
        ]
        caches = [c for d in fed for c in self.caches(d)]
        mx.eval(pending, [c.state for c in self.trunk + caches])

    def chunks(
        self,
        left: List[int],
        step: int,
        prompts: Optional[Sequence[Prompt]] = None,
        read: Optional[Sequence[int]] = None,
    ) -> List[int]:
        """How many prompt tokens each stream reads next, of ``left`` still
        to read (about ``step``; each of ``left`` > 0), from ``read`` of
        ``prompts``: a chunk never splits a media segment (it stops before
        one, or reads one that starts it whole).

        Attention caches read ragged chunks in one forward, right-padded to
        the longest: as wide as the padding (wasted work) stays within the
        real tokens, so that 8 prompts of different lengths take one forward,
        not one per length. Other caches (a recurrent state cannot take
        padding back) read one length for all: the longest up to the
        shortest remainder that splits no stream's segment (where none does,
        a segment is read over two chunks: its embeddings are the same)."""
        want = [min(m, step) for m in left]
        media = prompts is not None and any(p.segments for p in prompts)
        if self._exact_chunks():
            return [p.take(r, w) for p, r, w in zip(prompts, read, want)] if media else want
        if not self._attention():
            n = min(want)
            if media:
                n = next(
                    (w for w in range(n, 0, -1)
                     if all(p.take(r, w) == w for p, r in zip(prompts, read))),
                    n,
                )  # fmt: skip
            return [n] * len(want)
        if media:
            want = [p.take(r, w) for p, r, w in zip(prompts, read, want)]
        if not self.convert:  # where the cache turns depends on it: mlx-lm's chunks
            return want
        for width in sorted(set(want), reverse=True):
            takes = [min(w, width) for w in want]
            if media:
                takes = [p.take(r, t) for p, r, t in zip(prompts, read, takes)]
            if len(takes) * max(takes) - sum(takes) <= sum(takes):
                return takes
        return want

    def read_chunk(self, prompts: Sequence[Prompt], read: List[int], step: int):
        """Each stream reads its prompt's next chunk (``chunks``; a prompt's
        last token is left to its first round). Returns how many tokens each
        read, the seconds it took, and which streams' prompts are now read."""
        prompts = [as_prompt(p) for p in prompts]
        left = [len(p) - 1 - r for p, r in zip(prompts, read)]
        takes = self.chunks(left, step, prompts, read)
        tic = time.perf_counter()
        pieces = None
        if any(p.segments for p in prompts):
            pieces = [p.pieces(r, r + n) for p, r, n in zip(prompts, read, takes)]
        self.prefill(
            [list(p.tokens[r : r + n]) for p, r, n in zip(prompts, read, takes)],
            pieces,
        )
        return takes, time.perf_counter() - tic, [m == n for m, n in zip(left, takes)]

    # -- rounds --------------------------------------------------------------

    def cap(self, s: Stream) -> int:
        """The most drafter drafts stream ``s`` may take this round."""
        if not self.model.drafters or s.blind:
            return 0
        return max(0, min(s.source.bound(), self.width(s) - 1))

    def width(self, s: Stream) -> int:
        """The most tokens stream ``s``'s next forward may read: its remaining
        tokens, and no more than its own caches take in one form and can take
        back (``kv.width_limit``: a cache about to turn quantized, a bounded one)."""
        limit = width_limit(s.cache.trunk)
        return s.remaining if limit is None else min(s.remaining, limit)

    def _plan(self, s: Stream, cap: int, k: int):
        """Stream ``s``'s plan this round: a ready proposal, or up to
        ``min(cap, k)`` drafter drafts. With other streams in the batch, a
        proposal rides within the round's width ``k``, which the batch's
        draft length found worth its cost: a wider one would widen every
        stream's verify (and ``k`` 0, a batch where drafts do not pay, takes
        none)."""
        width = self.width(s) - 1
        return s.source.plan(
            s.history, width if len(self.streams) == 1 else min(width, k), min(cap, k)
        )

    def step(self) -> List[List[int]]:
        """One round of every stream; returns the tokens each emits."""
        model, streams = self.model, self.streams
        tic = time.perf_counter()
        self.peak = max(self.peak, len(streams))
        if self.landed is not None:  # the round ``add`` read
            landed, self.landed = self.landed, None
            return [landed.get(id(s), []) for s in streams]
        if self.ahead is not None:
            return self._plain(tic)
        if len(streams) == 1 and self.policy is None and not self.batched:
            if self._recost(streams[0]):
                tic = time.perf_counter()  # the timing is no part of the round
        # 1) the round's draft length, and each stream's plan
        caps = [self.cap(s) for s in streams]
        for s in streams:  # this round's forward makes the features they lack
            s.blind = False
        k, self.next_k = (
            self._choose(caps) if self.next_k is None else self.next_k,
            None,
        )
        plans = [self._plan(s, c, k) for s, c in zip(streams, caps)]
        if not any(p.tokens or p.k for p in plans) and self._may_run_ahead():
            inputs = mx.array([s.history[-1] for s in streams], dtype=mx.int32)
            self.ahead = _Ahead(model, self.trunk, streams, inputs, [[]] * len(streams))
            return self._plain(tic, cold=True)
        # 2) the drafts: ready proposals, the drafters' for the rest; one verify
        drafts, tentative = rounds.draft(model, self, streams, plans, self.draft_p_min)
        emitted, logits, taps = rounds.verify(model, self, streams, drafts)
        drift = self.policy is not None  # undrafted depths drift back up
        for s, p, d, e, cap in zip(streams, plans, drafts, emitted, caps):
            if d or (cap and drift):
                s.source.update(d[0].source if d else p.drafter, len(d), len(e) - 1)
        # 3) each stream keeps its tokens; the rest rolls back
        kept = rounds.settle(
            model, self, streams, drafts, tentative, emitted, logits, taps
        )
        seconds = time.perf_counter() - tic
        # a round widened by lookup drafts is no sample of the drafters' K
        if self.policy is not None and max(map(len, drafts)) <= k:
            self.policy.record(len(streams), k, seconds)
            fix, key = self._batch_corrections()
            if fix is not None and k and any(drafts):
                fix.record_batch(key, len(streams), k, seconds)
        if len(streams) == 1 and drafts[0]:
            self._correct(streams[0], plans[0], 1 + len(drafts[0]), seconds)
        for s in streams:
            s.stats.generation_time += seconds
        return [e[:m] for e, m in zip(emitted, kept)]

    def _corrections(self, s: Stream):
        """The model's round-time corrections (``round_costs``), where they
        apply to ``s``: at a short context, costs measured here."""
        fix = round_costs.of(self.model)
        # (its history: in a batch its own caches are the batch's)
        if fix is None or timing.context_bucket(len(s.history)) is not None:
            return None
        return fix

    def _correct(self, s: Stream, plan, width: int, seconds: float) -> None:
        """A drafted round of one stream, ``width`` tokens verified in
        ``seconds``, corrects its source's costs (``round_costs``); where
        that moves them, ``s``'s draft source weighs rounds by them."""
        fix = self._corrections(s)
        if fix is None:
            return
        drafters = {d.name: d for d in self.model.drafters}
        key = LOOKUP if plan.tokens else drafters[plan.drafter].key
        # (a fixed count's rounds are samples too, for the sources after it)
        moved = fix.record(key, width, seconds)
        if not moved or not getattr(s.source, "weighs_costs", False):
            return
        s.source.recost(lambda name: fix.corrected(drafters.get(name)))

    def _recost(self, s: Stream) -> bool:
        """From a long context on, weigh ``s``'s rounds by costs measured at
        its context (``timing.costs_at``: once per power of two of the tokens
        its caches hold, once they have their lasting form). A batch needs
        none: its policy times its rounds as they run (``BatchDraftLength``)."""
        bucket = timing.context_bucket(s.cache.offset + 1)
        weighs = getattr(s.source, "weighs_costs", False)
        if bucket in (None, s.costed_at) or not weighs:
            return False
        if quantizes_later(s.cache.trunk):
            return False
        s.costed_at = bucket
        costs = timing.costs_at(self.model, self, s)
        if costs is not None:
            s.source.recost(costs)
        return True

    def wait_cost(self) -> Optional[float]:
        """What one stream's round forfeits, in plain steps, where it waits
        for its token to be read before the next round starts (a lookup's
        proposal needs it) instead of running that round ahead: the median
        time of its plain rounds started cold over that of rounds run ahead,
        less one (None until each has ``TIMED_MIN``). About nothing at short
        contexts; it grows with the context and a quantized cache's reads
        (docs/performance.md, "Costs at long contexts")."""
        cold, ahead = self.plain_seconds[True], self.plain_seconds[False]
        if min(len(cold), len(ahead)) < TIMED_MIN:
            return None
        return max(0.0, statistics.median(cold) / statistics.median(ahead) - 1.0)

    def _choose(self, caps: List[int]) -> int:
        """The round's draft length: the policy's, or the most any stream's
        own count asks (each count is asked once a round)."""
        if self.policy is None:
            counts = [min(s.source.count(), c) for s, c in zip(self.streams, caps)]
            return max(counts, default=0)
        rates = [s.source.rates() for s in self.streams]
        self._seed()
        return self.policy.choose(len(self.streams), rates, caps)

    def _batch_corrections(self):
        """The model's round-time corrections (``round_costs``) where they
        apply to the batch's rounds (every stream at a short context), and
        the batch's source: the keys (``Drafter.key``) of the drafters its
        streams draft from; (None, None) where none applies or none drafts."""
        fix = round_costs.of(self.model)
        if fix is None or any(
            timing.context_bucket(len(s.history)) is not None for s in self.streams
        ):
            return None, None
        keys = {d.name: d.key for d in self.model.drafters}
        found = {keys[n] for s in self.streams for n in s.source.drafters if n in keys}
        if not found:
            return None, None
        return fix, "+".join(sorted(found))

    def _seed(self) -> None:
        """A batch size this process's policy has not measured yet starts from
        what earlier rounds of the same sources measured, stored
        (``RoundCosts.batch_seed``): once per batch source and size."""
        fix, key = self._batch_corrections()
        n = len(self.streams)
        if fix is None or (key, n) in self.policy.seeded:
            return
        self.policy.seeded.add((key, n))
        plain = self.policy.samples.get(n, {}).get(0, ())
        unit = statistics.median(plain) if len(plain) >= TIMED_MIN else None
        times = fix.batch_seed(key, n, unit)
        if times is not None:
            self.policy.seed(n, times)

    def _may_run_ahead(self) -> bool:
        """Whether a round without drafts may start the next before its tokens
        are read: caches whose extra token can be taken back (batched
        attention caches by length, a stream's own caches from a snapshot),
        samplers that take lazy tokens, and no rank to agree with first."""
        return (
            (self._attention() or not self.batched)
            and self.agree is None
            and all(hasattr(s.verifier, "sample") for s in self.streams)
        )

    def _exact_chunks(self) -> bool:
        """Whether the trunk's batch caches read each stream's prompt in the
        chunks it reads alone, right-padded to the longest and the padding
        rolled back as after a verify pass (``exact_chunks``: their numbers
        depend on where a chunk ends, as DeepSeek-V4's compressor pools a
        group with the one before it within a chunk)."""
        return self.batched and any(getattr(c, "exact_chunks", False) for c in self._trunk)

    def _attention(self) -> bool:
        """Whether every trunk cache is a batched attention cache, which takes
        tokens back by length alone (padding, a token read ahead)."""
        return self.batched and all(isinstance(c, RaggedKVCache) for c in self._trunk)

    def _plain(
        self, tic: float, start_next: bool = True, cold: bool = False
    ) -> List[List[int]]:
        """Read the round under way (``self.ahead``); first, where the next
        round drafts nothing either, start it on this round's lazy tokens.

        The round's time is the policy's sample of ``K = 0`` unless it is
        ``cold`` (it did not run on from a round before it) and leads a run:
        a plain round, once chosen, costs what the rounds of a run cost."""
        model, streams = self.model, self.streams
        now, self.ahead = self.ahead, None
        caps = [self.cap(s) for s in streams]
        if (
            start_next
            and self._may_run_ahead()
            and any(s.remaining > 1 for s in streams)
        ):
            self.next_k = self._choose(caps)
            # with others in the batch a proposal rides only within K (``_plan``)
            if self.next_k == 0 and (
                len(streams) > 1
                or not streams[0].source.may_propose_after(
                    streams[0].history, self.wait_cost()
                )
            ):
                undo = None
                if not self.batched:
                    undo = streams[0].cache.snapshot(trunk_only=True)
                if self.batched or undo is not None:
                    self.next_k = None
                    pending = [[now.tokens[b : b + 1]] for b in range(len(streams))]
                    self.ahead = _Ahead(
                        model, self.trunk, streams, now.tokens, pending, undo
                    )
        # the round's one host sync: this round's tokens (the next computes)
        emitted = [[t] for t in now.read()]
        n = len(streams)
        kept = rounds.settle(
            model, self, streams, [[]] * n, None, emitted, now.logits, now.taps
        )
        if self.policy is not None:  # undrafted depths drift back up
            for s, cap in zip(streams, caps):
                for name in s.source.drafters if cap else ():
                    s.source.update(name, 0, 0)
        seconds = time.perf_counter() - tic
        # (``add`` reads a round's end alone: no sample)
        if self.policy is not None and start_next and not (cold and self.ahead):
            self.policy.record(n, 0, seconds)
            fix, _ = self._batch_corrections()
            if fix is not None and not cold:
                fix.record_batch_plain(n, seconds)
        if start_next and n == 1:
            self.plain_seconds[cold].append(seconds)
            fix = self._corrections(streams[0])
            if fix is not None and not cold:
                fix.record_plain(seconds)
        for s in streams:
            s.stats.generation_time += seconds
        return [e[:m] for e, m in zip(emitted, kept)]
