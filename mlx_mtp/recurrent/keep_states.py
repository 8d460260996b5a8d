"""Recurrent caches that roll a verify pass back by picking a kept state.

A recurrent layer (gated delta net, Mamba2, Kimi delta attention, lightning
attention) caches conv windows (the last ``kernel - 1`` conv inputs) and a
recurrent state. Neither can be trimmed, so between ``start_verify()`` and
``rollback(n)`` the layer also keeps, per slot of its ``ArraysCache``, either
the conv inputs it read (window slots) or the state after every verified token
(state slots). ``rollback(n)`` then sets each slot to its value after the last
kept token: the window ending there, the state kept there. Nothing is
recomputed, and nothing is kept outside a verify pass (docs/design.md section 6);
so dropping tokens outside one is refused, never silently skipped.

Outside a verify pass the cache is mlx-lm's ``ArraysCache`` and the layers run
mlx-lm's own code. ``chat.py`` snapshots such a cache at a turn boundary by
keeping its arrays, and restores it with ``rollback(0)`` and the old arrays.

A layer type plugs in with a mixin over mlx-lm's class whose ``__call__`` takes
the keep path when ``cache.verifying`` (see ``gdn_cache.py``, ``mamba_cache.py``,
``kda_cache.py``, ``lightning_cache.py``), and ``install`` puts the mixin on a
model's layers and the cache class in its ``make_cache``.
"""

import functools
from typing import Any, Dict, Iterable, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache


class KeepStatesCache(ArraysCache):
    """``ArraysCache`` whose window and state slots can roll back a verify pass."""

    def __init__(self, size: int, left_padding: Optional[List[int]] = None):
        super().__init__(size=size, left_padding=left_padding)
        # slot -> (kept sequence along axis 1, window length or 0 for a state)
        self._verify: Optional[Dict[int, Tuple[mx.array, int]]] = None

    @property
    def verifying(self) -> bool:
        return self._verify is not None

    def start_verify(self) -> None:
        self._verify = {}

    def keep_window(self, slot: int, conv_input: mx.array, window: int) -> None:
        """Record conv inputs ``[B, window + T, C]`` (old window, then new inputs)."""
        self._keep(slot, conv_input, window)

    def keep_states(self, slot: int, states: mx.array) -> None:
        """Record ``states[:, t]``, the state after verified token ``t``."""
        self._keep(slot, states, 0)

    def _keep(self, slot: int, seq: mx.array, window: int) -> None:
        if slot in self._verify:  # a second call in one pass continues the first
            old, _ = self._verify[slot]
            seq = mx.concatenate([old, seq[:, window:]], axis=1)
        self._verify[slot] = (seq, window)

    def rollback(self, n: int) -> None:
        """Drop the last ``n`` verified tokens and release what the pass kept."""
        kept_slots, self._verify = self._verify, None
        if n == 0:
            return
        if not kept_slots:  # e.g. a head's tentative entries: no state was kept
            raise RuntimeError(f"cannot roll back {n} tokens outside a verify pass")
        counts = {seq.shape[1] - window for seq, window in kept_slots.values()}
        if len(counts) != 1:
            raise RuntimeError(f"slots kept different token counts: {counts}")
        verified = counts.pop()
        # The state before the pass is not kept (it would cost one more state per
        # slot); the loop always keeps at least the verified token it chose.
        if n >= verified:
            raise ValueError(f"cannot roll back {n} of {verified} verified tokens")
        kept = verified - n
        for slot, (seq, window) in kept_slots.items():
            # contiguous copies, so the kept slices do not pin the whole buffers
            if window:
                self[slot] = mx.contiguous(seq[:, kept : kept + window])
            else:
                self[slot] = mx.contiguous(seq[:, kept - 1])

    def is_trimmable(self) -> bool:
        return False


def verify_cache(cache: Any) -> Optional[KeepStatesCache]:
    """``cache`` if a verify pass is under way in it, else None.

    Per-sequence lengths (batched, left-padded generation) are not supported
    by the keep path; the speculative loop runs one sequence.
    """
    if not (isinstance(cache, KeepStatesCache) and cache.verifying):
        return None
    if cache.lengths is not None:
        raise NotImplementedError("verify with per-sequence lengths")
    return cache


def conv_with_window(
    cache: KeepStatesCache,
    slot: int,
    conv: nn.Module,
    x: mx.array,
    window: int,
    mask: Optional[mx.array],
) -> mx.array:
    """Depthwise conv over ``[old window, x]`` as mlx-lm's layers run it.

    Sets the new window in ``cache[slot]``, keeps the inputs for rollback and
    returns the raw conv output (the caller applies its activation).
    """
    if mask is not None:
        x = mx.where(mask[..., None], x, 0)
    state = cache[slot]
    if state is None:
        state = mx.zeros((x.shape[0], window, x.shape[-1]), dtype=x.dtype)
    conv_input = mx.concatenate([state, x], axis=1)
    cache[slot] = mx.contiguous(conv_input[:, -window:])
    cache.keep_window(slot, conv_input, window)
    return conv(conv_input)


@functools.cache
def keep_states_class(cls: type, mixin: type) -> type:
    """``cls`` with ``mixin`` in front, named like ``cls`` (so reprs stay mlx-lm's)."""
    if issubclass(cls, mixin):
        return cls
    sub = type(cls.__name__, (mixin, cls), {})
    sub.__module__ = cls.__module__
    return sub


def install(
    model: nn.Module, modules: Iterable[nn.Module], mixin: type, cache_class: type
) -> None:
    """Give ``modules`` the keep path and ``model.make_cache`` ``cache_class``.

    Every plain ``ArraysCache`` that mlx-lm's ``make_cache`` hands out becomes a
    ``cache_class`` of the same size. Calling it twice changes nothing.
    """
    for m in modules:
        m.__class__ = keep_states_class(type(m), mixin)
    base = type(model)
    if getattr(base, "_keeps_states", False):
        return

    def make_cache(self) -> List[Any]:
        caches = base.make_cache(self)
        return [
            cache_class(len(c.cache)) if type(c) is ArraysCache else c for c in caches
        ]

    model.__class__ = type(
        base.__name__, (base,), {"make_cache": make_cache, "_keeps_states": True}
    )
