"""Lightning-attention layers (Ling's hybrid) whose cache can roll back a verify pass.

A ``bailing_hybrid`` linear-attention layer caches one recurrent state
``h [B, H, K, V]`` (no convolution): per token ``h = h exp(g) + k^T v`` and
``y = (q scale) h``, with a constant per-head decay ``g``. During a verify pass
the layer runs mlx-lm's code with ``recurrent_gla_keep`` in place of
``recurrent_gla`` and keeps the state after every token in a
``LightningCache``; ``rollback(n)`` picks the one after the last kept token.

mlx-lm has no kernel for this recurrence (its multi-token path is chunked
matmuls, its one-token path plain MLX), so the keep op is pure MLX: mlx-lm's
own one-token step, run token by token.
"""

from typing import Any, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.bailing_hybrid import _recurrent_gla_step

from .keep_states import KeepStatesCache, install, verify_cache


class LightningCache(KeepStatesCache):
    """``[recurrent state]`` that can roll back a verify pass."""

    def __init__(self, size: int = 1, left_padding: Optional[List[int]] = None):
        super().__init__(size, left_padding)


def recurrent_gla_keep(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    *,
    scale: float,
    h: Optional[mx.array] = None,
    mask: Optional[mx.array] = None,
) -> Tuple[mx.array, mx.array, mx.array]:
    """mlx-lm's ``recurrent_gla`` over T tokens, also returning every state.

    ``q``, ``k`` ``[B, H, T, K]``, ``v`` ``[B, H, T, V]``, ``g`` ``[H]``, ``h``
    ``[B, H, K, V]`` or None for float32 zeros, ``mask`` ``[B, T]`` bool.
    Returns ``(y [B, H, T, V], final h, states [B, T, H, K, V])`` where
    ``states[:, t]`` is the state after token ``t``. Each token is mlx-lm's
    one-token step; a masked token outputs 0 and leaves the state as it was.
    """
    B, H, T, K = q.shape
    if h is None:
        h = mx.zeros((B, H, K, v.shape[-1]), dtype=mx.float32)
    exp_g = mx.exp(g)[:, None, None].astype(h.dtype)
    ys, states = [], []
    for t in range(T):
        p = slice(t, t + 1)
        y, h_t = _recurrent_gla_step(
            q[:, :, p] * scale, k[:, :, p], v[:, :, p], h, exp_g
        )
        if mask is not None:
            keep = mask[:, t][:, None, None, None]
            y, h_t = mx.where(keep, y, 0), mx.where(keep, h_t, h)
        h = h_t
        ys.append(y)
        states.append(h)
    return mx.concatenate(ys, axis=2), h, mx.stack(states, axis=1)


class KeepStatesLightning:
    """Mixin over mlx-lm's bailing_hybrid ``LinearAttention``: keeps states."""

    def __call__(self, x, mask=None, cache: Any = None, offset: int = 0):
        if verify_cache(cache) is None:
            return super().__call__(x, mask, cache, offset=offset)
        B, L, _ = x.shape
        qkv = self.query_key_value(x).reshape(
            B, L, self.num_attention_heads + 2 * self.num_key_value_heads, -1
        )
        q, k, v = mx.split(
            qkv,
            [
                self.num_attention_heads,
                self.num_attention_heads + self.num_key_value_heads,
            ],
            axis=2,
        )
        q, k, v = (t.transpose(0, 2, 1, 3) for t in (q, k, v))
        if self.use_qk_norm:
            q, k = self.query_layernorm(q), self.key_layernorm(k)
        q, k = self.rope(q, offset=offset), self.rope(k, offset=offset)
        out, cache[0], states = recurrent_gla_keep(
            q, k, v, self._slope, scale=self.scale, h=cache[0], mask=mask
        )
        cache.keep_states(0, states)
        cache.advance(L)
        out = out.transpose(0, 2, 1, 3).reshape(B, L, -1)
        out = self.g_norm(out) * mx.sigmoid(self.g_proj(x))
        return self.dense(out)


def patch_trunk(model: nn.Module) -> None:
    """Give a bailing_hybrid model's linear layers rollback: ``LightningCache``."""
    linear = [layer.attention for layer in model.layers if not layer.is_global]
    install(model, linear, KeepStatesLightning, LightningCache)
