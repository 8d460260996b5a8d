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


_SUMMED: dict = {}


def summed(module: nn.Module, group: Any) -> None:
    """``module``, one process's part of a tensor-split branch (an attention
    or MLP whose last projection holds a slice of its inputs), made to
    ``all_sum`` its output over ``group``: its class swapped for a subclass,
    as mlx-vlm's ``sharding_group`` does in the models that have one (its
    parameters and names unchanged; ``sharding_group = None`` skips the sum)."""
    base = type(module)
    if not getattr(base, "_mtp_summed", False):
        if base not in _SUMMED:

            def __call__(self, *args, **kwargs):
                out = base.__call__(self, *args, **kwargs)
                if self.sharding_group is None:
                    return out
                return mx.distributed.all_sum(out, group=self.sharding_group)

            _SUMMED[base] = type(
                base.__name__, (base,), {"__call__": __call__, "_mtp_summed": True}
            )
        module.__class__ = _SUMMED[base]
    module.sharding_group = group


def split_layer(attn: nn.Module, mlps, group: Any, gate: Optional[str] = None) -> None:
    """Tensor-split one decoder layer of the plain kind over ``group`` (lazy
    weights): ``attn``'s q/k/v projections (and a per-head ``gate``
    projection) by heads, its ``o_proj`` by its inputs, and each module of
    ``mlps`` (a dense MLP, a ``SwitchGLU`` of experts, a shared expert) by its
    width, mlx-lm's split of such layers, modules kept of their classes."""
    from mlx.nn.layers.distributed import shard_inplace

    names = ("q_proj", "k_proj", "v_proj") + ((gate,) if gate else ())
    for name in names:
        shard_inplace(getattr(attn, name), "all-to-sharded", group=group)
    rows_in(attn.o_proj, group)
    split_layer_mlps(mlps, group)


def split_layer_mlps(mlps, group: Any) -> None:
    """Each gated MLP of ``mlps`` (``gate_proj``, ``up_proj``, ``down_proj``:
    a dense MLP, a ``SwitchGLU`` of experts, a shared expert) split by its
    width over ``group``; their outputs are summed over the processes after."""
    from mlx.nn.layers.distributed import shard_inplace

    for mlp in mlps:
        shard_inplace(mlp.gate_proj, "all-to-sharded", group=group)
        shard_inplace(mlp.up_proj, "all-to-sharded", group=group)
        rows_in(mlp.down_proj, group)


def rows_in(linear: nn.Module, group: Any) -> None:
    """``linear`` split by its inputs over ``group`` (its outputs are summed
    over the processes after): a bias stays on process 0 only, added once."""
    from mlx.nn.layers.distributed import shard_inplace

    shard_inplace(linear, "sharded-to-all", group=group)
    if group.rank() and "bias" in linear:
        linear.bias = mx.zeros_like(linear.bias)
