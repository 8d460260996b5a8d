"""Kimi delta attention layers whose cache can roll back a verify pass.

Three mlx-lm classes run Kimi delta attention (KDA): three short convolutions
(q, k, v) and a gated delta rule with per-key gates.

- Kimi-Linear's ``KimiDeltaAttention`` caches ``[q window, k window, v window,
  state]`` in an ``ArraysCache(4)``;
- Kimi-K3's ``KimiK3DeltaAttention`` joins the projections and convolutions
  (``qkv_proj``, ``qkv_conv``), caches ``[qkv window, state]`` in an
  ``ArraysCache(2)`` and bounds its gates (``gate_lower_bound``);
- Ling-3's ``BailingKDA`` (mlx-lm ``bailing_moe_v3``) caches as Kimi-Linear
  does, with plain ``nn.Conv1d`` convolutions and bounded gates.

During a verify pass each runs mlx-lm's code with ``gated_delta_update_keep``
(``gated_delta.py``, the same op with per-key gates) in place of
``gated_delta_update`` and keeps the conv inputs and the state after every
token in a ``KDACache``; ``rollback(n)`` picks the ones after the last kept
token. Outside a verify pass mlx-lm's own code runs.
"""

from typing import Any, List, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.gated_delta import normalize_qk

from .gated_delta import gated_delta_update_keep
from .keep_states import KeepStatesCache, conv_with_window, install, verify_cache


class KDACache(KeepStatesCache):
    """Conv windows and the recurrent state (last) that can roll back a verify pass."""

    def __init__(self, size: int = 4, left_padding: Optional[List[int]] = None):
        super().__init__(size, left_padding)


def _delta_rule(layer, cache, q, k, v, a, b, mask, lower_bound=None) -> mx.array:
    """Normalize q, k; run the kept gated delta rule on the cache's last slot."""
    B, T, H, D = q.shape
    q, k = normalize_qk(q, k, inv_scale=D**-0.5, eps=1e-6)
    slot = len(cache.cache) - 1
    out, state, states = gated_delta_update_keep(
        q, k, v, a, b, layer.A_log.reshape(H, 1), layer.dt_bias.reshape(H, D),
        cache[slot], mask, use_kernel=not layer.training, lower_bound=lower_bound,
    )  # fmt: skip
    cache.keep_states(slot, states)
    cache[slot] = state
    cache.advance(T)
    return out


class KeepStatesKimiDelta:
    """Mixin over mlx-lm's ``KimiDeltaAttention``: keeps states in a verify pass."""

    def __call__(self, x: mx.array, mask=None, cache: Any = None) -> mx.array:
        if verify_cache(cache) is None:
            return super().__call__(x, mask, cache)
        B, T, _ = x.shape
        H, D, window = self.num_heads, self.head_dim, self.conv_kernel - 1
        convs = [(self.q_proj, self.q_conv), (self.k_proj, self.k_conv),
                 (self.v_proj, self.v_conv)]  # fmt: skip
        q, k, v = [
            nn.silu(conv_with_window(cache, i, c.conv, p(x), window, mask))
            for i, (p, c) in enumerate(convs)
        ]
        q, k, v = (t.reshape(B, T, H, D) for t in (q, k, v))
        a = self.f_b_proj(self.f_a_proj(x)).reshape(B, T, H, D)
        out = _delta_rule(self, cache, q, k, v, a, self.b_proj(x), mask)
        gate = self.g_b_proj(self.g_a_proj(x)).reshape(B, T, H, D)
        out = self.o_norm(out.reshape(B, T, H, D)) * mx.sigmoid(gate)
        return self.o_proj(out.reshape(B, T, -1))


class KeepStatesKimiK3Delta:
    """Mixin over mlx-lm's ``KimiK3DeltaAttention`` (joined q, k, v projection
    and convolution, bounded gates): keeps states in a verify pass."""

    def __call__(self, x: mx.array, mask=None, cache: Any = None) -> mx.array:
        if verify_cache(cache) is None:
            return super().__call__(x, mask, cache)
        B, T, _ = x.shape
        H, D, P = self.num_heads, self.head_dim, self.projection_dim
        qkv = conv_with_window(
            cache, 0, self.qkv_conv.conv, self.qkv_proj(x), self.conv_kernel - 1, mask
        )
        q, k, v = (
            t.reshape(B, T, H, D) for t in mx.split(nn.silu(qkv), [P, 2 * P], -1)
        )
        a = self.f_b_proj(self.f_a_proj(x)).reshape(B, T, H, D)
        out = _delta_rule(self, cache, q, k, v, a, self.b_proj(x), mask,
                          self.lower_bound)  # fmt: skip
        if self.use_full_rank_gate:
            gate = self.g_proj(x)
        else:
            gate = self.g_b_proj(self.g_a_proj(x))
        out = self.o_norm(out.reshape(B, T, H, D)) * mx.sigmoid(
            gate.reshape(B, T, H, D)
        )
        return self.o_proj(out.reshape(B, T, -1))


class KeepStatesBailingKDA:
    """Mixin over mlx-lm's ``BailingKDA`` (Ling-3): keeps states in a verify pass."""

    def __call__(self, x: mx.array, mask=None, cache: Any = None) -> mx.array:
        if verify_cache(cache) is None:
            return super().__call__(x, mask, cache)
        B, T, _ = x.shape
        H, D, window = self.num_heads, self.head_dim, self.conv_kernel_size - 1
        convs = [(self.q_proj, self.q_conv1d), (self.k_proj, self.k_conv1d),
                 (self.v_proj, self.v_conv1d)]  # fmt: skip
        q, k, v = [
            nn.silu(conv_with_window(cache, i, c, p(x), window, mask)).reshape(
                B, T, H, D
            )
            for i, (p, c) in enumerate(convs)
        ]
        a = self.f_proj(x).reshape(B, T, H, D)
        b = self.b_proj(x).astype(mx.float32)
        out = _delta_rule(self, cache, q, k, v, a, b, mask, self.lower_bound)
        gate = self.g_proj(x).reshape(B, T, H, D)
        out = self.o_norm(out)
        out = out * mx.sigmoid(gate.astype(mx.float32)).astype(out.dtype)
        return self.o_proj(out.reshape(B, T, -1))


def patch_trunk(model: nn.Module) -> None:
    """Give a Kimi-Linear model's KDA layers rollback: keep path and ``KDACache``."""
    kda = [layer.self_attn for layer in model.layers if layer.is_linear]
    install(model, kda, KeepStatesKimiDelta, KDACache)


def patch_k3_trunk(model: nn.Module) -> None:
    """The same for a Kimi-K3 model."""
    kda = [layer.self_attn for layer in model.layers if layer.is_linear]
    install(model, kda, KeepStatesKimiK3Delta, KDACache)


def patch_bailing_trunk(model: nn.Module) -> None:
    """The same for a Ling-3 (mlx-lm ``bailing_moe_v3``) model."""
    kda = [layer.attention for layer in model.layers if layer.is_linear]
    install(model, kda, KeepStatesBailingKDA, KDACache)
