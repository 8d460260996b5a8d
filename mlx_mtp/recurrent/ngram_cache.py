"""LongCat-Flash-Ngram's n-gram context, rolled back after a verify pass.

mlx-lm 0.32's ``longcat_flash_ngram.NgramEmbedding`` hashes each token with
the ``emb_neighbor_num - 1`` tokens before it, and keeps those last tokens in
the model's first cache, an ``ArraysCache(1)``: a window over the input
tokens, as a conv layer keeps its last inputs. A forward replaces it with the
last ``n - 1`` tokens of ``[window, new tokens]``, so the tokens a rollback
must return to are gone.

``KeepNgramContext`` records, during a verify pass, ``[window, new tokens]``
as a window slot of a ``KeepStatesCache``; ``rollback(n)`` then sets the
window ending at the last kept token (batches: ``BatchStatesCache``, per
stream). The window is held at its full ``n - 1`` tokens, zeros before the
first token, so that the kept sequence is ``n - 1`` tokens longer than the
pass however short the history: mlx-lm's hash shifts zeros in for tokens
that are not there, so the ids, and the output, are the same.

Batches: the window of each stream is a row of a ``BatchStatesCache`` (its
own history: the hash reads only its row), rolled back per stream; the
layers' ``CacheList``s are ``BatchableCacheList``s, whose batch form
(``batch_cache.BatchCacheList``) holds each attention's ``RaggedKVCache``:
mlx-lm's layers read the per-stream offsets and masks unchanged (RoPE takes
one offset per stream, the mask comes from the first layer's first cache).
So the trunk runs every stream in one forward.
"""

from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn

from ..batch_cache import BatchCacheList
from ..heads.common import OffsetCacheList, rollback_caches
from .keep_states import KeepStatesCache, install


class KeepNgramContext:
    """Mixin over mlx-lm's ``NgramEmbedding``: its window is kept for rollback."""

    def __call__(self, input_ids: mx.array, cache: Optional[Any] = None) -> mx.array:
        if not isinstance(cache, KeepStatesCache):
            return super().__call__(input_ids, cache)
        window = self.n - 1
        old = cache[0]
        if old is None:
            old = mx.zeros((input_ids.shape[0], window), dtype=mx.int64)
        elif old.shape[-1] < window:  # a history shorter than the window
            old = mx.pad(old, [(0, 0), (window - old.shape[-1], 0)])
        cache[0] = old
        out = super().__call__(input_ids, cache)
        if cache.verifying:
            seq = mx.concatenate([old, input_ids.astype(old.dtype)], axis=-1)
            cache.keep_window(0, seq, window)
        return out


class BatchableCacheList(OffsetCacheList):
    """An ``OffsetCacheList`` with a batch form (``merge_batch``): LongCat-Flash's
    attention layers take ragged batch caches as they take ``KVCache``s."""

    @classmethod
    def merge_batch(cls, caches) -> BatchCacheList:
        return BatchCacheList.merge(caches)


def patch_trunk(model: nn.Module) -> None:
    """Give a LongCat-Flash-Ngram model caches that roll back and batch: its
    two-attention layers' ``CacheList``s report an offset (``rollback_caches``)
    and merge into a batch (``BatchableCacheList``), its n-gram window is a
    ``KeepStatesCache``. Calling it twice changes nothing."""
    rollback_caches(model)
    install(model, [_ngram(model)], KeepNgramContext, KeepStatesCache)
    base = type(model)
    if getattr(base, "_batches_lists", False):
        return

    def make_cache(self) -> list:
        return [
            BatchableCacheList(*c.caches) if type(c) is OffsetCacheList else c
            for c in base.make_cache(self)
        ]

    model.__class__ = type(
        base.__name__, (base,), {"make_cache": make_cache, "_batches_lists": True}
    )


def _ngram(model: nn.Module) -> nn.Module:
    return model.model.ngram_embeddings

