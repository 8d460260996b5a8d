"""Mamba2 layers (Nemotron-H) whose cache can roll back a verify pass.

A Mamba2 mixer caches ``[conv window, SSM state]`` in an ``ArraysCache(2)``,
the same layout as a gated delta net. During a verify pass the mixer runs
mlx-lm's code with ``ssm_update_keep`` (the state after every token) in place
of ``ssm_update``, and keeps the conv inputs and those states in a
``MambaCache``; ``rollback(n)`` picks the ones after the last kept token.
Outside a verify pass mlx-lm's own code runs.
"""

from typing import Any, List, Optional

import mlx.core as mx
import mlx.nn as nn

from .keep_states import KeepStatesCache, conv_with_window, install, verify_cache
from .ssm_keep import ssm_update_keep


class MambaCache(KeepStatesCache):
    """``[conv window, SSM state]`` that can roll back a verify pass."""

    def __init__(self, size: int = 2, left_padding: Optional[List[int]] = None):
        super().__init__(size, left_padding)


class KeepStatesMamba2:
    """Mixin over mlx-lm's ``NemotronHMamba2Mixer``: keeps states in a verify pass.

    The verify path is the mixer's ``__call__`` (``_conv``, ``_ssm``) for a
    batch without ``lengths``, with ``ssm_update_keep`` for ``ssm_update``.
    """

    def __call__(self, hidden_states: mx.array, mask=None, cache: Any = None):
        if verify_cache(cache) is None:
            return super().__call__(hidden_states, mask, cache)
        b, T, _ = hidden_states.shape
        gate, conv_input, dt = mx.split(
            self.in_proj(hidden_states),
            [self.intermediate_size, self.intermediate_size + self.conv_dim],
            axis=-1,
        )
        window = self.conv_kernel_size - 1
        conv_out = conv_with_window(cache, 0, self.conv1d, conv_input, window, mask)
        x, B, C = mx.split(
            nn.silu(conv_out),
            [
                self.intermediate_size,
                self.intermediate_size + self.n_groups * self.ssm_state_size,
            ],
            axis=-1,
        )
        x = x.reshape(b, T, self.num_heads, self.head_dim)
        B = B.reshape(b, T, self.n_groups, self.ssm_state_size)
        C = C.reshape(b, T, self.n_groups, self.ssm_state_size)
        y, state, states = ssm_update_keep(
            x, self.A_log, B, C, self.D.astype(x.dtype), dt, self.dt_bias,
            cache[1], self.time_step_limit, mask, use_kernel=not self.training,
        )  # fmt: skip
        cache.keep_states(1, states)
        cache[1] = state
        cache.advance(T)
        y = self.norm(y.reshape(b, T, self.intermediate_size), gate)
        return self.out_proj(y)


def patch_trunk(model: nn.Module) -> None:
    """Give a Nemotron-H model's Mamba2 layers the keep path and ``MambaCache``."""
    mixers = [layer.mixer for layer in model.layers if layer.block_type == "M"]
    install(model, mixers, KeepStatesMamba2, MambaCache)
