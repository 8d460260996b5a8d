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

``RaggedQuantizedKVCache`` is the ragged cache of quantized keys and values
(``kv.QuantizingKVCache`` once it has turned): the same writes, rollback and
masks, each new position quantized on its own.

``BatchCacheList`` is a layer's caches made of caches (mlx-lm's
``CacheList``: LongCat-Flash's two attentions) over the batch: each member
in its own batch form, all rolled back, filtered and extended together.

All build from, and give back, the single-stream caches (``merge``,
``extract``), and drop or add streams between rounds (``filter``, ``extend``).
A cache of a kind of its own brings its batch form with it (``merge_batch``:
a Gemma 4 assistant's count of positions read,
``heads.gemma4_assistant.BatchSharedKV``; LongCat-Flash-Ngram's layers'
``CacheList``s, ``recurrent.ngram_cache.BatchableCacheList``).
"""

from typing import Any, List, Optional, Sequence, Union

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, create_attention_mask

from .kv import QuantizingKVCache
from .recurrent.keep_states import KeepStatesCache

Counts = Union[int, Sequence[int]]


def per_stream(n: Counts, size: int) -> List[int]:
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
    """Keys and values of ``B`` streams, stream ``b`` holding ``lengths[b]`` tokens.

    Keys and values are each held as a list of arrays ``[B, H, capacity, *]``
    (one array; a quantized cache's three, ``RaggedQuantizedKVCache``);
    ``like`` is the single-stream cache the streams came from (a policy's
    cache of ``kv``, which ``extract`` gives back; None: a ``KVCache``).
    """

    step = 256

    def __init__(self, lengths: Sequence[int] = (), like: Any = None):
        self._k: Optional[List[mx.array]] = None
        self._v: Optional[List[mx.array]] = None
        self.lengths: List[int] = list(lengths)
        self.like = like

    def _encode(self, x: mx.array) -> List[mx.array]:
        """New keys or values ``[B, H, T, D]`` as this cache holds them."""
        return [x]

    @staticmethod
    def _form(parts: List[mx.array]):
        return parts[0] if len(parts) == 1 else tuple(parts)

    @property
    def keys(self):
        return None if self._k is None else self._form(self._k)

    @keys.setter
    def keys(self, x) -> None:
        # (mlx-lm's pipeline sharding ties the last layer's keys to the
        # output: ``cache[-1].keys = mx.depends(cache[-1].keys, h)``)
        self._k = None if x is None else _parts(x)

    @property
    def values(self):
        return None if self._v is None else self._form(self._v)

    @values.setter
    def values(self, x) -> None:
        self._v = None if x is None else _parts(x)

    @property
    def offset(self) -> Union[int, mx.array]:
        """Where each stream's next token goes (an int when they all agree)."""
        if len(set(self.lengths)) <= 1:
            return self.lengths[0] if self.lengths else 0
        return _positions(tuple(self.lengths), 0)

    def _grow(self, keys: List[mx.array], values: List[mx.array], end: int) -> None:
        if self._k is not None and end <= self._k[0].shape[2]:
            return
        size = -(-end // self.step) * self.step

        def fresh(x):
            return mx.zeros((x.shape[0], x.shape[1], size, x.shape[3]), x.dtype)

        new_k, new_v = [fresh(x) for x in keys], [fresh(x) for x in values]
        if self._k is not None:
            used = max(self.lengths)
            for new, old in zip(new_k + new_v, self._k + self._v):
                new[..., :used, :] = old[..., :used, :]
        self._k, self._v = new_k, new_v

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        T = keys.shape[2]
        start = self.lengths
        end = max(start) + T
        keys, values = self._encode(keys), self._encode(values)
        self._grow(keys, values, end)
        if len(set(start)) == 1:
            s = start[0]
            for mine, new in zip(self._k + self._v, keys + values):
                mine[..., s : s + T, :] = new
        else:  # one scatter for all streams (a slice per stream is B ops a layer)
            at = _positions(tuple(start), T)
            put = lambda a, b: mx.put_along_axis(a, at, b, axis=2)  # noqa: E731
            self._k = [put(a, b) for a, b in zip(self._k, keys)]
            self._v = [put(a, b) for a, b in zip(self._v, values)]
        self.lengths = [s + T for s in start]
        k = self._form([x[..., :end, :] for x in self._k])
        return k, self._form([x[..., :end, :] for x in self._v])

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
        n = per_stream(n, len(self.lengths))
        self.lengths = [length - k for length, k in zip(self.lengths, n)]
        if min(self.lengths) < 0:
            raise ValueError("rolled back past the start of a stream")

    def dequantized(self):
        """Keys and values ``[B, H, max(lengths), D]`` in full precision (the
        entries past a stream's length are stale: a reader masks them), for
        a drafter that reads the target's caches (a Gemma 4 assistant)."""
        n = max(self.lengths, default=0)
        if self._k is None:
            return None, None
        return self._full(self._k, n), self._full(self._v, n)

    def _full(self, parts: List[mx.array], n: int) -> mx.array:
        return parts[0][..., :n, :]

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        self.rollback(n)
        return n

    @property
    def state(self):
        return [] if self._k is None else self._k + self._v

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in self.state)

    # -- streams joining and leaving ---------------------------------------------

    @classmethod
    def merge(cls, caches: Sequence[KVCache]) -> "RaggedKVCache":
        """One batch cache holding the tokens of single-stream ``caches``."""
        first = caches[0]
        like = None if type(first) is KVCache else first.blank()
        out = cls([c.offset for c in caches], like)
        held = [c for c in caches if c.keys is not None]
        if not held:
            return out
        B, used = len(caches), max(out.lengths)
        size = -(-used // cls.step) * cls.step
        like_k, like_v = _parts(held[0].keys), _parts(held[0].values)

        def fresh(x):
            return mx.zeros((B, x.shape[1], size, x.shape[3]), x.dtype)

        out._k, out._v = [fresh(x) for x in like_k], [fresh(x) for x in like_v]
        for b, c in enumerate(caches):
            if c.offset:
                n = c.offset
                pairs = zip(out._k + out._v, _parts(c.keys) + _parts(c.values))
                for mine, theirs in pairs:
                    mine[b : b + 1, :, :n] = theirs[..., :n, :]
        return out

    def extend(self, other: "RaggedKVCache") -> None:
        """Append ``other``'s streams."""
        like = self if self._k is not None else other
        if like._k is not None:
            size = max(c._k[0].shape[2] for c in (self, other) if c._k is not None)
            keys, values = [], []
            for c in (self, other):
                if c._k is None:
                    B = len(c.lengths)

                    def fresh(x, B=B):
                        return mx.zeros((B, x.shape[1], size, x.shape[3]), x.dtype)

                    keys.append([fresh(x) for x in like._k])
                    values.append([fresh(x) for x in like._v])
                else:
                    keys.append([_pad_to(x, size) for x in c._k])
                    values.append([_pad_to(x, size) for x in c._v])
            self._k = [mx.concatenate(xs) for xs in zip(*keys)]
            self._v = [mx.concatenate(xs) for xs in zip(*values)]
        self.lengths = self.lengths + other.lengths

    def filter(self, keep: Sequence[int]) -> None:
        """Keep the streams at indices ``keep``, in that order."""
        self.lengths = [self.lengths[i] for i in keep]
        if self._k is not None:
            if not keep:
                self._k = self._v = None
                return
            idx = mx.array(list(keep))
            used = max(max(self.lengths), 1)
            size = -(-used // self.step) * self.step
            self._k = [x[idx, :, :size] for x in self._k]
            self._v = [x[idx, :, :size] for x in self._v]

    def extract(self, b: int) -> KVCache:
        """Stream ``b`` as a single-stream cache (its own copy), of the kind
        the streams came from."""
        c = KVCache() if self.like is None else self.like.blank()
        n = self.lengths[b]
        if self._k is not None and n:
            c.keys = self._form([mx.contiguous(x[b : b + 1, :, :n]) for x in self._k])
            c.values = self._form([mx.contiguous(x[b : b + 1, :, :n]) for x in self._v])
            c.offset = n
        return c


class RaggedQuantizedKVCache(RaggedKVCache):
    """``RaggedKVCache`` of quantized keys and values: each position quantized
    on its own, as mlx-lm's ``QuantizedKVCache`` does (and its ``bits`` make
    mlx-lm's attention take the quantized path)."""

    def __init__(self, lengths: Sequence[int] = (), like: Any = None):
        super().__init__(lengths, like)
        self.bits, self.group_size = like.kv_bits, like.group_size

    def _encode(self, x: mx.array) -> List[mx.array]:
        return list(mx.quantize(x, self.group_size, self.bits))

    def _full(self, parts: List[mx.array], n: int) -> mx.array:
        parts = [x[..., :n, :] for x in parts]
        return mx.dequantize(*parts, self.group_size, self.bits)


def _parts(x) -> List[mx.array]:
    return list(x) if isinstance(x, (tuple, list)) else [x]


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
        n = per_stream(n, self.streams)
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


class BatchCacheList:
    """The caches of one layer made of caches (mlx-lm's ``CacheList``) over the
    batch's streams: member ``i`` is the batch form (``merge``) of every
    stream's member ``i``. It reports its first member's per-stream offset and
    masks, as ``heads.common.OffsetCacheList`` does for one stream."""

    def __init__(self, caches: Sequence[Any], kinds: Sequence[type]):
        self.caches = list(caches)
        self.kinds = list(kinds)  # the members' single-stream classes

    def __getitem__(self, i: int) -> Any:
        return self.caches[i]

    @property
    def offset(self):
        return self.caches[0].offset

    @property
    def lengths(self) -> List[int]:
        return self.caches[0].lengths

    def make_mask(self, *args, **kwargs):
        return self.caches[0].make_mask(*args, **kwargs)

    def rollback(self, n: Counts) -> None:
        for c in self.caches:
            c.rollback(n)

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        self.rollback(n)
        return n

    @property
    def state(self):
        return [x for c in self.caches for x in c.state]

    @property
    def nbytes(self) -> int:
        return sum(getattr(c, "nbytes", 0) for c in self.caches)

    @classmethod
    def merge(cls, lists: Sequence[Any]) -> "BatchCacheList":
        first = lists[0].caches
        members = [merge([c.caches[i] for c in lists]) for i in range(len(first))]
        return cls(members, [type(c) for c in first])

    def extend(self, other: "BatchCacheList") -> None:
        for mine, theirs in zip(self.caches, other.caches):
            mine.extend(theirs)

    def filter(self, keep: Sequence[int]) -> None:
        for c in self.caches:
            c.filter(keep)

    def extract(self, b: int, like: type) -> Any:
        """Stream ``b`` as a single-stream cache list of class ``like``."""
        pairs = zip(self.caches, self.kinds)
        return like(*(extract_stream(c, b, k) for c, k in pairs))


def extract_stream(cache: Any, b: int, kind: type) -> Any:
    """Stream ``b`` of the batch cache ``cache`` as a cache of class ``kind``
    (the single-stream cache it was merged from)."""
    if isinstance(cache, RaggedKVCache):
        return cache.extract(b)
    return cache.extract(b, kind)


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
    return all(
        type(c) is KVCache
        or isinstance(c, (QuantizingKVCache, KeepStatesCache))
        # (a cache made of caches has one where each of its members has, or
        # where its own ``merge_batch`` makes theirs: ``merges_members``)
        or (
            hasattr(c, "merge_batch")
            and (
                getattr(c, "merges_members", False)
                or batchable(getattr(c, "caches", ()))
            )
        )
        for c in caches
    )


def merge(caches: Sequence[Any], convert: bool = True) -> Any:
    """The batch cache of one layer from each stream's cache of that layer.

    Caches of a quantizing policy (``kv``) turn quantized here with
    ``convert``: a batch holds one form, and streams join it quantized.
    Without ``convert`` they must all be in one form (the scheduler reads
    prompts whose caches are still in full precision apart)."""
    first = caches[0]
    if hasattr(first, "merge_batch"):  # a drafter's cache of a kind of its own
        return type(first).merge_batch(caches)
    if isinstance(first, QuantizingKVCache):
        if convert:
            for c in caches:
                c.quantize()
        if len({c.quantized for c in caches}) > 1:
            raise ValueError("a batch holds its streams' caches in one form")
        if first.quantized:
            return RaggedQuantizedKVCache.merge(caches)
        return RaggedKVCache.merge(caches)
    if type(first) is KVCache:
        return RaggedKVCache.merge(caches)
    return BatchStatesCache.merge(caches)


def rollback(caches: Sequence[Any], n: Counts) -> None:
    for c in caches:
        c.rollback(n)
