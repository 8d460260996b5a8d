"""Pieces several head families share: trunk caches that roll back, windowed blocks.

mlx-lm gives sliding-window layers a ``RotatingKVCache``, which can no longer
drop its last tokens once it has wrapped (``is_trimmable`` turns false past
the window), and MLA layers with a sparse indexer (DeepSeek-V3.2, GLM-5) or a
two-attention layer (LongCat-Flash) a ``CacheList``, which has no ``offset``.
``rollback_caches(model)`` swaps both for caches that roll back: a plain
``KVCache`` whose masks apply the window (the same attention; a sliding
layer then keeps its whole history, the price of exact rollback) and an
``OffsetCacheList``.
"""

from typing import Any, List, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import CacheList, KVCache, RotatingKVCache


class OffsetCacheList(CacheList):
    """mlx-lm's ``CacheList`` reporting its first cache's offset and mask."""

    @property
    def offset(self) -> int:
        return self.caches[0].offset

    def make_mask(self, *args, **kwargs):
        return self.caches[0].make_mask(*args, **kwargs)


def _rollable(cache: Any) -> Any:
    if isinstance(cache, RotatingKVCache):
        return KVCache()
    if type(cache) is CacheList:
        return OffsetCacheList(*(_rollable(c) for c in cache.caches))
    return cache


def rollback_caches(model: nn.Module) -> None:
    """Make ``model.make_cache`` hand out caches that roll back (see module doc)."""
    base = type(model)
    if getattr(base, "_mtp_rollable", False) or not hasattr(base, "make_cache"):
        return  # without make_cache mlx-lm gives every layer a KVCache

    def make_cache(self) -> List[Any]:
        return [_rollable(c) for c in base.make_cache(self)]

    model.__class__ = type(
        base.__name__, (base,), {"make_cache": make_cache, "_mtp_rollable": True}
    )


def windowed(block: nn.Module, window: Optional[int]) -> nn.Module:
    """``block`` with its attention limited to the last ``window`` positions.

    The head hands its block a plain causal mask; a sliding-window MTP layer
    (MiMo-V2, Step-3.5's sliding layers) needs the window in it. The block
    keeps its class's parameters and names, so checkpoints load unchanged.
    """
    if not window:
        return block
    base = type(block)

    class Windowed(base):
        def __call__(self, x: mx.array, mask: Any = None, cache: Any = None):
            mask = create_attention_mask(
                x, cache, window_size=self.mtp_window, return_array=True
            )
            return base.__call__(self, x, mask, cache)

    Windowed.__name__ = base.__name__
    block.__class__ = Windowed
    block.mtp_window = int(window)
    return block


class Depth(nn.Module):
    """Layer ``j`` of an ``mtp.layers`` list that the heads of all depths share.

    Qwen3-Next/3.5 and EXAONE-MoE keep one ``fc``, its norms and the closing
    norm for all their MTP layers (``mtp.{fc, norm, layers.j}``) and draft depth
    ``j + 1`` with layer ``j`` (vLLM ``qwen3_5_mtp.py``, ``exaone_moe_mtp.py``:
    ``layers[step % n]``). Each depth's head holds the shared modules and the
    whole list, so every head loads the one ``mtp.`` prefix; the arrays exist
    once.
    """

    def __init__(self, layers: List[nn.Module], j: int):
        super().__init__()
        self.layers = layers
        self.depth = j

    def __call__(self, x: mx.array, mask: Any, cache: Any) -> mx.array:
        return self.layers[self.depth](x, mask, cache)
