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

from typing import Any, List, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_vlm.models.cache import CacheList, PoolingCache, RotatingKVCache


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
