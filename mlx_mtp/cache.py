"""Cache rollback for speculative decoding, and the prompt cache of an MTP model.

The loop never touches cache arrays. It brackets each verify pass with
``start_verify(caches)`` and ``rollback(caches, n)``:

- attention caches (mlx-lm's ``KVCache`` and friends) ignore ``start_verify``
  and roll back with their own ``trim(n)``;
- a cache that must do more (a gated-delta-net state that keeps per-token
  intermediates during a verify pass) implements ``start_verify()`` and
  ``rollback(n)`` itself. ``rollback`` is called after every verify pass, with
  ``n == 0`` too, so such a cache can release what it kept.
"""

import copy
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache

from .kv import QuantizingKVCache, RollingKVCache, cuttable


def can_rollback(caches: List[Any]) -> bool:
    """Whether every cache in ``caches`` can always drop its last tokens.

    A sliding-window ``RotatingKVCache`` (mlx-lm's or mlx-vlm's) cannot,
    though a fresh one says it can: ``is_trimmable`` holds only until it
    wraps, and past that its ``trim`` leaves the dropped keys in its buffer,
    where the next one-token step attends to them (``rollback_caches`` gives
    such layers a plain cache)."""
    return all(
        hasattr(c, "rollback") or (not _wraps(c) and c.is_trimmable()) for c in caches
    )


def _wraps(c: Any) -> bool:
    """Whether ``c`` is a ``RotatingKVCache`` (by class name: mlx-vlm has its
    own, which this module does not import), which cannot trim once wrapped."""
    return any(k.__name__ == "RotatingKVCache" for k in type(c).__mro__)


def start_verify(caches: List[Any]) -> None:
    for c in caches:
        if hasattr(c, "start_verify"):
            c.start_verify()


def rollback(caches: List[Any], n: int) -> None:
    """Drop the last ``n`` tokens from every cache (``n`` may be 0)."""
    for c in caches:
        if hasattr(c, "rollback"):
            c.rollback(n)
        elif n > 0:
            trimmed = c.trim(n)
            if trimmed != n:
                raise RuntimeError(f"{type(c).__name__} trimmed {trimmed} of {n}")


def cache_offset(cache: Any) -> Optional[int]:
    """Tokens ``cache`` holds, or None when it does not count them (a recurrent state).

    A cache made of caches (mlx-lm's ``CacheList``: an MLA layer's latent and
    indexer keys) reports the first of its members that counts.
    """
    if hasattr(cache, "offset"):
        return int(cache.offset)
    for c in getattr(cache, "caches", ()):
        if (n := cache_offset(c)) is not None:
            return n
    return None


def _mark(c) -> Optional[tuple]:
    """What bringing cache ``c`` back to this point takes; None when it cannot be.

    An attention cache is cut back to its offset (later calls only write past
    it). mlx-lm's recurrent ``ArraysCache`` replaces its arrays on every update
    and never writes into them, so keeping the arrays is a snapshot; a cache
    that knows its own snapshot has ``mark`` and ``restore``.
    """
    if hasattr(c, "mark"):
        return ("own", c.mark())
    if not hasattr(c, "rollback") and c.is_trimmable():
        return ("offset", cache_offset(c))
    if isinstance(c, ArraysCache):
        return ("arrays", list(c.cache))
    return None


def _restore(c, mark: tuple) -> None:
    """Bring cache ``c`` back to where ``_mark(c)`` was taken."""
    kind, value = mark
    if kind == "own":
        c.restore(value)
        return
    if kind == "offset":
        rollback([c], cache_offset(c) - value)
        return
    if hasattr(c, "rollback"):
        c.rollback(0)  # forget what an unfinished verify pass kept
    c.cache = list(value)


def cache_length(caches: List[Any]) -> int:
    """Tokens held by the first cache that counts them (0 when none does)."""
    for c in caches:
        if (n := cache_offset(c)) is not None:
            return n
    return 0


class Pending:
    """What one head layer has not read yet: its inputs and their successor tokens.

    A head layer at chain position ``i`` reads an input hidden state with the
    token ``t_{i+1}``; the token for the last input is not known yet, so
    ``tokens`` holds one fewer than ``hidden`` (none when ``hidden`` is None).
    Inputs pushed one round at a time are kept as parts and joined once, when
    read: a drafter that reads late (``drafter.PENDING_LIMIT``) copies its
    queue once, not once per round.
    """

    def __init__(self, hidden: Optional[mx.array] = None, tokens=()):
        self._parts: List[mx.array] = [] if hidden is None else [hidden]
        self.tokens: List[int] = list(tokens)  # m - 1

    @property
    def hidden(self) -> Optional[mx.array]:
        """``[B, m, D]``, or None when nothing waits."""
        if len(self._parts) > 1:
            self._parts = [mx.concatenate(self._parts, axis=1)]
        return self._parts[0] if self._parts else None

    @hidden.setter
    def hidden(self, value: Optional[mx.array]) -> None:
        self._parts = [] if value is None else [value]

    @property
    def size(self) -> int:
        return sum(p.shape[1] for p in self._parts)

    def push(self, hidden: mx.array, read: List[int]) -> None:
        """Queue inputs made while reading ``read``, the successors of the inputs before.

        Each token read completes the previous input (the first completes the
        last one queued); the last new input stays incomplete.
        """
        if not self._parts:
            self._parts, self.tokens = [hidden], list(read[1:])
        else:
            self._parts.append(hidden)
            self.tokens.extend(read)

    def keep_first(self, n: int) -> None:
        """Keep the first ``n`` inputs (and their known successors)."""
        if n <= 0:
            self.hidden, self.tokens = None, []
        else:
            self.hidden, self.tokens = self.hidden[:, :n], self.tokens[: n - 1]

    def drop_first(self, n: int) -> None:
        """Forget the first ``n`` inputs (read by the layer)."""
        rest = self.hidden[:, n:]
        self.hidden = rest if rest.shape[1] else None
        self.tokens = self.tokens[n:]

    def copy(self) -> "Pending":
        return Pending(self.hidden, list(self.tokens))


@dataclass
class DraftState:
    """One stream's part of a drafter (``drafter.Drafter``): its caches (flat,
    in the drafter's layer order), what each layer has not read yet, and
    where each layer's first cache entry sits (``start[j]``; ``j`` for a
    fresh state: layer ``j`` reads layer ``j - 1``'s output at the position
    before)."""

    caches: List[Any]
    pending: List[Pending]
    start: List[int]

    @classmethod
    def fresh(cls, caches: List[Any], layers: int, at: int = 0) -> "DraftState":
        pending = [Pending() for _ in range(layers)]
        return cls(caches, pending, list(range(at, at + layers)))

    def copy(self, copy_layer: Callable[[Any], Any] = lambda c: c) -> "DraftState":
        return DraftState(
            [copy_layer(c) for c in self.caches],
            [p.copy() for p in self.pending],
            list(self.start),
        )

    @property
    def nbytes(self) -> int:
        total = sum(getattr(c, "nbytes", 0) for c in self.caches)
        return total + sum(q.hidden.nbytes for q in self.pending if q.size)

    def follows(self, layer0: List[Any], trunk_offset: int) -> bool:
        """Whether layer 0 has read, or holds pending, every feature the
        trunk has made (a state whose caches do not count positions: True)."""
        if all(cache_offset(c) is None for c in layer0):
            return True
        read = self.start[0] + cache_length(layer0)
        return read + self.pending[0].size == trunk_offset

    def restart(self, caches: List[Any], at: int) -> None:
        """Start afresh at trunk position ``at`` on new ``caches``: drafts
        lose the context before; the output does not change."""
        self.caches = caches
        self.pending = [Pending() for _ in self.pending]
        self.start = [at + j for j in range(len(self.pending))]

    def cut(self, keep: int, layer_cache: Callable[..., List[Any]]) -> int:
        """Cut back to a trunk that keeps its first ``keep`` tokens; returns
        the trunk length this state then fits (``keep``, or one less: see
        ``StreamCache.truncate``). ``layer_cache`` is the drafter's."""
        first, layer0 = self.pending[0], layer_cache(self.caches, 0)
        n0 = cache_length(layer0)
        read = self.start[0] + n0  # the position past layer 0's last
        fresh = False
        if first.hidden is not None and keep > read:
            first.keep_first(keep - read)
            last = read - 1  # layer 0's last position
        elif self.start[0] < keep <= read + 1:
            keep -= 1
            rollback(layer0, read - keep)
            self.pending[0] = Pending()
            last = keep - 1
        else:  # cut below layer 0's first position, or past what it can read
            rollback(layer0, n0)
            self.pending[0] = Pending()
            self.start[0], last, fresh = keep, keep - 1, True
        for j in range(1, len(self.pending)):
            caches, queue = layer_cache(self.caches, j), self.pending[j]
            n = cache_length(caches)
            end = self.start[j] + n - 1  # last position read
            # exact while this layer's inputs still hold layer j-1's output at
            # ``last``: it reads it at ``last + 1``
            if not fresh and end <= last and end + queue.size >= last + 1:
                queue.keep_first(last + 1 - end)
                last = end
                continue
            fresh = True
            rollback(caches, n)
            self.pending[j] = Pending()
            # it next reads layer j-1's first new output, at that output's
            # position + 1 (the output at ``last`` is gone)
            self.start[j] = last + 2
            last = self.start[j] - 1
        return keep


@dataclass
class Snapshot:
    """Where an ``StreamCache`` stood (``StreamCache.snapshot``): each cache's mark,
    and (unless only the trunk was taken) each drafter's pending and starts."""

    marks: List[tuple]
    drafts: Optional[Dict[str, DraftState]] = None


def copy_layer(c: Any) -> Any:
    """A copy of one layer's cache that can be written to without touching ``c``."""
    if isinstance(c, (QuantizingKVCache, RollingKVCache)):
        return c.copy()
    if type(c) is KVCache:
        new = KVCache()
        if c.keys is not None:
            new.keys, new.values = mx.array(c.keys), mx.array(c.values)
        new.offset = c.offset
        return new
    if isinstance(c, ArraysCache):  # its arrays are replaced, never written into
        new = copy.copy(c)
        new.cache = list(c.cache)
        return new
    return copy.deepcopy(c)


MTP = "mtp"  # the name of the model's own head among its drafters


@dataclass
class StreamCache:
    """Everything a generation leaves behind, so that a later call can continue.

    ``trunk`` is the main model's per-layer caches; ``drafts`` each drafter's
    part (``DraftState``), by the drafter's name. The model's own MTP head is
    the drafter ``"mtp"``; ``head``, ``pending`` and ``start`` are its state.
    The head lags the trunk: layer 0 pairs the trunk's hidden state ``h_i``
    with the NEXT token ``t_{i+1}``, so the trunk's last hidden states wait in
    ``pending[0]`` until their successors are known. Head layer ``j > 0`` reads,
    at chain position ``i``, layer ``j - 1``'s output at ``i - 1`` with
    ``t_{i+1}``; its inputs wait in ``pending[j]``. ``start[j]`` is the chain
    position of layer ``j``'s first cache entry (``j`` for a fresh cache).

    To mlx-lm it is the list of the trunk's caches (``len``, iteration,
    indexing): mlx-lm's ``make_prompt_cache(model)`` returns ``model.make_cache()``
    and its ``generate_step`` and ``BatchGenerator`` read and replace the
    layers' caches by index. The drafters' part is mlx-mtp's alone: a cache
    that mlx-lm's functions advanced has drafters that did not follow; they
    start afresh where the trunk stands when they next draft.
    """

    trunk: List[Any]
    drafts: Dict[str, DraftState] = field(default_factory=dict)

    def __post_init__(self):
        self.link()

    def link(self) -> None:
        """A drafter that reads the trunk's caches (a Gemma 4 assistant) gets them."""
        for state in self.drafts.values():
            for c in state.caches:
                if hasattr(c, "link"):
                    c.link(self.trunk)

    def __len__(self) -> int:
        return len(self.trunk)

    def __iter__(self):
        return iter(self.trunk)

    def __getitem__(self, i):
        return self.trunk[i]

    def __setitem__(self, i, value) -> None:
        self.trunk[i] = value

    @property
    def offset(self) -> int:
        """Tokens the trunk has processed."""
        return cache_length(self.trunk)

    # -- the model's own head (the drafter "mtp") ---------------------------------

    @property
    def head(self) -> List[Any]:
        return self.drafts[MTP].caches if MTP in self.drafts else []

    @head.setter
    def head(self, caches: List[Any]) -> None:
        self.drafts[MTP].caches = caches

    @property
    def pending(self) -> List[Pending]:
        return self.drafts[MTP].pending if MTP in self.drafts else [Pending()]

    @property
    def start(self) -> List[int]:
        return self.drafts[MTP].start if MTP in self.drafts else [0]

    # -- every part ----------------------------------------------------------------

    def state_list(self) -> List[Any]:
        return self.trunk + [c for s in self.drafts.values() for c in s.caches]

    @property
    def nbytes(self) -> int:
        trunk = sum(getattr(c, "nbytes", 0) for c in self.trunk)
        return trunk + sum(s.nbytes for s in self.drafts.values())

    def copy(self) -> "StreamCache":
        """A copy that can be written to without touching this cache."""
        return StreamCache(
            trunk=[copy_layer(c) for c in self.trunk],
            drafts={n: s.copy(copy_layer) for n, s in self.drafts.items()},
        )

    def truncate(self, keep: int, drafters: Sequence[Any]) -> int:
        """Cut back so the trunk holds at most its first ``keep`` tokens.

        ``drafters`` are the model's (their ``layer_cache``). Entries that
        read tokens past ``keep`` go. A drafter's layer 0 cut inside its
        pending features just drops some; cut below what it has read, it
        would need the trunk's feature at the cut, which is gone, so one more
        token is dropped and layer 0 and the trunk stop at the same position
        with nothing pending (as a drafter that has read every pair it can).
        A layer ``j > 0`` stays exact when its pending inputs still hold layer
        ``j - 1``'s output at that layer's new last position; otherwise it (and
        every layer above it) starts afresh there: its drafts lose context,
        the output does not change. A second drafter that cannot follow the
        first's cut starts afresh at it. Returns how many tokens the trunk
        still holds.
        """
        trunk_n = self.offset
        if keep >= trunk_n:
            return trunk_n
        cut, first = keep, True
        for d in drafters:
            state = self.drafts.get(d.name)
            if state is None or (
                state.pending[0].hidden is None and cache_length(state.caches) == 0
            ):
                continue  # it never read anything: it follows when it drafts
            if first:
                cut, first = state.cut(keep, d.layer_cache), False
            elif state.cut(cut, d.layer_cache) != cut:
                state.restart(d.make_caches(), cut)
        rollback(self.trunk, trunk_n - cut)
        self.link()
        return cut

    def snapshot(self, trunk_only: bool = False) -> Optional[Snapshot]:
        """What bringing this cache back to now takes (the trunk's caches alone
        with ``trunk_only``), or None when one of its caches cannot be brought
        back. Cheap: attention caches are cut back to their offset (later
        calls only write past it) and recurrent caches replace their arrays on
        every update, so keeping the arrays is a copy."""
        marks = [_mark(c) for c in (self.trunk if trunk_only else self.state_list())]
        if not all(marks):
            return None
        if trunk_only:
            return Snapshot(marks)
        return Snapshot(marks, {n: s.copy() for n, s in self.drafts.items()})

    def restore(self, snapshot: Snapshot) -> None:
        """Bring this cache back to where ``snapshot`` was taken (it stays usable)."""
        caches = self.trunk if snapshot.drafts is None else self.state_list()
        for c, m in zip(caches, snapshot.marks):
            _restore(c, m)
        if snapshot.drafts is not None:
            for name, saved in snapshot.drafts.items():
                state = self.drafts[name]
                state.pending = [p.copy() for p in saved.pending]
                state.start = list(saved.start)



# the name it had: what ``make_cache`` returned before it held every drafter's
# state, kept for code written against it
MTPCache = StreamCache

def truncatable(cache: StreamCache) -> bool:
    """Plain attention caches can be cut anywhere; recurrent states, and
    bounded caches past their bound, cannot."""
    return all(
        not hasattr(c, "rollback") and c.is_trimmable() and cuttable(c)
        for c in cache.state_list()
    )


def truncate(model, cache: StreamCache, keep: int) -> int:
    """Cut ``cache`` back so the trunk holds at most its first ``keep`` tokens.

    See ``StreamCache.truncate``; returns how many tokens the trunk still holds.
    """
    return cache.truncate(keep, model.drafters)
