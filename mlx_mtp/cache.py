"""Cache rollback for speculative decoding, and the prompt cache of an MTP model.

The loop never touches cache arrays. It brackets each verify pass with
``start_verify(caches)`` and ``rollback(caches, n)``:

- attention caches (mlx-lm's ``KVCache`` and friends) ignore ``start_verify``
  and roll back with their own ``trim(n)``;
- a cache that must do more (a gated-delta-net state that keeps per-token
  intermediates during a verify pass) implements ``start_verify()`` and
  ``rollback(n)`` itself. ``rollback`` is called after every verify pass, with
  ``n == 0`` too, so such a cache can release what it kept.
"""

from dataclasses import dataclass, field
from typing import Any, List, Optional

import mlx.core as mx


def can_rollback(caches: List[Any]) -> bool:
    """Whether every cache in ``caches`` can drop its last tokens."""
    return all(hasattr(c, "rollback") or c.is_trimmable() for c in caches)


def start_verify(caches: List[Any]) -> None:
    for c in caches:
        if hasattr(c, "start_verify"):
            c.start_verify()


def rollback(caches: List[Any], n: int) -> None:
    """Drop the last ``n`` tokens from every cache (``n`` may be 0)."""
    for c in caches:
        if hasattr(c, "rollback"):
            c.rollback(n)
        elif n > 0:
            trimmed = c.trim(n)
            if trimmed != n:
                raise RuntimeError(f"{type(c).__name__} trimmed {trimmed} of {n}")


def cache_length(caches: List[Any]) -> int:
    """Tokens held by the first cache that reports an offset."""
    for c in caches:
        if hasattr(c, "offset"):
            return int(c.offset)
    return 0


@dataclass
class MTPCache:
    """Everything a generation leaves behind, so that a later call can continue.

    ``trunk`` and ``head`` are the per-layer caches of the main model and the MTP
    head. The head lags the trunk: the hidden states in ``pending_hidden`` are
    the trunk's outputs at its last positions, not yet fed to the head because
    the head pairs each hidden state ``h_i`` with the NEXT token ``t_{i+1}``.
    ``pending_tokens`` holds the successors already known (one fewer than the
    hidden states); the last successor is the next token the trunk will read.
    """

    trunk: List[Any]
    head: List[Any] = field(default_factory=list)
    pending_hidden: Optional[mx.array] = None
    pending_tokens: List[int] = field(default_factory=list)

    @property
    def offset(self) -> int:
        """Tokens the trunk has processed."""
        return cache_length(self.trunk)

    @property
    def head_offset(self) -> int:
        """Positions the MTP head has processed."""
        return cache_length(self.head)

    def state_list(self) -> List[Any]:
        return self.trunk + self.head
