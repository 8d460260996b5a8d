"""Rollback for the caches of language models that mlx-vlm runs (Qwen3.8-Flash-Next).

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

``patch_trunk(model)`` makes mlx-vlm's language model hand out both.
"""

from typing import Any, List

import mlx.core as mx
import mlx.nn as nn
from mlx_vlm.models.cache import ArraysCache as VLMArraysCache
from mlx_vlm.models.qwen4_exp.language import QSAKVCache

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


class RollbackQSACache(QSAKVCache):
    """``QSAKVCache`` whose ``trim`` keeps the block summaries still complete."""

    def trim(self, n):
        blocks, ratio = self.index_block_keys, self.index_block_ratio
        n = super().trim(n)
        if blocks is not None and ratio:
            kept = self.offset // ratio
            if kept:
                self.index_block_keys = blocks[:, :, :kept]
                self.index_block_ratio = ratio
        return n


def _rollable(cache: Any) -> Any:
    if type(cache) is VLMArraysCache:
        return VerifyArraysCache(len(cache.cache))
    if type(cache) is QSAKVCache:
        return RollbackQSACache()
    return cache


def patch_trunk(model: nn.Module) -> None:
    """Make ``model.make_cache`` (mlx-vlm's language model) hand out caches
    that roll back. Calling it twice changes nothing."""
    base = type(model)
    if getattr(base, "_mtp_vlm_rollable", False):
        return

    def make_cache(self) -> List[Any]:
        return [_rollable(c) for c in base.make_cache(self)]

    model.__class__ = type(
        base.__name__, (base,), {"make_cache": make_cache, "_mtp_vlm_rollable": True}
    )
