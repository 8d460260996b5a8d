"""Gated-delta-net layers whose cache can roll back a verify pass.

A GDN layer's cache is ``[conv window, recurrent state]``. During a verify pass
the layer runs mlx-lm's code with ``gated_delta_keep`` (the state after every
token) in place of ``gated_delta_update`` and keeps, through the generic
``KeepStatesCache``, the conv inputs it read and those states; ``rollback(n)``
picks the ones after the last kept token (docs/design.md section 6). Outside a
verify pass the layers run mlx-lm's own code.

``patch_trunk(model)`` installs both on an mlx-lm Qwen3-Next / Qwen3.5 model:
its linear-attention layers get the keep-states subclass of their own class and
``make_cache`` hands out ``GDNCache`` where mlx-lm would hand out ``ArraysCache``.
"""

from typing import Any, List, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.gated_delta import normalize_qk

from .gated_delta import gated_delta_update_keep
from .keep_states import KeepStatesCache, conv_with_window, install, verify_cache


class GDNCache(KeepStatesCache):
    """``[conv window, recurrent state]`` that can roll back a verify pass."""

    def __init__(self, size: int = 2, left_padding: Optional[List[int]] = None):
        super().__init__(size, left_padding)


class KeepStatesGatedDelta:
    """Mixin over mlx-lm's GatedDeltaNet classes: keeps states during a verify pass.

    The verify path is mlx-lm's ``__call__`` for a batch without ``lengths``,
    with ``gated_delta_update_keep`` in place of ``gated_delta_update``.
    """

    def __call__(self, inputs: mx.array, mask=None, cache: Any = None) -> mx.array:
        if verify_cache(cache) is None:
            return super().__call__(inputs, mask, cache)
        if getattr(self, "sharding_group", None):
            raise NotImplementedError("verify with sharding")
        B, S, _ = inputs.shape
        qkv, z, b, a = self._project(inputs)
        window = self.conv_kernel_size - 1
        conv_out = nn.silu(conv_with_window(cache, 0, self.conv1d, qkv, window, mask))
        q, k, v = [
            t.reshape(B, S, h, d)
            for t, h, d in zip(
                mx.split(conv_out, [self.key_dim, 2 * self.key_dim], -1),
                [self.num_k_heads, self.num_k_heads, self.num_v_heads],
                [self.head_k_dim, self.head_k_dim, self.head_v_dim],
            )
        ]
        q, k = normalize_qk(q, k, inv_scale=self.head_k_dim**-0.5, eps=1e-6)
        out, state, states = gated_delta_update_keep(
            q, k, v, a, b, self.A_log, self.dt_bias, cache[1], mask,
            use_kernel=not self.training,
        )  # fmt: skip
        cache.keep_states(1, states)
        cache[1] = state
        cache.advance(S)
        out = self.norm(out, z)
        return self.out_proj(out.reshape(B, S, -1))

    def _project(self, x: mx.array):
        """Conv inputs ``[B, S, C]``, gate ``z`` ``[B, S, Hv, Dv]``, ``b``, ``a``."""
        B, S, _ = x.shape
        if "in_proj_qkvz" in self:  # Qwen3-Next: interleaved per key head
            q, k, v, z, b, a = self.fix_query_key_value_ordering(
                self.in_proj_qkvz(x), self.in_proj_ba(x)
            )
            qkv = mx.concatenate(
                [q.reshape(B, S, -1), k.reshape(B, S, -1), v.reshape(B, S, -1)], -1
            )
            return qkv, z, b, a
        z = self.in_proj_z(x).reshape(B, S, self.num_v_heads, self.head_v_dim)
        return self.in_proj_qkv(x), z, self.in_proj_b(x), self.in_proj_a(x)


def patch_trunk(model: nn.Module) -> None:
    """Give ``model``'s GDN layers rollback: keep-states layers and ``GDNCache``."""
    linear = [m.linear_attn for m in model.layers if getattr(m, "is_linear", False)]
    install(model, linear, KeepStatesGatedDelta, GDNCache)
