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

``patch_trunk(model)`` makes mlx-vlm's language model hand these out.
"""

from typing import Any, List

import mlx.nn as nn
from mlx_vlm.models.cache import CacheList
from mlx_vlm.models.hy_v4.cache import HyV4KVCache


class HyV4CacheList(CacheList):
    """mlx-vlm's ``CacheList`` reporting its latent cache's offset and mask."""

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
