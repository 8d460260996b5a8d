"""GLM-5.3-Flash's (``glm5_next``) DSA caches over a batch of ragged streams.

mlx-vlm 0.7.10 gives each DSA layer a ``CacheList`` (``models/glm5_next/
language.py``, ``LanguageModel.make_cache``): the MLA latent, and on a layer
with its own indexer the indexer's per-token validity, its ``PoolingCache``
and the projected keys and values (written by chunks of more than
``DECODE_BLOCK_SIZE`` tokens only); a layer that reuses the previous layer's
pick holds the latent and the projected keys. ``vlm_cache.VerifyCacheList``
rolls one stream's back; ``DSACacheList`` is that list with a batch form.

``BatchDSACache`` holds the streams' latents in one ``batch_cache.
RaggedKVCache`` (each stream writes at its own length; what lies past it is
stale, never selected, and overwritten by its next write) and each stream's
indexer state (validity, pooling cache, projected keys) as the single-stream
caches it held alone. ``rollback`` takes each stream back by its own count:
the latent by length, the pooling cache by its own ``rollback`` (the trunk's
``RollbackPoolingCache``, during a verify pass) or ``trim`` (the head's
``TrimmablePoolingCache``), the key caches cut to at most the latent's kept
tokens, as ``VerifyCacheList`` does for one stream.

``RaggedDSAAttention`` is mlx-vlm's ``Glm5NextAttention`` that also reads a
``BatchDSACache``. mlx-vlm's batch path cannot: ``Glm5NextIndexer.__call__``
places every row's queries at the end of one shared key buffer
(``query_positions = kv_length - q_length + arange(q_length)``) and counts
pools from ``first_key = argmax(key_valid)``, the left-padded layout of its
``BatchKVCache``, not streams at their own lengths. Here the projections run
over all streams at once; each stream's indexer (mlx-vlm's own
``Glm5NextIndexer.__call__``) selects on that stream's own caches, as alone,
so its picks are positions in its own sequence, which is where the ragged
latent holds them; the sparse attention over the picked latent rows (mlx-vlm's
``_attend``, decode path) then runs over all streams at once. A chunk longer
than ``DECODE_BLOCK_SIZE`` (a prompt chunk) attends stream by stream over
that stream's latent and projected keys, as alone. The indexer's selection is
the one part that always runs once per stream (as Qwen3.8's, ``vlm_cache.
RaggedQSAAttention``).
"""

from typing import Any, List, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache as LMKVCache
from mlx_vlm.models.cache import KVCache as VLMKVCache
from mlx_vlm.models.glm5_next.language import Glm5NextAttention
from mlx_vlm.models.linear import DECODE_BLOCK_SIZE, linear

from ..batch_cache import Counts, RaggedKVCache, per_stream
from .vlm_cache import VerifyCacheList
from .vlm_cache import patch_trunk as patch_vlm_trunk


class DSACacheList(VerifyCacheList):
    """A GLM-5.3 DSA layer's ``VerifyCacheList``, with a batch form."""

    # its ``merge_batch`` makes its members' batch forms itself
    merges_members = True

    @classmethod
    def merge_batch(cls, caches: Sequence["DSACacheList"]) -> "BatchDSACache":
        return BatchDSACache.merge(caches)


def _plain(c: VLMKVCache) -> LMKVCache:
    """``c``'s tokens as mlx-lm's ``KVCache`` (what ``RaggedKVCache`` merges)."""
    p = LMKVCache()
    if c.keys is not None and c.offset:
        p.keys, p.values = c.keys[..., : c.offset, :], c.values[..., : c.offset, :]
        p.offset = c.offset
    return p


def _arrays(state) -> List[mx.array]:
    if isinstance(state, mx.array):
        return [state]
    if isinstance(state, (list, tuple)):
        return [a for s in state for a in _arrays(s)]
    return []


class BatchDSACache:
    """``DSACacheList`` of several streams: the latents in one ``RaggedKVCache``,
    each stream's other members (``rest[b]``: validity, pooling cache and
    projected keys, or the projected keys alone) its own single-stream caches."""

    # the decoder reads each stream's prompt in the chunks it reads alone
    # (``decoder.Decoder.chunks``): a chunk past ``DECODE_BLOCK_SIZE`` takes
    # the projected keys' path, a shorter one the latent's, as alone
    exact_chunks = True

    def __init__(self, latent: RaggedKVCache, rest: List[list], kind: type):
        self.latent, self.rest, self.kind = latent, rest, kind
        # the last forward's width and each stream's projected keys before it,
        # where it wrote them (a chunk past ``DECODE_BLOCK_SIZE``)
        self.wrote: Optional[tuple] = None

    @property
    def lengths(self) -> List[int]:
        return self.latent.lengths

    @property
    def offset(self):
        return self.latent.offset

    @property
    def verifying(self) -> bool:
        return any(getattr(c, "verifying", False) for cs in self.rest for c in cs)

    def start_verify(self) -> None:
        for c in (c for cs in self.rest for c in cs):
            if hasattr(c, "start_verify"):
                c.start_verify()

    def rollback(self, n: Counts) -> None:
        n = per_stream(n, len(self.rest))
        self.latent.rollback(n)
        wrote, self.wrote = self.wrote, None
        if wrote is not None:  # a stream whose kept tokens alone take the
            width, before = wrote  # latent's path never writes projected keys
            for members, k, m in zip(self.rest, n, before):
                if width - k <= DECODE_BLOCK_SIZE and members[-1].offset > m:
                    members[-1].trim(members[-1].offset - m)
        for members, k, keep in zip(self.rest, n, self.latent.lengths):
            for c in members:
                if hasattr(c, "rollback"):  # (called with 0 too: it lets go)
                    c.rollback(k)
                elif isinstance(c, VLMKVCache):
                    c.trim(max(0, c.offset - keep))
                elif k:
                    c.trim(k)

    def trim(self, n: int) -> int:
        self.rollback(n)
        return n

    def is_trimmable(self) -> bool:
        return False

    @classmethod
    def merge(cls, caches: Sequence[DSACacheList]) -> "BatchDSACache":
        latent = RaggedKVCache.merge([_plain(c.caches[0]) for c in caches])
        return cls(latent, [list(c.caches[1:]) for c in caches], type(caches[0]))

    def extend(self, other: "BatchDSACache") -> None:
        self.latent.extend(other.latent)
        self.rest = self.rest + other.rest

    def filter(self, keep: Sequence[int]) -> None:
        self.latent.filter(keep)
        self.rest = [self.rest[i] for i in keep]

    def extract(self, b: int, like: Optional[type] = None) -> DSACacheList:
        """Stream ``b`` as a single-stream ``DSACacheList`` (its own latent)."""
        plain, latent = self.latent.extract(b), VLMKVCache()
        if plain.keys is not None:
            latent.keys, latent.values, latent.offset = plain.keys, plain.values, plain.offset
        return (like or self.kind)(latent, *self.rest[b])

    @property
    def state(self) -> List[mx.array]:
        return self.latent.state + [
            a for cs in self.rest for c in cs for a in _arrays(c.state)
        ]

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in self.state)


class RaggedDSAAttention(Glm5NextAttention):
    """mlx-vlm's ``Glm5NextAttention`` that also reads a ``BatchDSACache``: the
    projections over all streams, each stream's indexer on its own caches
    (mlx-vlm's own ``Glm5NextIndexer.__call__``, as alone), then mlx-vlm's
    ``_attend`` over all streams (a chunk past ``DECODE_BLOCK_SIZE``: stream by
    stream, over its latent and projected keys)."""

    def __call__(
        self, x, padding_mask=None, cache=None, prev_topk_indices=None, last_only=False
    ):
        if not isinstance(cache, BatchDSACache):
            return super().__call__(x, padding_mask, cache, prev_topk_indices, last_only)
        if padding_mask is not None:
            raise NotImplementedError("a padding mask over ragged streams")
        B, L, _ = x.shape
        q_a, kv_a = mx.split(linear(self.qkv_a_proj, x), (self.q_lora_rank,), axis=-1)
        q_resid = self.q_a_layernorm(q_a)
        q = (
            linear(self.q_b_proj, q_resid)
            .reshape(B, L, self.num_heads, self.q_head_dim)
            .transpose(0, 2, 1, 3)
        )
        new_latent = self.kv_a_layernorm(kv_a)[:, None]
        starts = list(cache.lengths)
        latent, _ = cache.latent.update_and_fetch(
            new_latent, mx.zeros((B, 1, L, 0), dtype=new_latent.dtype)
        )
        if self.indexer is None:
            if prev_topk_indices is None:
                raise ValueError("Shared indexer layer has no previous top-k indices.")
            topk = prev_topk_indices
        else:  # each stream's pick, on its own validity and pooling caches
            topk = mx.concatenate(
                [
                    self.indexer(x[b : b + 1], q_resid[b : b + 1], None, m[0], m[1], n)
                    for b, (m, n) in enumerate(zip(cache.rest, starts))
                ]
            )
        cache.wrote = None
        if L <= DECODE_BLOCK_SIZE and not self.training:
            out, topk = self._attend(
                q, latent, new_latent, topk, cache.latent, None, last_only
            )
        else:  # stream by stream, with its projected keys, as alone
            # (a right-padded stream whose own tokens take the latent's path
            # alone has the keys written here taken back: ``rollback``)
            # (a module in training mode takes this path at any width, alone
            # too: the head's block, which nothing sets to eval mode)
            if not self.training:
                cache.wrote = (L, [m[-1].offset for m in cache.rest])
            parts = [
                self._attend(
                    q[b : b + 1],
                    latent[b : b + 1, :, : n + L],
                    new_latent[b : b + 1],
                    topk[b : b + 1],
                    None,
                    m[-1],
                    last_only,
                )
                for b, (m, n) in enumerate(zip(cache.rest, starts))
            ]
            out = mx.concatenate([o for o, _ in parts])
            topk = mx.concatenate([t for _, t in parts])
        return linear(self.o_proj, out), topk


def ragged_dsa(model: nn.Module) -> None:
    """Every ``Glm5NextAttention`` of ``model`` becomes a ``RaggedDSAAttention``
    (its parameters and names unchanged)."""
    for _, m in model.named_modules():
        if type(m) is Glm5NextAttention:
            m.__class__ = RaggedDSAAttention


def _batchable(cache: Any) -> Any:
    if type(cache) is VerifyCacheList:
        return DSACacheList(*cache.caches)
    return cache


def patch_trunk(model: nn.Module) -> None:
    """``vlm_cache.patch_trunk``, the DSA layers' caches ``DSACacheList``s and
    their attention ``RaggedDSAAttention``. Calling it twice changes nothing."""
    patch_vlm_trunk(model)
    ragged_dsa(model)
    base = type(model)
    if getattr(base, "_mtp_glm5_batch", False):
        return

    def make_cache(self) -> List[Any]:
        return [_batchable(c) for c in base.make_cache(self)]

    model.__class__ = type(
        base.__name__, (base,), {"make_cache": make_cache, "_mtp_glm5_batch": True}
    )
