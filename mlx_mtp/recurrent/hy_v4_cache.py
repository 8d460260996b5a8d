"""Rollback for Hunyuan-V4's (``hy_v4``) caches, as mlx-vlm 0.7.10 makes them.

Every ``hy_v4`` layer attends through a ``CacheList`` (``models/cache.py``)
of ``HyV4KVCache``s (``models/hy_v4/cache.py``): the MLA latent with its
rope keys, and, on layers whose ``indexer_types`` entry is ``"full"``, the
sparse indexer's keys (``models/hy_v4/indexer.py``: roped ``wk`` projections
written with zero-width values). A ``"shared"`` layer reuses the previous
layer's top-k indices and keeps the latent alone. Both caches hold one row
per token and nothing pooled or recurrent: the indexer scores its keys anew
at every forward, so dropping the last ``n`` rows of each (``trim``) is the
state of a decode that never read them. What mlx-vlm's ``CacheList`` lacks
is the count the runtime reads (``offset``, for positions and bookkeeping)
and the mask a head asks of its cache; ``HyV4CacheList`` adds both.

Its batch form (``BatchHyV4CacheList``, ``batch_cache.merge``'s
``merge_batch`` hook) holds each member as a ``batch_cache.RaggedKVCache``:
every stream at its own length, its per-stream offsets handed to mlx-vlm's
RoPE and its masks to the attention and the indexer, each stream rolled back
by its own count. mlx-vlm's layers run it unchanged: a stream with fewer keys
than the indexer's top-k, in a batch where another has more, has its masked
keys picked too, and its mask keeps them out (what it attends to is all its
keys, as alone).

``patch_trunk(model)`` makes mlx-vlm's language model hand these out.
"""

from typing import Any, List, Optional, Sequence

import mlx.nn as nn
from mlx_lm.models.cache import KVCache as LMKVCache
from mlx_vlm.models.cache import CacheList
from mlx_vlm.models.hy_v4.cache import HyV4KVCache

from ..batch_cache import RaggedKVCache


class HyV4CacheList(CacheList):
    """mlx-vlm's ``CacheList`` reporting its latent cache's offset and mask."""

    # its ``merge_batch`` makes its members' batch forms itself
    # (``BatchHyV4CacheList``): ``batch_cache.batchable`` need not ask them
    merges_members = True

    @property
    def offset(self) -> int:
        return self.caches[0].offset

    def make_mask(self, *args, **kwargs):
        return self.caches[0].make_mask(*args, **kwargs)

    def trim(self, n: int) -> int:
        trimmed = {c.trim(n) for c in self.caches}
        if len(trimmed) != 1:  # the latent and indexer rows are one per token
            raise RuntimeError(f"hy_v4 caches trimmed unevenly: {sorted(trimmed)}")
        return trimmed.pop()

    @staticmethod
    def merge_batch(caches: Sequence["HyV4CacheList"]) -> "BatchHyV4CacheList":
        return BatchHyV4CacheList.merge(caches)


def _plain(c: HyV4KVCache) -> LMKVCache:
    """``c``'s tokens as mlx-lm's ``KVCache`` (what ``RaggedKVCache`` merges)."""
    p = LMKVCache()
    if c.keys is not None and c.offset:
        p.keys, p.values = c.keys[..., : c.offset, :], c.values[..., : c.offset, :]
        p.offset = c.offset
    return p


class BatchHyV4CacheList(CacheList):
    """``HyV4CacheList`` of several streams: each member a ``RaggedKVCache``."""

    def __init__(self, *caches: RaggedKVCache, kinds: Sequence[type] = ()):
        super().__init__(*caches)
        self.kinds = list(kinds) or [HyV4KVCache] * len(caches)

    @property
    def offset(self):
        return self.caches[0].offset

    @property
    def lengths(self) -> List[int]:
        return self.caches[0].lengths

    def make_mask(self, *args, **kwargs):
        return self.caches[0].make_mask(*args, **kwargs)

    def rollback(self, n) -> None:
        for c in self.caches:
            c.rollback(n)

    def trim(self, n: int) -> int:
        self.rollback(n)
        return n

    def is_trimmable(self) -> bool:
        return True

    @classmethod
    def merge(cls, caches: Sequence[HyV4CacheList]) -> "BatchHyV4CacheList":
        members = zip(*(c.caches for c in caches))
        kinds = [type(c) for c in caches[0].caches]
        return cls(*(RaggedKVCache.merge([_plain(c) for c in m]) for m in members),
                   kinds=kinds)  # fmt: skip

    def extend(self, other: "BatchHyV4CacheList") -> None:
        for c, o in zip(self.caches, other.caches):
            c.extend(o)

    def filter(self, keep: Sequence[int]) -> None:
        for c in self.caches:
            c.filter(keep)

    def extract(self, b: int, like: Optional[type] = None) -> HyV4CacheList:
        """Stream ``b`` as a single-stream ``HyV4CacheList`` (its own copy)."""
        out = []
        for c, kind in zip(self.caches, self.kinds):
            one, plain = kind(), c.extract(b)
            if plain.keys is not None:
                one.keys, one.values, one.offset = plain.keys, plain.values, plain.offset
            out.append(one)
        return (like or HyV4CacheList)(*out)

    @property
    def state(self) -> List[Any]:
        return [x for c in self.caches for x in c.state]

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.caches)


def head_cache() -> List[Any]:
    """The MTP layer's cache: latent and indexer keys (its layer is "full")."""
    return [HyV4CacheList(HyV4KVCache(), HyV4KVCache())]


def _rollable(cache: Any) -> Any:
    if type(cache) is CacheList:
        return HyV4CacheList(*(type(c)() for c in cache.caches))
    return cache


def patch_trunk(model: nn.Module) -> None:
    """Make ``model.make_cache`` (mlx-vlm's ``hy_v4`` language model) hand out
    ``HyV4CacheList``s. Calling it twice changes nothing."""
    base = type(model)
    if getattr(base, "_mtp_hy_v4_rollable", False):
        return

    def make_cache(self) -> List[Any]:
        return [_rollable(c) for c in base.make_cache(self)]

    model.__class__ = type(
        base.__name__, (base,), {"make_cache": make_cache, "_mtp_hy_v4_rollable": True}
    )
