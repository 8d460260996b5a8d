"""Caches that hold several streams, each at its own position.

mlx-lm's ``BatchKVCache`` left-pads its streams so that they all write at one
index. After a verify pass each stream keeps its own number of tokens, so a
common write index would leave holes in every stream but the longest. Here
each stream writes at its own length instead (``RaggedKVCache``):

- ``offset`` is the per-stream position array that mlx-lm's attention layers
  hand to RoPE (``mx.fast.rope`` takes one offset per sequence);
- ``make_mask`` gives each stream its causal mask over the shared buffer, so
  mlx-lm's model classes run unchanged;
- rolling a stream back lowers its length: the entries past it are masked and
  overwritten by its next write. No holes, no compaction.

``BatchStatesCache`` holds a recurrent layer's ``KeepStatesCache`` (gated
delta net, Mamba2, ...) for every stream, with a per-stream rollback: each
stream picks the window and state after its own last kept token.

Both build from, and give back, the single-stream caches (``merge``,
``extract``), and drop or add streams between rounds (``filter``, ``extend``).
"""

from typing import Any, List, Optional, Sequence, Union

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, create_attention_mask

from .recurrent.keep_states import KeepStatesCache

Counts = Union[int, Sequence[int]]


def _per_stream(n: Counts, size: int) -> List[int]:
    return [n] * size if isinstance(n, int) else [int(x) for x in n]


_POSITIONS: dict = {}


def _positions(lengths: tuple, T: int) -> mx.array:
    """``[B, 1, T, 1]``: stream ``b``'s next ``T`` positions (``T`` 0: ``[B]``,
    where each stream's next token goes). Every layer of a
    forward asks with the same lengths: built once, then shared (arrays are
    immutable)."""
    key = (lengths, T)
    at = _POSITIONS.get(key)
    if at is None:
        if len(_POSITIONS) > 16:
            _POSITIONS.clear()
        if T == 0:
            at = _POSITIONS[key] = mx.array(lengths, dtype=mx.int32)
            return at
        at = np.add.outer(np.array(lengths, np.int32), np.arange(T, dtype=np.int32))
        # a constant, not an op: no stream's queue to wait on, any thread's
        at = _POSITIONS[key] = mx.array(at[:, None, :, None])
    return at


class RaggedKVCache:
    """Keys and values of ``B`` streams, stream ``b`` holding ``lengths[b]`` tokens."""

    step = 256

    def __init__(self, lengths: Sequence[int] = ()):
        self.keys: Optional[mx.array] = None  # [B, H, capacity, D]
        self.values: Optional[mx.array] = None
        self.lengths: List[int] = list(lengths)

    @property
    def offset(self) -> Union[int, mx.array]:
        """Where each stream's next token goes (an int when they all agree)."""
        if len(set(self.lengths)) <= 1:
            return self.lengths[0] if self.lengths else 0
        return _positions(tuple(self.lengths), 0)

    def _grow(self, keys: mx.array, values: mx.array, end: int) -> None:
        if self.keys is not None and end <= self.keys.shape[2]:
            return
        B, H, _, Dk = keys.shape
        size = -(-end // self.step) * self.step
        new_k = mx.zeros((B, H, size, Dk), keys.dtype)
        new_v = mx.zeros((B, H, size, values.shape[3]), values.dtype)
        if self.keys is not None:
            used = max(self.lengths)
            new_k[..., :used, :] = self.keys[..., :used, :]
            new_v[..., :used, :] = self.values[..., :used, :]
        self.keys, self.values = new_k, new_v

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        T = keys.shape[2]
        start = self.lengths
        end = max(start) + T
        self._grow(keys, values, end)
        if len(set(start)) == 1:
            s = start[0]
            self.keys[..., s : s + T, :] = keys
            self.values[..., s : s + T, :] = values
        else:  # one scatter for all streams (a slice per stream is B ops a layer)
            at = _positions(tuple(start), T)
            self.keys = mx.put_along_axis(self.keys, at, keys, axis=2)
            self.values = mx.put_along_axis(self.values, at, values, axis=2)
        self.lengths = [s + T for s in start]
        return self.keys[..., :end, :], self.values[..., :end, :]

    def make_mask(self, N: int, return_array: bool = False, window_size=None, **kwargs):
        """Query ``t`` of stream ``b`` (at ``lengths[b] + t``) sees the keys to it."""
        if len(set(self.lengths)) == 1:  # one causal mask fits all: mlx-lm's own
            return create_attention_mask(N, self.lengths[0], return_array, window_size)
        queries = mx.array(self.lengths)[:, None] + mx.arange(N)
        keys = mx.arange(max(self.lengths) + N)
        mask = keys <= queries[..., None]
        if window_size is not None:
            mask = mask & (keys > queries[..., None] - window_size)
        return mask[:, None]  # [B, 1, N, keys]

    def rollback(self, n: Counts) -> None:
        """Drop the last ``n`` tokens (one count per stream, or one for all)."""
        n = _per_stream(n, len(self.lengths))
        self.lengths = [length - k for length, k in zip(self.lengths, n)]
        if min(self.lengths) < 0:
            raise ValueError("rolled back past the start of a stream")

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        self.rollback(n)
        return n

    @property
    def state(self):
        return [] if self.keys is None else [self.keys, self.values]

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes

    # -- streams joining and leaving ---------------------------------------------

    @classmethod
    def merge(cls, caches: Sequence[KVCache]) -> "RaggedKVCache":
        """One batch cache holding the tokens of single-stream ``caches``."""
        out = cls([c.offset for c in caches])
        first = next((c for c in caches if c.keys is not None), None)
        if first is None:
            return out
        B, used = len(caches), max(out.lengths)
        size = -(-used // cls.step) * cls.step
        _, H, _, Dk = first.keys.shape
        out.keys = mx.zeros((B, H, size, Dk), first.keys.dtype)
        out.values = mx.zeros((B, H, size, first.values.shape[3]), first.values.dtype)
        for b, c in enumerate(caches):
            if c.offset:
                out.keys[b : b + 1, :, : c.offset] = c.keys[..., : c.offset, :]
                out.values[b : b + 1, :, : c.offset] = c.values[..., : c.offset, :]
        return out

    def extend(self, other: "RaggedKVCache") -> None:
        """Append ``other``'s streams."""
        like = self if self.keys is not None else other
        if like.keys is not None:
            size = max(c.keys.shape[2] for c in (self, other) if c.keys is not None)
            keys, values = [], []
            for c in (self, other):
                if c.keys is None:
                    B, (_, H, _, Dk), Dv = (
                        len(c.lengths),
                        like.keys.shape,
                        like.values.shape[3],
                    )
                    keys.append(mx.zeros((B, H, size, Dk), like.keys.dtype))
                    values.append(mx.zeros((B, H, size, Dv), like.values.dtype))
                else:
                    keys.append(_pad_to(c.keys, size))
                    values.append(_pad_to(c.values, size))
            self.keys, self.values = mx.concatenate(keys), mx.concatenate(values)
        self.lengths = self.lengths + other.lengths

    def filter(self, keep: Sequence[int]) -> None:
        """Keep the streams at indices ``keep``, in that order."""
        self.lengths = [self.lengths[i] for i in keep]
        if self.keys is not None:
            if not keep:
                self.keys = self.values = None
                return
            idx = mx.array(list(keep))
            used = max(max(self.lengths), 1)
            size = -(-used // self.step) * self.step
            self.keys = self.keys[idx, :, :size]
            self.values = self.values[idx, :, :size]

    def extract(self, b: int) -> KVCache:
        """Stream ``b`` as a single-stream ``KVCache`` (its own copy)."""
        c = KVCache()
        n = self.lengths[b]
        if self.keys is not None and n:
            c.keys = mx.contiguous(self.keys[b : b + 1, :, :n])
            c.values = mx.contiguous(self.values[b : b + 1, :, :n])
            c.offset = n
        return c


def _pad_to(x: mx.array, size: int) -> mx.array:
    if x.shape[2] == size:
        return x
    pad = [(0, 0), (0, 0), (0, size - x.shape[2]), (0, 0)]
    return mx.pad(x, pad)


class BatchStatesCache(KeepStatesCache):
    """A recurrent ``KeepStatesCache`` over ``streams`` streams, each rolled back
    by its own count: each slot takes, per stream, its window or state after
    that stream's last kept token.

    A stream that has read nothing yet starts from zeros, as mlx-lm's layers
    do for a missing state.
    """

    def __init__(self, size: int, streams: int = 0):
        super().__init__(size)
        self.streams = streams

    def rollback(self, n: Counts) -> None:
        kept_slots, self._verify = self._verify, None
        n = _per_stream(n, self.streams)
        if not kept_slots or not any(n):
            return
        counts = {seq.shape[1] - window for seq, window in kept_slots.values()}
        verified = counts.pop()
        if counts or max(n) >= verified:
            raise ValueError(f"cannot roll back {max(n)} of {verified} verified tokens")
        kept = mx.array([verified - k for k in n], dtype=mx.int32)
        for slot, (seq, window) in kept_slots.items():
            ones = [1] * (seq.ndim - 2)
            if window:  # stream b's window: the ``window`` inputs before its next
                rows = (kept[:, None] + mx.arange(window)).reshape(-1, window, *ones)
                self[slot] = mx.take_along_axis(seq, rows, axis=1)
            else:  # its state after its last kept token
                rows = (kept - 1).reshape(-1, 1, *ones)
                self[slot] = mx.take_along_axis(seq, rows, axis=1).squeeze(1)

    @classmethod
    def merge(cls, caches: Sequence[Any]) -> "BatchStatesCache":
        out = cls(len(caches[0].cache), len(caches))
        for i in range(len(out.cache)):
            out[i] = _stack([c[i] for c in caches], [1] * len(caches))
        return out

    def extend(self, other: "BatchStatesCache") -> None:
        counts = [self.streams, other.streams]
        self.cache = [_stack([a, b], counts) for a, b in zip(self.cache, other.cache)]
        self.streams += other.streams

    def filter(self, keep: Sequence[int]) -> None:
        idx = mx.array(list(keep), dtype=mx.int32)
        self.cache = [None if c is None or not keep else c[idx] for c in self.cache]
        self.streams = len(keep)

    def extract(self, b: int, like: type) -> KeepStatesCache:
        """Stream ``b`` as a single-stream cache of class ``like``."""
        c = like(len(self.cache))
        c.cache = [
            None if x is None else mx.contiguous(x[b : b + 1]) for x in self.cache
        ]
        return c


def _stack(parts: Sequence[Optional[mx.array]], counts: Sequence[int]):
    """Concatenate along the batch axis; a missing part is ``count`` rows of zeros."""
    like = next((p for p in parts if p is not None), None)
    if like is None:
        return None
    return mx.concatenate(
        [
            mx.zeros((n, *like.shape[1:]), like.dtype) if p is None else p
            for p, n in zip(parts, counts)
        ]
    )


def batchable(caches: Sequence[Any]) -> bool:
    """Whether ``caches`` (one stream's) have batch counterparts here."""
    return all(type(c) is KVCache or isinstance(c, KeepStatesCache) for c in caches)


def merge(caches: Sequence[Any]) -> Any:
    """The batch cache of one layer from each stream's cache of that layer."""
    if type(caches[0]) is KVCache:
        return RaggedKVCache.merge(caches)
    return BatchStatesCache.merge(caches)


def rollback(caches: Sequence[Any], n: Counts) -> None:
    for c in caches:
        c.rollback(n)
