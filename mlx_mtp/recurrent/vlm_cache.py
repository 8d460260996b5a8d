"""Rollback for the caches of language models that mlx-vlm runs (Qwen3.8-Flash-Next).

mlx-vlm 0.7.10's layers write their recurrent caches through two calls of its
own ``ArraysCache`` (``models/cache.py``): ``update_window(slot, source,
width)`` for every causal window (a gated delta net's conv inputs, a
per-layer n-gram embedding's token history and short conv) and
``update_recurrent(slot, length, update)`` for a state, where ``update(state,
steps)`` returns the states after each token when asked for ``steps`` of them
(``qwen3_5/gated_delta.py``). ``VerifyArraysCache`` keeps, between
``start_verify()`` and ``rollback(n)``, what those calls pass (the inputs of a
window, the state after every token) in ``KeepStatesCache``'s form, and
rolls back with its code: each slot gets its window or state after the last
kept token. mlx-vlm's layers run unchanged; nothing is kept outside a pass.

``RollbackQSACache`` is mlx-vlm's ``QSAKVCache`` (keys and values, the
indexer's raw keys and positions, and the summaries of its complete blocks)
whose ``trim`` keeps the block summaries that the kept tokens complete: every
block is pooled from its own keys alone, so those are the arrays a decode that
never saw the dropped tokens holds (mlx-vlm's ``trim`` drops them all and
pools them again at the next forward).

``RollbackPoolingCache`` is mlx-vlm's ``PoolingCache`` (GLM-5.3-Flash's DSA
indexer: pooled summaries of complete ``ratio``-token windows of indexer keys,
and a buffer of the window under way): between ``start_verify()`` and
``rollback(n)`` it keeps the buffer it started with and the keys and gates it
read, and rolls back to the pools the kept tokens complete and the buffer of
the kept tokens past them (each pool is made of its own window alone, so no
pool is made again). mlx-vlm's own ``trim`` cannot drop a token once a pool
exists. ``TrimmablePoolingCache`` (an MTP head's, whose tentative drafts are
dropped outside a verify pass) keeps the raw keys and gates instead and cuts
anywhere. ``VerifyCacheList`` is mlx-vlm's ``CacheList`` (a DSA layer's
latent, indexer validity, pooling and projected-key caches) whose members
each roll back by their own kind; a key cache is cut to at most the tokens
the latent keeps (GLM-5.3's projected keys follow the latent on long chunks
only, and may lag it).

``patch_trunk(model)`` makes mlx-vlm's language model hand out all of them.
"""

from typing import Any, List

import mlx.core as mx
import mlx.nn as nn
from mlx_vlm.models.cache import ArraysCache as VLMArraysCache
from mlx_vlm.models.cache import CacheList as VLMCacheList
from mlx_vlm.models.cache import KVCache as VLMKVCache
from mlx_vlm.models.cache import PoolingCache
from mlx_vlm.models.qwen4_exp.language import QSAKVCache

from .keep_states import KeepStatesCache


class VerifyArraysCache(VLMArraysCache):
    """mlx-vlm's ``ArraysCache`` that can roll back a verify pass."""

    _verify = None  # slot -> (kept sequence along axis 1, window or 0)

    verifying = KeepStatesCache.verifying
    start_verify = KeepStatesCache.start_verify
    _keep = KeepStatesCache._keep
    rollback = KeepStatesCache.rollback

    def update_window(self, index, source, width, *, lengths=None):
        if self._verify is not None:
            if lengths is not None:
                raise NotImplementedError("verify with per-sequence lengths")
            self._keep(index, source, int(width))
        return super().update_window(index, source, width, lengths=lengths)

    def update_recurrent(self, index, length, update):
        if self._verify is None:
            return super().update_recurrent(index, length, update)
        result = update(self.cache[index], length - 1 if length > 1 else None)
        out, state = result[:2]
        before = result[2] if len(result) > 2 and result[2] is not None else None
        states = state[:, None] if before is None else mx.concatenate(
            [before, state[:, None]], axis=1
        )
        self._keep(index, states, 0)
        self.cache[index] = state
        return out, state

    def is_trimmable(self) -> bool:
        return False

    def mark(self) -> tuple:
        return tuple(self.cache)

    def restore(self, mark: tuple) -> None:
        self._verify = None
        self.cache = list(mark)


class RollbackQSACache(QSAKVCache):
    """``QSAKVCache`` whose ``trim`` keeps the block summaries still complete."""

    def trim(self, n):
        blocks, ratio = self.index_block_keys, self.index_block_ratio
        n = super().trim(n)
        if blocks is not None and ratio:
            kept = self.offset // ratio
            if kept:
                self.index_block_keys = blocks[:, :, :kept]
                self.index_block_ratio = ratio
        return n


class RollbackPoolingCache(PoolingCache):
    """``PoolingCache`` that rolls a verify pass back to the kept tokens' pools."""

    _verify = None  # (remainder, buffers, pools) at the start, inputs read

    @property
    def verifying(self) -> bool:
        return self._verify is not None

    def start_verify(self) -> None:
        bufs = tuple(None if b is None else mx.array(b) for b in self._bufs())
        self._verify = (self.remainder, bufs, self.offset, [])

    def _bufs(self) -> tuple:
        return self.buf_kv, self.buf_gate

    def accumulate_windows(self, kv, gate, offset):
        if self._verify is not None:
            self._verify[3].append((kv, gate))
        return super().accumulate_windows(kv, gate, offset)

    def rollback(self, n: int) -> None:
        kept, self._verify = self._verify, None
        if n == 0:
            return
        if kept is None:
            raise RuntimeError(f"cannot roll back {n} tokens outside a verify pass")
        remainder, bufs, pools, inputs = kept
        read = sum(kv.shape[1] for kv, _ in inputs)
        if n >= read:
            raise ValueError(f"cannot roll back {n} of {read} verified tokens")
        total = remainder + read - n
        pools += total // self.ratio
        self.pooled = None if pools == 0 else mx.contiguous(self.pooled[:, :pools])
        self.remainder = total % self.ratio
        new = []
        for i, old in enumerate(bufs):
            seq = mx.concatenate(
                ([old[:, :remainder]] if old is not None else [])
                + [x[i] for x in inputs],
                axis=1,
            )[:, :total]
            buf = mx.zeros((seq.shape[0], self.ratio, seq.shape[-1]), seq.dtype)
            if self.remainder:
                buf[:, : self.remainder] = seq[:, total - self.remainder :]
            new.append(buf)
        self.buf_kv, self.buf_gate = new

    def is_trimmable(self) -> bool:
        return False

    def mark(self) -> tuple:
        bufs = tuple(None if b is None else mx.array(b) for b in self._bufs())
        return self.remainder, bufs, self.pooled

    def restore(self, mark: tuple) -> None:
        self._verify = None
        self.remainder, (self.buf_kv, self.buf_gate), self.pooled = mark


class TrimmablePoolingCache(PoolingCache):
    """``PoolingCache`` that keeps every key and gate it read, so that ``trim``
    can drop tokens anywhere: a head's tentative drafts are dropped outside a
    verify pass. One layer's raw indexer keys (an MTP head's) cost little."""

    def __init__(self, ratio: int):
        super().__init__(ratio)
        self.raw = VLMKVCache()

    def accumulate_windows(self, kv, gate, offset):
        self.raw.update_and_fetch(kv[:, None], gate[:, None])
        return super().accumulate_windows(kv, gate, offset)

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = self.raw.trim(n)
        total = self.raw.offset
        pools = total // self.ratio
        self.pooled = None if pools == 0 else mx.contiguous(self.pooled[:, :pools])
        self.remainder = total % self.ratio
        if self.remainder:
            r = slice(total - self.remainder, total)
            self.buf_kv[:, : self.remainder] = self.raw.keys[:, 0, r]
            self.buf_gate[:, : self.remainder] = self.raw.values[:, 0, r]
        return n

    def mark(self) -> int:
        return self.raw.offset

    def restore(self, mark: int) -> None:
        self.trim(self.raw.offset - mark)


class VerifyCacheList(VLMCacheList):
    """mlx-vlm's ``CacheList`` whose members each roll back by their own kind:
    a pooling cache by its own ``rollback`` (a verify pass) or ``trim``; a key
    cache is cut to at most the tokens the first one (the latent) keeps."""

    @property
    def offset(self):
        return self.caches[0].offset

    def start_verify(self) -> None:
        for c in self.caches:
            if hasattr(c, "start_verify"):
                c.start_verify()

    def rollback(self, n: int) -> None:
        keep = self.caches[0].offset - n
        if keep < 0:
            raise ValueError(f"cannot roll back {n} of {n + keep} tokens")
        for c in self.caches:
            if hasattr(c, "rollback"):
                c.rollback(n)
            elif isinstance(c, VLMKVCache):
                c.trim(max(0, c.offset - keep))
            elif n:
                c.trim(n)

    def is_trimmable(self) -> bool:
        return False

    def mark(self) -> tuple:
        return tuple(
            c.mark() if hasattr(c, "mark") else c.offset for c in self.caches
        )

    def restore(self, mark: tuple) -> None:
        for c, m in zip(self.caches, mark):
            if hasattr(c, "restore"):
                c.restore(m)
            else:
                c.trim(c.offset - m)


def _rollable(cache: Any) -> Any:
    if type(cache) is VLMArraysCache:
        return VerifyArraysCache(len(cache.cache))
    if type(cache) is QSAKVCache:
        return RollbackQSACache()
    if type(cache) is PoolingCache:
        return RollbackPoolingCache(cache.ratio)
    if type(cache) is VLMCacheList:
        return VerifyCacheList(*(_rollable(c) for c in cache.caches))
    return cache


def patch_trunk(model: nn.Module) -> None:
    """Make ``model.make_cache`` (mlx-vlm's language model) hand out caches
    that roll back. Calling it twice changes nothing."""
    base = type(model)
    if getattr(base, "_mtp_vlm_rollable", False):
        return

    def make_cache(self) -> List[Any]:
        return [_rollable(c) for c in base.make_cache(self)]

    model.__class__ = type(
        base.__name__, (base,), {"make_cache": make_cache, "_mtp_vlm_rollable": True}
    )
