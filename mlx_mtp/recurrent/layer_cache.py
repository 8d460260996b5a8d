"""DeepSeek-V4.1's layer caches, rolled back after a verify pass without replay.

mlx-lm 0.32.2's ``deepseek_v41.LayerCache`` holds, per decoder layer, the last
``sliding_window`` keys (the window), the closed compressed groups
(``compress_kv``) and their indexer keys (``index_k``, index-source layers),
and the projected rows of the group still open (``pending_kv`` and
``pending_gate``, ``ratio - 1`` rows at most). A forward evicts window rows
and pools every group its tokens complete; neither can be undone from what
it keeps (``is_trimmable`` is False).

``RollbackLayerCache`` keeps, between ``start_verify()`` and ``rollback(n)``,
what the pass would otherwise lose: the window as it stood with the new rows
appended, and the compressor's projected rows of the new tokens (the
projections of a layer's compressor hand their outputs to the cache during a
pass, ``KeepRowsCompressor``). ``rollback(n)`` then cuts the window back to
the ``sliding_window`` rows ending at the last kept token, drops the groups
that the rejected tokens completed (each group is pooled from its own rows
alone, so the groups before are untouched) and re-opens the group the kept
tokens end in with its rows: every array is then the one a decode that never
saw the rejected tokens holds. Nothing is recomputed, nothing is kept outside
a pass. The arrays are replaced on every update, never written into, so a
snapshot is the attributes themselves (``mark``, ``restore``).
"""

from typing import Any, List, Optional

import mlx.core as mx
import mlx.nn as nn

from .keep_states import keep_states_class

_FIELDS = ("window", "compress_kv", "index_k", "pending_kv", "pending_gate", "offset")


def _cat(a: Optional[mx.array], b: mx.array) -> mx.array:
    return b if a is None else mx.concatenate([a, b], axis=1)


def _rows(a: Optional[mx.array]) -> int:
    return 0 if a is None else a.shape[1]


def _first_rows(a: Optional[mx.array], n: int) -> Optional[mx.array]:
    """``a``'s first ``n`` rows; None where ``a`` had none to begin with and
    ``n`` is 0 (a decode that never compressed holds None there)."""
    if a is None:
        return None
    return a[:, :n] if n < a.shape[1] else a


class _Pass:
    """What one verify pass must keep to be taken back."""

    def __init__(self, cache: Any):
        self.start = {f: getattr(cache, f) for f in _FIELDS}
        self.window: Optional[mx.array] = None  # old window + every new row
        self.ratio: Optional[int] = None  # set where the compressor ran
        self.kv: Optional[mx.array] = None  # the compressor's new rows
        self.gate: Optional[mx.array] = None


def rollback_cache_class(base: type) -> type:
    """``base`` (mlx-lm's ``LayerCache``) with a rollback of verify passes."""

    class RollbackLayerCache(base):
        _pass: Optional[_Pass] = None

        @property
        def verifying(self) -> bool:
            return self._pass is not None

        def start_verify(self) -> None:
            self._pass = _Pass(self)

        def update_window(self, kv: mx.array) -> mx.array:
            if self._pass is not None:
                seen = self._pass.window
                self._pass.window = _cat(self.window if seen is None else seen, kv)
            return super().update_window(kv)

        def keep_rows(self, ratio: int, kv=None, gate=None) -> None:
            """The compressor's new rows in this pass (none where ``ratio`` is 1:
            each token is its own group)."""
            p = self._pass
            p.ratio = ratio
            if kv is not None:
                p.kv, p.gate = _cat(p.kv, kv), _cat(p.gate, gate)

        def rollback(self, n: int) -> None:
            """Drop the last ``n`` tokens of the pass and release what it kept."""
            p, self._pass = self._pass, None
            if n == 0:
                return
            if p is None:
                raise RuntimeError(f"cannot roll back {n} tokens outside a verify pass")
            verified = self.offset - p.start["offset"]
            if n > verified:
                raise ValueError(f"cannot roll back {n} of {verified} verified tokens")
            kept = verified - n
            before = _rows(p.start["window"])
            if p.window is not None:
                window = p.window[:, : before + kept]
                self.window = (
                    window[:, -self.window_size :] if window.shape[1] else None
                )
            self.offset = p.start["offset"] + kept
            if p.ratio is None:
                return
            if p.ratio == 1:
                groups = kept
            else:
                rows = _rows(p.start["pending_kv"]) + kept
                closed = rows - rows % p.ratio
                groups = closed // p.ratio
                kv = _cat(p.start["pending_kv"], p.kv)
                gate = _cat(p.start["pending_gate"], p.gate)
                self.pending_kv = mx.contiguous(kv[:, closed:rows])
                self.pending_gate = mx.contiguous(gate[:, closed:rows])
            for name in ("compress_kv", "index_k"):
                had = _rows(p.start[name])
                if had + groups == 0:
                    setattr(self, name, p.start[name])
                else:
                    setattr(self, name, _first_rows(getattr(self, name), had + groups))

        def is_trimmable(self) -> bool:
            return False

        def mark(self) -> tuple:
            return tuple(getattr(self, f) for f in _FIELDS)

        def restore(self, mark: tuple) -> None:
            self._pass = None
            for f, v in zip(_FIELDS, mark):
                setattr(self, f, v)

    RollbackLayerCache.__name__ = base.__name__
    RollbackLayerCache.__module__ = base.__module__
    return RollbackLayerCache


class _KeptOutput:
    """Mixin over a projection: while ``_kept`` is a list, appends its outputs."""

    _kept: Optional[List[mx.array]] = None

    def __call__(self, x: mx.array) -> mx.array:
        y = super().__call__(x)
        if self._kept is not None:
            self._kept.append(y)
        return y


class KeepRowsCompressor:
    """Mixin over mlx-lm's ``Compressor``: in a verify pass its projections'
    rows reach the cache (``keep_rows``); mlx-lm's own code runs throughout."""

    def __call__(self, x: mx.array, start_pos: int, cache: Any):
        if not getattr(cache, "verifying", False):
            return super().__call__(x, start_pos, cache)
        if self.ratio == 1:
            cache.keep_rows(1)
            return super().__call__(x, start_pos, cache)
        projections = (self.kv_proj, self.gate_proj)
        for p in projections:
            object.__setattr__(p, "_kept", [])
        try:
            out = super().__call__(x, start_pos, cache)
            cache.keep_rows(self.ratio, *(p._kept[0] for p in projections))
        finally:
            for p in projections:
                object.__setattr__(p, "_kept", None)
        return out


def patch_trunk(model: nn.Module) -> None:
    """Give a DeepSeek-V4.1 model (mlx-lm ``deepseek_v41``) caches that roll
    back: ``RollbackLayerCache`` from ``make_cache``, and compressors whose
    rows reach it. Calling it twice changes nothing."""
    from mlx_lm.models.deepseek_v41 import LayerCache

    for layer in model.layers:
        compressor = getattr(layer.self_attn, "compressor", None)
        if compressor is None:
            continue
        compressor.__class__ = keep_states_class(type(compressor), KeepRowsCompressor)
        for name in ("kv_proj", "gate_proj"):
            if name in compressor:
                p = compressor[name]
                p.__class__ = keep_states_class(type(p), _KeptOutput)
    base = type(model)
    if getattr(base, "_rolls_back_layers", False):
        return
    cache_class = _rollback_layer_cache(LayerCache)

    def make_cache(self) -> List[Any]:
        return [cache_class(c.window_size) for c in base.make_cache(self)]

    model.__class__ = type(
        base.__name__, (base,), {"make_cache": make_cache, "_rolls_back_layers": True}
    )


_CLASSES: dict = {}


def _rollback_layer_cache(base: type) -> type:
    if base not in _CLASSES:
        _CLASSES[base] = rollback_cache_class(base)
    return _CLASSES[base]
