"""Rollback for DeepSeek-V4's sliding-window and compressed caches (mlx-vlm 0.7.10).

mlx-vlm's ``deepseek_v4.LanguageModel.make_cache`` gives each layer a
``RotatingKVCache`` of ``sliding_window`` rows (the window), plus, on a
compressed layer, a ``PoolingCache`` per compressor (the attention's and,
on a sparse layer, the indexer's) in a ``CacheList``. A ``PoolingCache``
holds the pooled groups (``pooled``) and the projected rows of the group still
open (``buf_kv`` / ``buf_gate``, ``remainder`` rows). Both write into their
arrays (a single-token update overwrites the window's oldest row and the
buffer's next slot), and a verify pass of ``k + 1`` tokens runs token by token
(mlx-vlm's attention loops over chunks of up to ``DECODE_BLOCK_SIZE`` so that
a verify computes what a decode does), so neither can be cut back by its
``trim``.

- ``RollbackWindowCache`` (the window): ``start_verify`` keeps the arrays as
  they were and lets the pass write into copies; it keeps the rows the pass
  adds. ``rollback(n)`` with ``n > 0`` puts the kept arrays back and writes
  the kept rows into them the way a decode of those tokens writes them (the
  same single-row updates: the same rotation, the same arrays).
- a compressor's ``PoolingCache`` and the layer's ``CacheList`` roll back as
  GLM-5.3's do (``vlm_cache.RollbackPoolingCache``: the groups the kept
  tokens closed, and the group they end in reopened with its rows;
  ``vlm_cache.VerifyCacheList``, here ``RollbackCacheList``).

Nothing is recomputed; outside a pass the caches are mlx-vlm's, unchanged.
``mark`` / ``restore`` copy the arrays that are written into.
``patch_trunk(model)`` makes the language model hand out these caches.
"""

from typing import Any, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_vlm.models.cache import CacheList, KVCache, PoolingCache, RotatingKVCache

from ..batch_cache import Counts, RaggedKVCache, per_stream

from .vlm_cache import RollbackPoolingCache, copied
from .vlm_cache import VerifyCacheList as RollbackCacheList


def _check(n: int, verified: int) -> None:
    if n > verified:
        raise ValueError(f"cannot roll back {n} of {verified} verified tokens")


class RollbackWindowCache(RotatingKVCache):
    """mlx-vlm's sliding-window ``RotatingKVCache`` that rolls back a verify pass."""

    _start: Optional[tuple] = None  # (keys, values, offset, _idx) before the pass
    _rows: Optional[list] = None  # the (keys, values) the pass added

    @property
    def verifying(self) -> bool:
        return self._start is not None

    def start_verify(self) -> None:
        self._start = (self.keys, self.values, self.offset, self._idx)
        self._rows = []
        self.keys, self.values = copied(self.keys), copied(self.values)

    def update_and_fetch(self, keys, values):
        if self._rows is not None:
            self._rows.append((keys, values))
        return super().update_and_fetch(keys, values)

    def rollback(self, n: int) -> None:
        start, rows = self._start, self._rows
        self._start = self._rows = None
        if n == 0:
            return
        if start is None:
            raise RuntimeError(f"cannot roll back {n} tokens outside a verify pass")
        verified = self.offset - start[2]
        _check(n, verified)
        self.keys, self.values, self.offset, self._idx = start
        keys = mx.concatenate([k for k, _ in rows], axis=2)
        values = mx.concatenate([v for _, v in rows], axis=2)
        for i in range(verified - n):  # as a decode writes them: one row at a time
            super().update_and_fetch(keys[..., i : i + 1, :], values[..., i : i + 1, :])

    def is_trimmable(self) -> bool:
        return False

    def mark(self) -> tuple:
        return (copied(self.keys), copied(self.values), self.offset, self._idx)

    def restore(self, mark: tuple) -> None:
        self._start = self._rows = None
        keys, values, self.offset, self._idx = mark
        self.keys, self.values = copied(keys), copied(values)


    @classmethod
    def merge_batch(cls, caches: Sequence[Any]) -> "BatchWindowCache":
        return BatchWindowCache.merge(caches)


def _window_slots(c: RotatingKVCache) -> Tuple[Optional[tuple], int]:
    """One stream's window as ``max_size`` slots and the phase its next write
    keeps (the token at position ``p`` goes to slot ``(p - phase) % max_size``):
    the slots a decode of its next tokens writes, as mlx-vlm's in-place
    update writes them (after a prompt's concatenation: the last ``max_size``
    rows in order, the next at slot 0)."""
    W = c.max_size
    if c.keys is None:
        return None, 0
    keys, values, held = c.keys, c.values, c.keys.shape[2]
    if held > W:  # concatenated: in order; the next in-place write trims to W
        keys, values = keys[..., held - W :, :], values[..., held - W :, :]
        return (keys, values), c.offset % W
    if held < W:  # not yet wrapped: position p at slot p
        pad = [(0, 0), (0, 0), (0, W - held), (0, 0)]
        return (mx.pad(keys, pad), mx.pad(values, pad)), 0
    slot = 0 if c._idx >= W else c._idx
    return (keys, values), (c.offset - slot) % W


class BatchWindowCache:
    """``RollbackWindowCache`` of several streams, each at its own position:
    a buffer of ``max_size`` slots per stream, where the token at position
    ``p`` of stream ``b`` goes to slot ``(p - phase[b]) % max_size``, as in
    the stream's own cache, so each stream reads the rows, in the order,
    that it reads alone. ``make_mask`` hides the slots a stream has not
    written. A single-token write goes to each stream's slot; a longer one
    (a prompt chunk) returns each stream's window in order followed by the
    new rows, as mlx-vlm's concatenation does, and keeps their last
    ``max_size``. A verify pass writes into new arrays; ``rollback`` brings
    back, per stream, its window as of its last kept token (a pass may be a
    right-padded prompt chunk, longer than the window)."""

    exact_chunks = True  # (``decoder.Decoder.chunks``: the compressors' need)

    def __init__(self, max_size: int, lengths: Sequence[int], phase: Sequence[int]):
        self.max_size = max_size
        self.lengths, self.phase = list(lengths), list(phase)
        self.keys: Optional[mx.array] = None
        self.values: Optional[mx.array] = None
        self._start: Optional[tuple] = None  # (keys, values, lengths) before a pass
        self._rows: Optional[list] = None  # the (keys, values) the pass wrote

    @property
    def offset(self):
        if len(set(self.lengths)) <= 1:
            return self.lengths[0] if self.lengths else 0
        return mx.array(self.lengths, dtype=mx.int32)

    @property
    def verifying(self) -> bool:
        return self._start is not None

    def _slots(self, T: int, first: Sequence[int]) -> np.ndarray:
        """``[B, T]``: the slots of positions ``first[b] + t``."""
        pos = np.array(first)[:, None] + np.arange(T)[None]
        return (pos - np.array(self.phase)[:, None]) % self.max_size

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        B, _, T, _ = keys.shape
        W = self.max_size
        if self.keys is None:
            self.keys = mx.zeros((B, 1, W, keys.shape[3]), keys.dtype)
            self.values = mx.zeros((B, 1, W, values.shape[3]), values.dtype)
        old = (self.keys, self.values)
        if self._rows is not None:
            self._rows.append((keys, values))
        m = min(T, W)  # the rows that stay
        at = mx.array(self._slots(m, [n + T - m for n in self.lengths]))[:, None, :, None]
        self.keys = mx.put_along_axis(self.keys, at, keys[..., T - m :, :], axis=2)
        self.values = mx.put_along_axis(self.values, at, values[..., T - m :, :], axis=2)
        first = list(self.lengths)
        self.lengths = [n + T for n in self.lengths]
        if T == 1:
            return self.keys, self.values
        # each stream's window before the chunk, in order, then the chunk
        order = mx.array(self._slots(W, [n - W for n in first]))[:, None, :, None]
        return tuple(
            mx.concatenate([mx.take_along_axis(a, order, axis=2), new], axis=2)
            for a, new in zip(old, (keys, values))
        )

    def make_mask(self, N: int, return_array: bool = False, window_size=None, **_):
        """The keys ``update_and_fetch`` returns for ``N`` tokens that each
        query sees: the written slots (one token), or, over the window in
        order and the chunk, the window's last ``max_size`` positions."""
        W, n = self.max_size, np.array(self.lengths)
        if N == 1:  # (never None: mlx-vlm drops the pools' mask where it is)
            return mx.array(np.arange(W)[None] <= n[:, None])[:, None, None, :]
        t = np.arange(N)[:, None]
        old = np.arange(W)[None]  # position n - W + j
        seen_old = (old > t)[None] & (old >= (W - n)[:, None, None])
        u = np.arange(N)[None]
        seen_new = np.broadcast_to((u <= t) & (u > t - W), (len(n), N, N))
        return mx.array(np.concatenate([seen_old, seen_new], axis=-1))[:, None]

    def start_verify(self) -> None:
        self._start = (self.keys, self.values, list(self.lengths))
        self._rows = []

    def rollback(self, n: Counts) -> None:
        start, rows = self._start, self._rows
        self._start = self._rows = None
        n = per_stream(n, len(self.lengths))
        if not any(n):
            return
        if start is None:
            raise RuntimeError(f"cannot roll back {max(n)} tokens outside a verify pass")
        keys, values, before = start
        verified = self.lengths[0] - before[0]
        _check(max(n), verified)
        # slot s of stream b holds its latest kept position p = s (mod W, by
        # phase): a row of the pass where p is past ``before``, else the slot
        # as the pass found it
        W = self.max_size
        end = np.array(self.lengths) - np.array(n)
        lag = (end[:, None] - 1 - np.array(self.phase)[:, None] - np.arange(W)) % W
        row = (end[:, None] - 1 - lag) - np.array(before)[:, None]
        from_pass = mx.array(row >= 0)[:, None, :, None]
        at = mx.array(np.clip(row, 0, verified - 1))[:, None, :, None]
        new_k = mx.concatenate([k for k, _ in rows], axis=2)
        new_v = mx.concatenate([v for _, v in rows], axis=2)
        if keys is None:
            keys, values = mx.zeros_like(self.keys), mx.zeros_like(self.values)
        self.keys = mx.where(from_pass, mx.take_along_axis(new_k, at, axis=2), keys)
        self.values = mx.where(from_pass, mx.take_along_axis(new_v, at, axis=2), values)
        self.lengths = end.tolist()

    def is_trimmable(self) -> bool:
        return False

    @classmethod
    def merge(cls, caches: Sequence[RotatingKVCache]) -> "BatchWindowCache":
        W = caches[0].max_size
        slots = [_window_slots(c) for c in caches]
        out = cls(W, [c.offset for c in caches], [p for _, p in slots])
        like = next((kv for kv, _ in slots if kv is not None), None)
        if like is not None:

            def rows(kv, i):
                if kv is not None:
                    return kv[i]
                return mx.zeros((1, 1, W, like[i].shape[3]), like[i].dtype)

            out.keys = mx.concatenate([rows(kv, 0) for kv, _ in slots])
            out.values = mx.concatenate([rows(kv, 1) for kv, _ in slots])
        return out

    def extend(self, other: "BatchWindowCache") -> None:
        if self.keys is None and other.keys is not None:
            self.keys = mx.zeros((len(self.lengths), *other.keys.shape[1:]), other.keys.dtype)
            self.values = mx.zeros(
                (len(self.lengths), *other.values.shape[1:]), other.values.dtype
            )
        if self.keys is not None:
            if other.keys is None:
                B = len(other.lengths)
                ok = mx.zeros((B, *self.keys.shape[1:]), self.keys.dtype)
                ov = mx.zeros((B, *self.values.shape[1:]), self.values.dtype)
            else:
                ok, ov = other.keys, other.values
            self.keys = mx.concatenate([self.keys, ok])
            self.values = mx.concatenate([self.values, ov])
        self.lengths += other.lengths
        self.phase += other.phase

    def filter(self, keep: Sequence[int]) -> None:
        self.lengths = [self.lengths[i] for i in keep]
        self.phase = [self.phase[i] for i in keep]
        if self.keys is not None:
            if not keep:
                self.keys = self.values = None
                return
            idx = mx.array(list(keep), dtype=mx.int32)
            self.keys, self.values = self.keys[idx], self.values[idx]

    def extract(self, b: int, kind: type = RollbackWindowCache) -> RollbackWindowCache:
        """Stream ``b`` as its own cache, its slots as its decode laid them."""
        W = self.max_size
        c = kind(W)
        n = c.offset = self.lengths[b]
        if self.keys is not None and n:
            c.keys = mx.contiguous(self.keys[b : b + 1])
            c.values = mx.contiguous(self.values[b : b + 1])
            slot = (n - self.phase[b]) % W
            c._idx = W if n >= W and slot == 0 else (slot if n >= W else n)
        return c

    @property
    def state(self) -> list:
        return [] if self.keys is None else [self.keys, self.values]

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in self.state)


class WindowedKVCache(KVCache):
    """mlx-vlm's ``KVCache`` that keeps every row (the head's window is its
    mask's), with a batch form: ``batch_cache.RaggedKVCache``."""

    def blank(self) -> "WindowedKVCache":
        return type(self)()

    @classmethod
    def merge_batch(cls, caches: Sequence[Any]) -> RaggedKVCache:
        return RaggedKVCache.merge(caches)


def rollable(cache: Any) -> Any:
    """The rolling-back form of one of mlx-vlm's DeepSeek-V4 layer caches."""
    if type(cache) is RotatingKVCache:
        return RollbackWindowCache(cache.max_size, cache.keep)
    if type(cache) is PoolingCache:
        return RollbackPoolingCache(cache.ratio)
    if type(cache) is CacheList:
        return RollbackCacheList(*(rollable(c) for c in cache.caches))
    return cache


def patch_trunk(model: nn.Module) -> None:
    """Make ``model.make_cache`` (mlx-vlm's DeepSeek-V4 language model) hand
    out caches that roll back. Calling it twice changes nothing."""
    base = type(model)
    if getattr(base, "_mtp_rolls_back_windows", False):
        return

    def make_cache(self) -> List[Any]:
        return [rollable(c) for c in base.make_cache(self)]

    model.__class__ = type(
        base.__name__,
        (base,),
        {"make_cache": make_cache, "_mtp_rolls_back_windows": True},
    )
