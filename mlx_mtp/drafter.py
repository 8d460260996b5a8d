"""Drafters: the models that propose a round's drafts for the target.

A drafter is a second model beside the target (the *trunk*). It declares what
it reads of each target forward (``Reads``: the final hidden state, the
outputs of chosen decoder layers, or the target's keys and values), keeps a
``DraftState`` per stream (its own caches, made, rolled back, batched and
copied with the target's, and the target features it has not read yet), and
in a round proposes up to ``k`` tokens, each a ``sampling.Draft`` carrying the
logits it was drawn from (the verifier stays exact at temperature > 0 with
them). The round (``rounds.py``) asks drafters and never names a kind.

What every drafter shares is written here once:

- the target's features reach a stream's state as the round keeps tokens
  (``observe``): feature ``i`` waits in ``pending[0]`` with its successor
  token ``t_{i+1}``, which the next token read completes; a drafter reads
  them when it next drafts (``propose``), or when too many wait
  (``catch_up``, every ``PENDING_LIMIT``);
- what a proposal wrote to the drafter's caches is rolled back by the round
  (``tentative`` entries per layer);
- a drafter of several chained layers (an MTP head of three, EAGLE-style
  chains) keeps one pending queue per layer; ``start[j]`` is the position of
  layer ``j``'s first cache entry.

A drafter kind subclasses ``Drafter`` and implements ``propose`` and
``catch_up`` (``drafters/head.py``: the MTP heads and the Gemma 4 assistant).
Drafters from a checkpoint of their own are found by their config
(``drafters/__init__.py``).
"""

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

import mlx.core as mx

from .cache import DraftState
from .target import Taps

# A drafter layer that has not read for this many positions (rounds without
# drafts, or deeper than the drafts asked for, a prompt's features) catches up,
# so what waits for it stays small. Below it, what waits is read when the
# drafter is next asked (``propose``): a drafter whose drafts stop paying reads
# nothing until its next probe round (``adaptive.MAX_PROBE_GAP`` rounds at
# most, below this), and nothing at all where the generation ends first; one
# given up reads nothing more.
PENDING_LIMIT = 256

# (features [1, L, F], L successor tokens) of one stream, or nothing
Item = Optional[Tuple[mx.array, Any]]


@dataclass(frozen=True)
class Reads:
    """What a drafter reads of each target forward.

    ``hidden``: the trunk's final hidden state (the tap at its final norm);
    ``layers``: the outputs of these decoder layers (0-based), concatenated
    on the feature axis in this order (a layer's output is what it hands the
    next layer); ``kv``: the target's caches themselves (linked to the
    drafter's state: a Gemma 4 assistant reads the target's keys and values).
    """

    hidden: bool = True
    layers: Tuple[int, ...] = ()
    kv: bool = False

    def features(self, taps: Taps) -> mx.array:
        """``[B, T, F]``: what this drafter reads of one forward."""
        if self.layers:
            # a layer handing on more than one vector per position (DeepSeek-V4.1's
            # hyper-connection streams) is read flattened
            parts = [taps.layers[i] for i in self.layers]
            parts = [x.reshape(*x.shape[:2], -1) for x in parts]
            return mx.concatenate(parts, axis=-1) if len(parts) > 1 else parts[0]
        return taps.hidden


class DraftView:
    """How a round reaches a drafter's caches for the streams of the round
    (``decoder.Decoder``: a stream's own caches, or the batch's, where each
    call's rows are padded to one length)."""

    def caches(self, drafter: "Drafter") -> List[Any]:
        """The drafter's caches, every stream of the round in them."""
        raise NotImplementedError

    def rollback(self, caches: List[Any], counts: List[int]) -> None:
        """Drop each stream's last ``counts[b]`` positions from ``caches``."""
        raise NotImplementedError

    def ragged(
        self, call, items: Sequence[Item], caches: List[Any]
    ) -> Tuple[List, List]:
        """``call(features [B, L, F], tokens [B, L], caches) -> (states, outs)``
        over each stream's item (None: the stream takes no part), rows
        right-padded to one length (the padding rolled back after; padded
        before the inputs where every one of ``caches`` holds nothing per
        position and says so, ``pads_left``: a Gemma 4 assistant). Returns,
        per stream, ``states`` at its last input (``[1, 1, D]``) and ``outs``
        at its inputs (``[1, L_b, D]``), None for a stream with no item.
        ``states`` may hold fewer positions than the inputs (the last ones)."""
        raise NotImplementedError


class Drafter:
    """A model that proposes drafts for the target: the interface the round uses.

    Subclasses set ``name`` (the tag of their drafts and their row in the
    stats and costs), ``reads``, and implement ``make_caches``, ``propose``
    and ``catch_up``; a chain of several layers sets ``num_layers`` and
    ``layer_cache``.
    """

    name = "mtp"
    reads = Reads()
    # the most drafts one proposal may hold
    max_drafts = 16
    # how the cost of ``k`` drafts grows, before ``tune`` measures it: a
    # chain pays per draft, a block drafter once per block (see ``prior_cost``)
    flat_cost = False
    # the widths of the keys and values its own attention caches hold (empty:
    # those of the target's layers), which a quantized cache's groups must fit
    kv_widths: Tuple[int, ...] = ()
    # whether its own caches may be bounded (``max_kv_size``): a drafter whose
    # masks place every context position in its cache cannot
    boundable = True
    # a digest of the checkpoint it was loaded from (set by the registry)
    checkpoint: Optional[str] = None
    # whether it reads the target's features at the last input of a call
    # alone, keeping nothing per position (a Gemma 4 assistant): a prompt's
    # features are then not computed for it (``Decoder.prefill``), and its
    # stream's first round, which reads the prompt's last token, drafts
    # nothing (``Stream.blind``)
    reads_last = False

    @property
    def key(self) -> str:
        """What its measured costs are stored under (``probe``): its name,
        and for a checkpoint of its own that checkpoint's digest, so another
        checkpoint of the same kind is measured anew."""
        return f"{self.name}:{self.checkpoint}" if self.checkpoint else self.name

    @property
    def num_layers(self) -> int:
        return 1

    def make_caches(self) -> List[Any]:
        """Fresh caches for one stream (flat, in layer order)."""
        raise NotImplementedError

    def layer_cache(self, caches: List[Any], j: int) -> List[Any]:
        """Layer ``j``'s part of the flat cache list."""
        return caches

    def make_state(self, at: int = 0) -> DraftState:
        return DraftState.fresh(self.make_caches(), self.num_layers, at)

    def prior_cost(self, k: int, step: float = 0.08) -> float:
        """The cost of ``k`` drafts in plain steps, before it is measured:
        ``step`` per draft for a chain, once for a block drafter."""
        if k == 0:
            return 0.0
        return step if self.flat_cost else step * k

    def features(self, taps: Taps) -> mx.array:
        return self.reads.features(taps)

    # -- the round -------------------------------------------------------------

    def catch_up(self, view: DraftView, streams: Sequence[Any]) -> None:
        """Every stream's state reads every complete pending pair."""
        raise NotImplementedError

    def propose(
        self, view: DraftView, streams: Sequence[Any], ks: Sequence[int], p_min: float
    ) -> Tuple[List[List[Any]], List[List[int]]]:
        """Up to ``ks[b]`` drafts for stream ``b`` (0: it takes no part), each a
        ``sampling.Draft`` from the stream's verifier (``verifier.draft``),
        after the stream's ``history`` (its last token not yet read by the
        trunk). A chain may stop early where a draft's probability falls
        below ``p_min``. Returns the drafts and, per stream and layer, the
        entries the proposal wrote to the caches (the round rolls them back)."""
        raise NotImplementedError

    # -- what the round does for every drafter -----------------------------------

    def state(self, stream) -> DraftState:
        return stream.cache.drafts[self.name]

    def observe(self, stream, features: mx.array, read: List[int]) -> None:
        """Stream ``stream`` kept tokens: ``features`` (``[1, m, F]``) are the
        target's at the ``m`` tokens it read, ``read``."""
        self.state(stream).pending[0].push(features, read)

    def forget(self, stream) -> None:
        """Drop what waits for ``stream``'s state: it no longer reads along
        (its source gave this drafter up), so it would never be read. (A
        state that does not follow the trunk starts afresh: ``follow``.)"""
        state = stream.cache.drafts.get(self.name)
        if state is not None and any(q.size for q in state.pending):
            for q in state.pending:
                q.hidden, q.tokens = None, []

    def overdue(self, streams: Sequence[Any]) -> bool:
        """Whether some layer of some stream holds more than ``PENDING_LIMIT``
        features it has not read."""
        return any(
            q.size > PENDING_LIMIT for s in streams for q in self.state(s).pending
        )

    def undo(self, view: DraftView, tentative: List[List[int]]) -> None:
        """Roll back the entries a proposal wrote (``tentative[b][j]``)."""
        caches = view.caches(self)
        for j in range(self.num_layers):
            counts = [t[j] for t in tentative]
            if any(counts):
                view.rollback(self.layer_cache(caches, j), counts)

    def follow(self, cache) -> None:
        """Before a generation that drafts with this drafter on ``cache``: a
        state that did not follow the trunk (a generation before did not
        draft with it, or mlx-lm's functions advanced the trunk) starts afresh
        where the trunk stands."""
        state = cache.drafts[self.name]
        if not state.follows(self.layer_cache(state.caches, 0), cache.offset):
            state.restart(self.make_caches(), cache.offset)
            cache.link()
