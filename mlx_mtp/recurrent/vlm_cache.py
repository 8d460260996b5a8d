"""Rollback for the caches of language models that mlx-vlm runs (Qwen3.8-Flash-Next,
GLM-5.3-Flash, DeepSeek-V4-Flash).

mlx-vlm 0.7.10's layers write their recurrent caches through two calls of its
own ``ArraysCache`` (``models/cache.py``): ``update_window(slot, source,
width)`` for every causal window (a gated delta net's conv inputs, a
per-layer n-gram embedding's token history and short conv) and
``update_recurrent(slot, length, update)`` for a state, where ``update(state,
steps)`` returns the states after each token when asked for ``steps`` of them
(``qwen3_5/gated_delta.py``). ``VerifyArraysCache`` keeps, between
``start_verify()`` and ``rollback(n)``, what those calls pass (the inputs of a
window, the state after every token) in ``KeepStatesCache``'s form, and
rolls back with its code: each slot gets its window or state after the last
kept token. mlx-vlm's layers run unchanged; nothing is kept outside a pass.

``RollbackQSACache`` is mlx-vlm's ``QSAKVCache`` (keys and values, the
indexer's raw keys and positions, and the summaries of its complete blocks)
whose ``trim`` keeps the block summaries that the kept tokens complete: every
block is pooled from its own keys alone, so those are the arrays a decode that
never saw the dropped tokens holds (mlx-vlm's ``trim`` drops them all and
pools them again at the next forward).

``RollbackPoolingCache`` is mlx-vlm's ``PoolingCache`` (pooled summaries of
complete ``ratio``-row groups, and a buffer of the group still open: GLM-5.3-
Flash's DSA indexer keys, DeepSeek-V4's compressors): the pass's rows reach
it through mlx-vlm's own hook (``_record_speculative_inputs``, which
``accumulate_windows`` calls), and ``rollback(n)`` keeps the groups the kept
tokens closed (each is pooled from its own rows alone, so none is pooled
again) and reopens the group they end in with its rows: what a decode that
never saw the dropped tokens holds. mlx-vlm's own ``trim`` cannot drop a
token once a group exists. ``TrimmablePoolingCache`` (an MTP head's, whose
tentative drafts are dropped outside a verify pass) keeps the raw keys and
gates instead and cuts anywhere. ``VerifyCacheList`` is mlx-vlm's
``CacheList`` whose members each roll back by their own kind (a DSA layer's
latent, indexer validity, pooling and projected-key caches; a compressed
layer's window and compressors); a key cache is cut to at most the tokens
the first member keeps (GLM-5.3's projected keys follow the latent on long
chunks only, and may lag it).

``patch_trunk(model)`` makes mlx-vlm's language model hand out all of them.

Batch forms (``decoder.Decoder``, ``batch_cache.merge``'s ``merge_batch``
hook): ``BatchArraysCache`` holds every stream's windows and states, each
stream rolled back to its own last kept token; ``RaggedQSACache`` holds every
stream's keys and values in one ``batch_cache.RaggedKVCache`` (each stream at
its own length) and each stream's indexer state (raw keys, positions, block
summaries) as a single-stream ``RollbackQSACache`` of its own, which mlx-vlm's
indexer selects on, stream by stream, exactly as it does alone; the
projections and the attention then run over all streams at once under the
streams' masks (``RaggedQSAAttention``, put on mlx-vlm's ``Qwen4ExpAttention``
modules by ``patch_trunk`` and the head).
"""

from typing import Any, Dict, List, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache as LMKVCache
from mlx_vlm.models.base import scaled_dot_product_attention
from mlx_vlm.models.cache import ArraysCache as VLMArraysCache
from mlx_vlm.models.cache import BatchPoolingCache
from mlx_vlm.models.cache import CacheList as VLMCacheList
from mlx_vlm.models.cache import KVCache as VLMKVCache
from mlx_vlm.models.cache import PoolingCache
from mlx_vlm.models.qwen4_exp.language import QSAKVCache, Qwen4ExpAttention
from mlx_vlm.models.qwen4_exp.qsa_kernel import dispatch_qsa_attention

from ..batch_cache import Counts, RaggedKVCache, merge, per_stream
from .keep_states import KeepStatesCache


class VerifyArraysCache(VLMArraysCache):
    """mlx-vlm's ``ArraysCache`` that can roll back a verify pass."""

    _verify = None  # slot -> (kept sequence along axis 1, window or 0)

    verifying = KeepStatesCache.verifying
    start_verify = KeepStatesCache.start_verify
    _keep = KeepStatesCache._keep
    rollback = KeepStatesCache.rollback

    def update_window(self, index, source, width, *, lengths=None):
        if self._verify is not None:
            if lengths is not None:
                raise NotImplementedError("verify with per-sequence lengths")
            self._keep(index, source, int(width))
        return super().update_window(index, source, width, lengths=lengths)

    def update_recurrent(self, index, length, update):
        if self._verify is None:
            return super().update_recurrent(index, length, update)
        result = update(self.cache[index], length - 1 if length > 1 else None)
        out, state = result[:2]
        before = result[2] if len(result) > 2 and result[2] is not None else None
        states = state[:, None] if before is None else mx.concatenate(
            [before, state[:, None]], axis=1
        )
        self._keep(index, states, 0)
        self.cache[index] = state
        return out, state

    def is_trimmable(self) -> bool:
        return False

    def mark(self) -> tuple:
        return tuple(self.cache)

    def restore(self, mark: tuple) -> None:
        self._verify = None
        self.cache = list(mark)

    # what a fresh slot reads as, where it is not zeros (the n-gram token
    # history starts as end-of-sequence tokens): a batch fills it so
    fills: Dict[int, int] = {}

    @staticmethod
    def merge_batch(caches: Sequence["VerifyArraysCache"]) -> "BatchArraysCache":
        return BatchArraysCache.merge(caches)


class RollbackQSACache(QSAKVCache):
    """``QSAKVCache`` whose ``trim`` keeps the block summaries still complete."""

    @staticmethod
    def merge_batch(caches: Sequence["RollbackQSACache"]) -> "RaggedQSACache":
        return RaggedQSACache.merge_streams(caches)

    def trim(self, n):
        blocks, ratio = self.index_block_keys, self.index_block_ratio
        n = super().trim(n)
        if blocks is not None and ratio:
            kept = self.offset // ratio
            if kept:
                self.index_block_keys = blocks[:, :, :kept]
                self.index_block_ratio = ratio
        return n


def copied(a: Optional[mx.array]) -> Optional[mx.array]:
    """A copy of ``a`` (None stays None) that later writes into ``a`` leave alone."""
    return None if a is None else mx.array(a)


def _open_block(parts: list, lo: int, hi: int, ratio: int) -> mx.array:
    """Rows ``lo:hi`` of ``parts`` joined, zero-padded to a block of ``ratio``
    (the buffer's slots past the open rows are never read)."""
    rows = mx.concatenate([p for p in parts if p is not None], axis=1)[:, lo:hi]
    pad = mx.zeros((rows.shape[0], ratio - rows.shape[1], rows.shape[2]), rows.dtype)
    return mx.concatenate([rows, pad], axis=1)


class RollbackPoolingCache(PoolingCache):
    """mlx-vlm's ``PoolingCache`` (pooled groups and the open block) that rolls
    back a verify pass: GLM-5.3's DSA indexer's, DeepSeek-V4's compressors'."""

    _start: Optional[tuple] = None  # (open rows kv, gate, remainder, pooled)
    _rows: Optional[list] = None  # the (kv, gate) rows the pass projected

    @property
    def verifying(self) -> bool:
        return self._start is not None

    def _open(self) -> tuple:
        r = self.remainder
        if not r or self.buf_kv is None:
            return None, None
        return self.buf_kv[:, :r], self.buf_gate[:, :r]

    def start_verify(self) -> None:
        self._start = (*self._open(), self.remainder, self.pooled)
        self._rows = []
        # a decode writes into the buffers: the pass writes into copies
        self.buf_kv, self.buf_gate = copied(self.buf_kv), copied(self.buf_gate)

    def _record_speculative_inputs(self, kv, gate):
        # (mlx-vlm's hook: ``accumulate_windows`` hands it every row it reads)
        if self._rows is not None:
            self._rows.append((kv, gate))
        super()._record_speculative_inputs(kv, gate)

    def rollback(self, n: int) -> None:
        start, rows = self._start, self._rows
        self._start = self._rows = None
        if n == 0:
            return
        if start is None:
            raise RuntimeError(f"cannot roll back {n} tokens outside a verify pass")
        open_kv, open_gate, remainder, pooled = start
        verified = sum(kv.shape[1] for kv, _ in rows)
        if n > verified:
            raise ValueError(f"cannot roll back {n} of {verified} verified tokens")
        total = remainder + verified - n
        groups, self.remainder = divmod(total, self.ratio)
        had = 0 if pooled is None else pooled.shape[1]
        self.pooled = pooled if groups == 0 else self.pooled[:, : had + groups]
        if self.remainder == 0:
            return  # the next write opens a group: the buffer is not read
        lo, ratio = groups * self.ratio, self.ratio
        self.buf_kv = _open_block([open_kv] + [k for k, _ in rows], lo, total, ratio)
        gates = [open_gate] + [g for _, g in rows]
        self.buf_gate = _open_block(gates, lo, total, ratio)

    def is_trimmable(self) -> bool:
        return False

    def mark(self) -> tuple:
        return (copied(self.buf_kv), copied(self.buf_gate), self.remainder, self.pooled)

    def restore(self, mark: tuple) -> None:
        self._start = self._rows = None
        buf_kv, buf_gate, self.remainder, self.pooled = mark
        self.buf_kv, self.buf_gate = copied(buf_kv), copied(buf_gate)

    @classmethod
    def merge_batch(cls, caches: Sequence[Any]) -> "BatchRollbackPoolingCache":
        return BatchRollbackPoolingCache.merge(caches)


class BatchRollbackPoolingCache(BatchPoolingCache):
    """``RollbackPoolingCache`` of several streams (mlx-vlm's ``BatchPoolingCache``:
    each stream's pooled count, open rows and position of its own), each
    stream rolled back by its own count after a verify pass: its groups the
    kept tokens closed, the group they end in reopened with its rows. Pools
    written past a stream's count are masked (``make_mask``) and overwritten
    by its next pool."""

    _start: Optional[tuple] = None  # (open rows kv, gate, remainders, pools, read)
    _rows: Optional[list] = None

    @property
    def verifying(self) -> bool:
        return self._start is not None

    def start_verify(self) -> None:
        self._start = (
            copied(self.buf_kv),
            copied(self.buf_gate),
            list(self.remainder),
            list(self._pool_lengths),
            list(self._processed),
        )
        self._rows = []

    def _record_speculative_inputs(self, kv, gate):
        if self._rows is not None:
            self._rows.append((kv, gate))
        super()._record_speculative_inputs(kv, gate)

    def rollback(self, n: Counts) -> None:
        start, rows = self._start, self._rows
        self._start = self._rows = None
        n = per_stream(n, self.batch_size)
        if not any(n):
            return
        if start is None:
            raise RuntimeError(f"cannot roll back {max(n)} tokens outside a verify pass")
        open_kv, open_gate, remainders, pools, read = start
        verified = sum(kv.shape[1] for kv, _ in rows)
        if max(n) > verified:
            raise ValueError(f"cannot roll back {max(n)} of {verified} verified tokens")
        ratio, kvs, gates = self.ratio, [], []
        for b, (k, r) in enumerate(zip(n, remainders)):
            total = r + verified - k
            groups, self.remainder[b] = divmod(total, ratio)
            self._pool_lengths[b] = pools[b] + groups
            self._processed[b] = read[b] + verified - k
            lo = groups * ratio
            for out, old, new in ((kvs, open_kv, 0), (gates, open_gate, 1)):
                parts = [] if old is None else [old[b : b + 1, :r]]
                parts += [x[new][b : b + 1] for x in rows]
                out.append(_open_block(parts, lo, total, ratio))
        self.buf_kv, self.buf_gate = mx.concatenate(kvs), mx.concatenate(gates)
        width = max(self._pool_lengths)
        self.pooled = None if width == 0 else mx.contiguous(self.pooled[:, :width])

    def make_mask(self, L: int = 1, offset=0):
        # (mlx-vlm 0.7.10's adds an int offset twice where ``L > 1``)
        if L > 1 and not isinstance(offset, mx.array):
            offset = mx.full((self.batch_size,), offset, dtype=mx.int32)
        return super().make_mask(L, offset)

    def is_trimmable(self) -> bool:
        return False

    def filter(self, keep: Sequence[int]) -> None:
        if keep:
            return super().filter(mx.array(list(keep), dtype=mx.int32))
        self.buf_kv = self.buf_gate = self.pooled = None
        self.remainder, self._pool_lengths, self._lengths = [], [], []
        self._processed, self.left_padding = [], []

    def extract(self, b: int, kind: type = RollbackPoolingCache) -> RollbackPoolingCache:
        one = super().extract(b)
        c = kind(self.ratio)
        c.pooled, c.remainder = one.pooled, one.remainder
        c.buf_kv, c.buf_gate = one.buf_kv, one.buf_gate
        return c


class TrimmablePoolingCache(PoolingCache):
    """``PoolingCache`` that keeps every key and gate it read, so that ``trim``
    can drop tokens anywhere: a head's tentative drafts are dropped outside a
    verify pass. One layer's raw indexer keys (an MTP head's) cost little."""

    def __init__(self, ratio: int):
        super().__init__(ratio)
        self.raw = VLMKVCache()

    def accumulate_windows(self, kv, gate, offset):
        self.raw.update_and_fetch(kv[:, None], gate[:, None])
        return super().accumulate_windows(kv, gate, offset)

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = self.raw.trim(n)
        total = self.raw.offset
        pools = total // self.ratio
        self.pooled = None if pools == 0 else mx.contiguous(self.pooled[:, :pools])
        self.remainder = total % self.ratio
        if self.remainder:
            r = slice(total - self.remainder, total)
            self.buf_kv[:, : self.remainder] = self.raw.keys[:, 0, r]
            self.buf_gate[:, : self.remainder] = self.raw.values[:, 0, r]
        return n

    def mark(self) -> int:
        return self.raw.offset

    def restore(self, mark: int) -> None:
        self.trim(self.raw.offset - mark)


class VerifyCacheList(VLMCacheList):
    """mlx-vlm's ``CacheList`` whose members each roll back by their own kind
    (a GLM-5.3 DSA layer's latent, indexer validity, pooling and projected-key
    caches; a DeepSeek-V4 compressed layer's window and compressors): one with
    ``rollback`` by it (a verify pass), a key cache cut to at most the tokens
    the first member (the latent, the window) keeps, any other by ``trim``."""

    @property
    def offset(self):
        return self.caches[0].offset

    @property
    def verifying(self) -> bool:
        return any(getattr(c, "verifying", False) for c in self.caches)

    def start_verify(self) -> None:
        for c in self.caches:
            if hasattr(c, "start_verify"):
                c.start_verify()

    def rollback(self, n: int) -> None:
        keep = self.caches[0].offset - n
        if keep < 0:
            raise ValueError(f"cannot roll back {n} of {n + keep} tokens")
        for c in self.caches:
            if hasattr(c, "rollback"):
                c.rollback(n)
            elif isinstance(c, VLMKVCache):
                c.trim(max(0, c.offset - keep))
            elif n:
                c.trim(n)

    def is_trimmable(self) -> bool:
        return False

    def mark(self) -> tuple:
        return tuple(
            c.mark() if hasattr(c, "mark") else c.offset for c in self.caches
        )

    def restore(self, mark: tuple) -> None:
        for c, m in zip(self.caches, mark):
            if hasattr(c, "restore"):
                c.restore(m)
            else:
                c.trim(c.offset - m)

    @classmethod
    def merge_batch(cls, caches: Sequence[Any]) -> "BatchCacheList":
        """(``batch_cache.batchable`` asks every member for a batch form.)"""
        members = [merge(layer) for layer in zip(*(c.caches for c in caches))]
        return BatchCacheList([type(c) for c in caches[0].caches], *members)


class BatchCacheList(VLMCacheList):
    """A ``VerifyCacheList`` of several streams: each member in its batch form
    (``kinds``: the members' own classes, which ``extract`` gives back)."""

    def __init__(self, kinds: List[type], *caches: Any):
        super().__init__(*caches)
        self.kinds = kinds

    @property
    def offset(self):
        return self.caches[0].offset

    @property
    def verifying(self) -> bool:
        return any(c.verifying for c in self.caches)

    def start_verify(self) -> None:
        for c in self.caches:
            c.start_verify()

    def rollback(self, n: Counts) -> None:
        for c in self.caches:
            c.rollback(n)

    def is_trimmable(self) -> bool:
        return False

    def extend(self, other: "BatchCacheList") -> None:
        for c, o in zip(self.caches, other.caches):
            c.extend(o)

    def filter(self, keep: Sequence[int]) -> None:
        for c in self.caches:
            c.filter(keep)

    def extract(self, b: int, kind: type = VerifyCacheList) -> VerifyCacheList:
        return kind(*(c.extract(b, k) for c, k in zip(self.caches, self.kinds)))

    @property
    def state(self) -> list:
        return [c.state for c in self.caches]

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.caches)


def _rollable(cache: Any) -> Any:
    if type(cache) is VLMArraysCache:
        return VerifyArraysCache(len(cache.cache))
    if type(cache) is QSAKVCache:
        return RollbackQSACache()
    if type(cache) is PoolingCache:
        return RollbackPoolingCache(cache.ratio)
    if type(cache) is VLMCacheList:
        return VerifyCacheList(*(_rollable(c) for c in cache.caches))
    return cache


def patch_trunk(model: nn.Module) -> None:
    """Make ``model.make_cache`` (mlx-vlm's language model) hand out caches
    that roll back, and its QSA layers read a batch of ragged streams.
    Calling it twice changes nothing."""
    ragged_qsa(model)
    base = type(model)
    if getattr(base, "_mtp_vlm_rollable", False):
        return

    def make_cache(self) -> List[Any]:
        caches = [_rollable(c) for c in base.make_cache(self)]
        layers = getattr(getattr(self, "model", None), "layers", ())
        for c, layer in zip(caches, layers):
            ple = getattr(layer, "ple", None)
            if isinstance(c, VerifyArraysCache) and ple is not None:
                c.fills = {3: int(ple.ple_embedding.eos_token_id)}  # its history
        return caches

    model.__class__ = type(
        base.__name__, (base,), {"make_cache": make_cache, "_mtp_vlm_rollable": True}
    )


# -- batch forms: several streams, each at its own length ------------------------


def _per_stream(n, size: int) -> List[int]:
    return [n] * size if isinstance(n, int) else [int(x) for x in n]


def _stacked(parts: Sequence[Optional[mx.array]], counts: Sequence[int], fill: int):
    """Concatenate along the batch axis; a missing part (a stream that has read
    nothing) is ``count`` rows of ``fill``."""
    like = next((p for p in parts if p is not None), None)
    if like is None:
        return None
    return mx.concatenate(
        [
            mx.full((n, *like.shape[1:]), fill, like.dtype) if p is None else p
            for p, n in zip(parts, counts)
        ]
    )


class BatchArraysCache(VerifyArraysCache):
    """``VerifyArraysCache`` of ``streams`` streams: mlx-vlm's layers write it
    as they write one stream's (every stream reads the same number of inputs
    a forward: padding sits after a stream's own tokens), and ``rollback``
    takes, per stream, its window or state after its own last kept token."""

    def __init__(self, size: int, streams: int = 0, kind: type = VerifyArraysCache):
        super().__init__(size)
        self.streams, self.kind = streams, kind

    def rollback(self, n) -> None:
        kept_slots, self._verify = self._verify, None
        n = _per_stream(n, self.streams)
        if not any(n):
            return
        if not kept_slots:
            raise RuntimeError(f"cannot roll back {max(n)} tokens outside a verify pass")
        counts = {seq.shape[1] - window for seq, window in kept_slots.values()}
        verified = counts.pop()
        if counts or max(n) >= verified:
            raise ValueError(f"cannot roll back {max(n)} of {verified} verified tokens")
        kept = mx.array([verified - k for k in n], dtype=mx.int32)
        for slot, (seq, window) in kept_slots.items():
            ones = [1] * (seq.ndim - 2)
            if window:  # stream b's window: the ``window`` inputs before its next
                rows = (kept[:, None] + mx.arange(window)).reshape(-1, window, *ones)
                self.cache[slot] = mx.take_along_axis(seq, rows, axis=1)
            else:  # its state after its last kept token
                rows = (kept - 1).reshape(-1, 1, *ones)
                self.cache[slot] = mx.take_along_axis(seq, rows, axis=1).squeeze(1)

    @classmethod
    def merge(cls, caches: Sequence[VerifyArraysCache]) -> "BatchArraysCache":
        first = caches[0]
        out = cls(len(first.cache), len(caches), type(first))
        out.fills = first.fills
        ones = [1] * len(caches)
        for i in range(len(out.cache)):
            parts = [c.cache[i] for c in caches]
            out.cache[i] = _stacked(parts, ones, out.fills.get(i, 0))
        return out

    def extend(self, other: "BatchArraysCache") -> None:
        counts = [self.streams, other.streams]
        self.cache = [
            _stacked([a, b], counts, self.fills.get(i, 0))
            for i, (a, b) in enumerate(zip(self.cache, other.cache))
        ]
        self.streams += other.streams

    def filter(self, keep: Sequence[int]) -> None:
        idx = mx.array(list(keep), dtype=mx.int32)
        self.cache = [None if c is None or not keep else c[idx] for c in self.cache]
        self.streams = len(keep)

    def extract(self, b: int, like: Optional[type] = None) -> VerifyArraysCache:
        """Stream ``b`` as a single-stream cache (of class ``like``, or the
        class the streams came from)."""
        c = (like or self.kind)(len(self.cache))
        c.fills = self.fills
        c.cache = [None if x is None else mx.contiguous(x[b : b + 1]) for x in self.cache]
        return c

    @property
    def state(self) -> List[mx.array]:
        return [x for x in self.cache if x is not None]

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in self.state)


class RaggedQSACache:
    """QSA caches of several streams, stream ``b`` holding ``lengths[b]`` tokens.

    Keys and values sit in one ``RaggedKVCache`` (each stream writes at its own
    length, its stale entries past it masked); each stream's indexer state is
    a ``RollbackQSACache`` of its own (``index[b]``, holding no keys: its
    ``offset`` follows the stream's length), on which mlx-vlm's indexer
    selects as it does for the stream alone, and which rolls back by that
    class's own ``trim`` (complete block summaries kept).

    It has no ``merge``: mlx-vlm's ``Qwen4ExpModel`` reads a first QSA cache
    with ``extract``, ``merge`` and per-row offsets as its own batch cache and
    runs each row apart (``merge_streams`` builds this one).
    """

    def __init__(self, kv: RaggedKVCache, index: List[RollbackQSACache], kind: type):
        self.kv, self.index, self.kind = kv, index, kind

    @property
    def lengths(self) -> List[int]:
        return self.kv.lengths

    @property
    def offset(self):
        return self.kv.offset

    def make_mask(self, *args, **kwargs):
        return self.kv.make_mask(*args, **kwargs)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        out = self.kv.update_and_fetch(keys, values)
        self._follow()
        return out

    def _follow(self) -> None:
        for view, n in zip(self.index, self.kv.lengths):
            view.offset = n

    def rollback(self, n) -> None:
        n = _per_stream(n, len(self.index))
        self.kv.rollback(n)
        for view, k in zip(self.index, n):
            if k:
                view.trim(k)
        self._follow()

    def trim(self, n: int) -> int:
        self.rollback(n)
        return n

    def is_trimmable(self) -> bool:
        return True

    @classmethod
    def merge_streams(cls, caches: Sequence[RollbackQSACache]) -> "RaggedQSACache":
        plain = []
        for c in caches:
            p = LMKVCache()
            if c.keys is not None and c.offset:
                p.keys, p.values = c.keys[..., : c.offset, :], c.values[..., : c.offset, :]
                p.offset = c.offset
            plain.append(p)
        kind = type(caches[0])
        index = []
        for c in caches:
            view = kind()
            view.offset = c.offset
            view.index_keys, view.index_position_ids = c.index_keys, c.index_position_ids
            view.index_block_keys = c.index_block_keys
            view.index_block_ratio = c.index_block_ratio
            index.append(view)
        return cls(RaggedKVCache.merge(plain), index, kind)

    def extend(self, other: "RaggedQSACache") -> None:
        self.kv.extend(other.kv)
        self.index = self.index + other.index

    def filter(self, keep: Sequence[int]) -> None:
        self.kv.filter(keep)
        self.index = [self.index[i] for i in keep]

    def extract(self, b: int, like: Optional[type] = None) -> RollbackQSACache:
        """Stream ``b`` as a single-stream cache (its own copy of the keys)."""
        c = (like or self.kind)()
        kv, view = self.kv.extract(b), self.index[b]
        if kv.keys is not None:
            c.keys, c.values, c.offset = kv.keys, kv.values, kv.offset
        c.index_keys, c.index_position_ids = view.index_keys, view.index_position_ids
        c.index_block_keys, c.index_block_ratio = view.index_block_keys, view.index_block_ratio
        return c

    @property
    def state(self) -> List[mx.array]:
        held = [
            x
            for v in self.index
            for x in (v.index_keys, v.index_position_ids, v.index_block_keys)
            if x is not None
        ]
        return self.kv.state + held

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in self.state)


class RaggedQSAAttention(Qwen4ExpAttention):
    """mlx-vlm's ``Qwen4ExpAttention`` that also reads a ``RaggedQSACache``: each
    stream's blocks are selected on its own indexer state (mlx-vlm's
    ``select_from_projected``, as alone), then one attention over all streams,
    each under its own mask (mlx-vlm's ``build_mask`` of its selection, or its
    causal rows where it selects nothing); where every stream selects, through
    mlx-vlm's ``dispatch_qsa_attention`` as a stream alone goes."""

    def __call__(self, x, mask=None, cache=None, position_ids=None, position_embeddings=None):
        if not isinstance(cache, RaggedQSACache):
            return super().__call__(x, mask, cache, position_ids, position_embeddings)
        B, L, _ = x.shape
        if position_ids is None:
            offset = mx.array(cache.lengths, dtype=mx.int32)[:, None]
            position_ids = offset + mx.arange(L, dtype=mx.int32)
        qk = self.indexer.index_qk_proj(x)
        selections = [
            self.indexer.select_from_projected(
                qk[b : b + 1], view, position_ids[..., b : b + 1, :]
            )
            for b, view in enumerate(cache.index)
        ]
        starts = list(cache.lengths)
        queries, keys, values, gate, _ = self._prepare_projected_qkv(
            self.q_proj(x), self.k_proj(x), self.v_proj(x),
            cache, position_ids, position_embeddings, None,
        )  # fmt: skip
        scale = self.scale
        if all(s is None for s in selections):  # every stream attends densely
            out = scaled_dot_product_attention(
                queries, keys, values, cache=cache, scale=scale, mask=mask
            )
        else:
            width = keys.shape[2]

            def masks():
                rows = []
                for s, n in zip(selections, starts):
                    if s is None:  # its causal rows
                        ends = n + mx.arange(L) + 1
                        m = (mx.arange(width) < ends[:, None])[None, None]
                    else:
                        m = self.indexer.build_mask(s)
                        pad = width - m.shape[-1]
                        if pad:
                            m = mx.concatenate(
                                [m, mx.zeros((*m.shape[:-1], pad), mx.bool_)], axis=-1
                            )
                    rows.append(m)
                return mx.concatenate(rows)

            if any(s is None for s in selections):
                out = scaled_dot_product_attention(
                    queries, keys, values, cache=cache, scale=scale, mask=masks()
                )
            else:
                out = dispatch_qsa_attention(
                    queries,
                    keys,
                    values,
                    mx.concatenate([s.selected_blocks for s in selections]),
                    mx.concatenate([s.query_ends for s in selections]),
                    cache=cache,
                    scale=scale,
                    block_size=self.indexer.compress_ratio,
                    causal=True,
                    mask=None,
                    mask_factory=masks,
                )
        out = out.transpose(0, 2, 1, 3).reshape(B, L, -1)
        return self.o_proj(out * mx.sigmoid(gate))


def ragged_qsa(model: nn.Module) -> None:
    """Every ``Qwen4ExpAttention`` of ``model`` becomes a ``RaggedQSAAttention``
    (its parameters and names unchanged)."""
    for _, m in model.named_modules():
        if type(m) is Qwen4ExpAttention:
            m.__class__ = RaggedQSAAttention
