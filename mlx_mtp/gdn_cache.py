"""Gated-delta-net layers whose cache can roll back a verify pass.

A GDN layer's cache is a conv window (the last ``kernel - 1`` conv inputs) and a
recurrent state. Neither can be trimmed, so between ``start_verify()`` and
``rollback(n)`` the layer keeps, besides the usual final values, the state after
every verified token (from ``gated_delta_keep``) and the conv inputs it read.
``rollback(n)`` then picks the state after the last kept token and slices the
window that ends there, with no recomputation (DESIGN.md section 6). Outside a
verify pass the cache is mlx-lm's ``ArraysCache`` and the layer runs mlx-lm's
own code, so prefill and plain decoding cost exactly what they cost in mlx-lm.

``patch_trunk(model)`` installs both on an mlx-lm Qwen3-Next / Qwen3.5 model:
its linear-attention layers get the keep-states subclass of their own class and
``make_cache`` hands out ``GDNCache`` where mlx-lm would hand out ``ArraysCache``.
"""

import functools
from typing import Any, List, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache
from mlx_lm.models.gated_delta import normalize_qk

from .gated_delta import gated_delta_update_keep


class _Verify:
    """What one verify pass leaves behind until its rollback."""

    def __init__(self):
        self.conv_input: Optional[mx.array] = None  # [B, K-1+T, C]: window, inputs
        self.states: Optional[mx.array] = None  # [B, T, Hv, Dv, Dk]: after each token


class GDNCache(ArraysCache):
    """``ArraysCache(2)`` (``[conv window, recurrent state]``) that can roll back."""

    def __init__(self, left_padding: Optional[List[int]] = None):
        super().__init__(size=2, left_padding=left_padding)
        self._verify: Optional[_Verify] = None

    @property
    def verifying(self) -> bool:
        return self._verify is not None

    def start_verify(self) -> None:
        self._verify = _Verify()

    def keep(self, conv_input: mx.array, states: mx.array, window: int) -> None:
        """Record a layer call made during the verify pass (called by the layer)."""
        v = self._verify
        if v.conv_input is None:
            v.conv_input, v.states = conv_input, states
        else:  # a second call in one pass continues the first
            new = conv_input[:, window:]
            v.conv_input = mx.concatenate([v.conv_input, new], axis=1)
            v.states = mx.concatenate([v.states, states], axis=1)

    def rollback(self, n: int) -> None:
        """Drop the last ``n`` verified tokens and release what the pass kept."""
        v, self._verify = self._verify, None
        if n == 0 or v is None or v.states is None:
            return
        verified = v.states.shape[1]
        # The state before the pass is not kept (it would cost one more state per
        # layer); the loop always keeps at least the verified token it chose.
        if n >= verified:
            raise ValueError(f"cannot roll back {n} of {verified} verified tokens")
        kept = verified - n
        window = v.conv_input.shape[1] - verified
        # contiguous copies, so the kept slices do not pin the whole buffers
        self[0] = mx.contiguous(v.conv_input[:, kept : kept + window])
        self[1] = mx.contiguous(v.states[:, kept - 1])

    def is_trimmable(self) -> bool:
        return False


class KeepStates:
    """Mixin over mlx-lm's GatedDeltaNet classes: keeps states during a verify pass.

    The verify path is mlx-lm's ``__call__`` for a batch without ``lengths``,
    with ``gated_delta_update_keep`` in place of ``gated_delta_update``.
    """

    def __call__(self, inputs: mx.array, mask=None, cache: Any = None) -> mx.array:
        if not (isinstance(cache, GDNCache) and cache.verifying):
            return super().__call__(inputs, mask, cache)
        if cache.lengths is not None or getattr(self, "sharding_group", None):
            raise NotImplementedError("verify with per-sequence lengths or sharding")
        B, S, _ = inputs.shape
        qkv, z, b, a = self._project(inputs)
        window = self.conv_kernel_size - 1
        conv_state = cache[0]
        if conv_state is None:
            conv_state = mx.zeros((B, window, self.conv_dim), dtype=inputs.dtype)
        if mask is not None:
            qkv = mx.where(mask[..., None], qkv, 0)
        conv_input = mx.concatenate([conv_state, qkv], axis=1)
        cache[0] = mx.contiguous(conv_input[:, -window:, :])
        conv_out = nn.silu(self.conv1d(conv_input))
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
        cache.keep(conv_input, states, window)
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


@functools.cache
def _keep_states_class(cls: type) -> type:
    if issubclass(cls, KeepStates):
        return cls
    sub = type(cls.__name__, (KeepStates, cls), {})
    sub.__module__ = cls.__module__
    return sub


def patch_trunk(model: nn.Module) -> None:
    """Give ``model``'s GDN layers rollback: keep-states layers and ``GDNCache``."""
    for layer in model.layers:
        if getattr(layer, "is_linear", False):
            attn = layer.linear_attn
            attn.__class__ = _keep_states_class(type(attn))
    base = type(model)
    if getattr(base, "_gdn_rollback", False):
        return

    def make_cache(self) -> List[Any]:
        caches = base.make_cache(self)
        return [GDNCache() if type(c) is ArraysCache else c for c in caches]

    model.__class__ = type(
        base.__name__, (base,), {"make_cache": make_cache, "_gdn_rollback": True}
    )
