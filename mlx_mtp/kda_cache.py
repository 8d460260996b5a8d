"""Kimi delta attention layers (Kimi-Linear) whose cache can roll back a verify pass.

A KDA layer caches ``[q window, k window, v window, recurrent state]`` in an
``ArraysCache(4)``: three short convolutions and a gated delta rule with
per-key gates. During a verify pass the layer runs mlx-lm's code with
``gated_delta_update_keep`` (the gated-delta-net op with per-key gates, from
``gated_delta.py``) in place of ``gated_delta_update`` and keeps the three
convs' inputs and the state after every token in a ``KDACache``;
``rollback(n)`` picks the ones after the last kept token.
"""

from typing import Any, List, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.gated_delta import normalize_qk

from .gated_delta import gated_delta_update_keep
from .keep_states import KeepStatesCache, conv_with_window, install, verify_cache


class KDACache(KeepStatesCache):
    """``[q, k, v conv windows, recurrent state]`` that can roll back a verify pass."""

    def __init__(self, size: int = 4, left_padding: Optional[List[int]] = None):
        super().__init__(size, left_padding)


class KeepStates:
    """Mixin over mlx-lm's ``KimiDeltaAttention``: keeps states in a verify pass."""

    def __call__(self, x: mx.array, mask=None, cache: Any = None) -> mx.array:
        if verify_cache(cache) is None:
            return super().__call__(x, mask, cache)
        B, T, _ = x.shape
        H, D, window = self.num_heads, self.head_dim, self.conv_kernel - 1
        q, k, v = [
            nn.silu(conv_with_window(cache, i, conv.conv, proj(x), window, mask))
            for i, (proj, conv) in enumerate(
                [
                    (self.q_proj, self.q_conv),
                    (self.k_proj, self.k_conv),
                    (self.v_proj, self.v_conv),
                ]
            )
        ]
        q, k, v = (t.reshape(B, T, H, D) for t in (q, k, v))
        q, k = normalize_qk(q, k, inv_scale=self.scale, eps=1e-6)
        a_logits = self.f_b_proj(self.f_a_proj(x)).reshape(B, T, H, D)
        b_logits = self.b_proj(x).reshape(B, T, H)
        out, state, states = gated_delta_update_keep(
            q, k, v, a_logits, b_logits, self.A_log.reshape(H, 1),
            self.dt_bias.reshape(H, D), cache[3], mask, use_kernel=not self.training,
        )  # fmt: skip
        cache.keep_states(3, states)
        cache[3] = state
        cache.advance(T)
        gate = self.g_b_proj(self.g_a_proj(x)).reshape(B, T, H, D)
        out = self.o_norm(out.reshape(B, T, H, D)) * mx.sigmoid(gate)
        return self.o_proj(out.reshape(B, T, -1))


def patch_trunk(model: nn.Module) -> None:
    """Give a Kimi-Linear model's KDA layers rollback: keep path and ``KDACache``."""
    kda = [layer.self_attn for layer in model.layers if layer.is_linear]
    install(model, kda, KeepStates, KDACache)
