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
- ``RollbackPoolingCache`` (a compressor): the pass's projected rows reach it
  through mlx-vlm's own hook (``_record_speculative_inputs``, called by
  ``accumulate_windows``); ``rollback(n)`` keeps the groups the kept tokens
  closed (each group is pooled from its own rows: those are the groups a
  decode of the kept tokens pools) and reopens the group they end in with its
  rows: the partial block a decode that never saw the dropped tokens holds.
- ``RollbackCacheList`` passes both calls to its caches.

Nothing is recomputed; outside a pass the caches are mlx-vlm's, unchanged.
``mark`` / ``restore`` copy the arrays that are written into.
``patch_trunk(model)`` makes the language model hand out these caches.
"""

from typing import Any, List, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_vlm.models.cache import CacheList, PoolingCache, RotatingKVCache


def _copy(a: Optional[mx.array]) -> Optional[mx.array]:
    return None if a is None else mx.array(a)


def _open_block(parts: list, lo: int, hi: int, ratio: int) -> mx.array:
    """Rows ``lo:hi`` of ``parts`` joined, zero-padded to a block of ``ratio``
    (the buffer's slots past the open rows are never read)."""
    rows = mx.concatenate([p for p in parts if p is not None], axis=1)[:, lo:hi]
    pad = mx.zeros((rows.shape[0], ratio - rows.shape[1], rows.shape[2]), rows.dtype)
    return mx.concatenate([rows, pad], axis=1)


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
        self.keys, self.values = _copy(self.keys), _copy(self.values)

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
        return (_copy(self.keys), _copy(self.values), self.offset, self._idx)

    def restore(self, mark: tuple) -> None:
        self._start = self._rows = None
        keys, values, self.offset, self._idx = mark
        self.keys, self.values = _copy(keys), _copy(values)


class RollbackPoolingCache(PoolingCache):
    """mlx-vlm's ``PoolingCache`` (a compressor's groups and open block) that
    rolls back a verify pass."""

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
        self.buf_kv, self.buf_gate = _copy(self.buf_kv), _copy(self.buf_gate)

    def _record_speculative_inputs(self, kv, gate):
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
        _check(n, verified)
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
        return (_copy(self.buf_kv), _copy(self.buf_gate), self.remainder, self.pooled)

    def restore(self, mark: tuple) -> None:
        self._start = self._rows = None
        buf_kv, buf_gate, self.remainder, self.pooled = mark
        self.buf_kv, self.buf_gate = _copy(buf_kv), _copy(buf_gate)


class RollbackCacheList(CacheList):
    """A compressed layer's caches (window, compressors), rolled back together."""

    @property
    def offset(self) -> int:
        return self.caches[0].offset

    @property
    def verifying(self) -> bool:
        return self.caches[0].verifying

    def start_verify(self) -> None:
        for c in self.caches:
            c.start_verify()

    def rollback(self, n: int) -> None:
        for c in self.caches:
            c.rollback(n)

    def is_trimmable(self) -> bool:
        return False

    def mark(self) -> tuple:
        return tuple(c.mark() for c in self.caches)

    def restore(self, mark: tuple) -> None:
        for c, m in zip(self.caches, mark):
            c.restore(m)


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
