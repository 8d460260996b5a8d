"""Hunyuan-V4 (``hy_v4``) MTP head: a DeepSeek-style layer past the hyper-connections.

The source of truth is mlx-vlm 0.7.10 (``speculative/drafters/hy_v4_mtp/
{hy_v4_mtp.py, split.py, config.py}``, ``models/hy_v4/{language.py,
hyper_connection.py, cache.py, indexer.py}``); mlx-lm 0.32 has no such model,
and the trunk loads through mlx-vlm's classes (``mlx_mtp.vlm_text``).

The trunk carries ``hc_mult`` streams through its layers and ends with
``norm(hc_head(streams))``: the streams collapsed by the hyper-connection
head, then the final RMSNorm. The head reads that state, AFTER the collapse
and AFTER the norm (what mlx-vlm's ``LanguageModel`` hands its drafter as
``hidden_states`` and from ``speculative_verify_hidden``: the target's
"post" tap on ``norm``), at position ``i`` with the embedding of
``t_{i+1}``::

    x = eh_proj(concat[enorm(e), hnorm(h)])            embedding FIRST
    x = x + attn(input_layernorm(x))                   no hyper-connections
    x = x + moe(post_attention_layernorm(x))
    logits = lm_head(final_layernorm(x))               the trunk's lm_head

Plain RMSNorms (``w``, mlx-vlm's ``nn.RMSNorm``; its drafter's sanitize adds
nothing). The attention is the trunk's kind (``HyV4Attention``: MLA with a
sigmoid output gate, learned sinks and its own top-k indexer, the layer
being ``"full"``), the MLP always MoE (``first_k_dense_replace = 0``), both
mlx-vlm's own modules. The embedding is the trunk's and is not zeroed at
position 0; RoPE runs at the head's own cache offset (from 0 at the
prompt). A chained draft feeds back the closing norm's output (mlx-vlm's
``draft_block`` passes ``_forward_hidden``'s normed result on). Checkpoints
have one layer, ``model.mtp_layers.0.`` (mlx-vlm's splitter reads only that
prefix), which drafts every depth.
"""

from dataclasses import replace
from typing import Any, Dict, List

import mlx.core as mx
import mlx.nn as nn
from mlx_vlm.models.hy_v4.fused_switch_glu import FusedSwitchGLU
from mlx_vlm.models.hy_v4.indexer import HyV4Indexer
from mlx_vlm.models.hy_v4.language import HyV4Attention
from mlx_vlm.models.hy_v4.moe import HyV4MoE

from ..recurrent import hy_v4_cache
from ..recurrent.hy_v4_cache import head_cache
from .base import MTPHead
from .common import rows_in, split_layer_mlps, summed
from .wiring import FusedHead, Wiring

MODEL_TYPES = {"hy_v4": "Hunyuan-V4 (source of truth: mlx-vlm 0.7.10 hy_v4_mtp)"}
PREFIX = "model.mtp_layers."


def split_counts(config: Dict[str, Any]) -> List[int]:
    """What ``shard_trunk`` divides by the number of processes: the heads."""
    return [(config.get("text_config") or config)["num_attention_heads"]]


def shard_trunk(model: nn.Module, group: Any) -> None:
    """Tensor-split mlx-vlm's Hunyuan-V4 language model (lazy) over ``group``:
    mlx-vlm 0.7.10's DeepSeek-V3.2 split (``deepseek_v32.LanguageModel.shard``,
    the layers' base) with Hunyuan-V4's own per-head parts. Each process keeps
    ``1 / N`` of the heads: ``q_b_proj``'s and ``linear_gate``'s rows for them,
    their ``embed_q`` / ``unembed_out`` and ``learnable_sink_param``,
    ``o_proj``'s inputs; and ``1 / N`` of the width of the dense MLP, every
    expert (``gate_up_proj`` in its two halves) and the shared expert. The
    attention and the MLP or MoE each end with one ``all_sum``. The latent KV
    (``kv_a_proj_with_mqa``), the indexer and the router stay whole; the
    head's block (a class of its own) runs whole on every process."""
    from mlx.nn.layers.distributed import shard_inplace

    n, rank = group.size(), group.rank()
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        shard_inplace(attn.q_b_proj, "all-to-sharded", group=group)
        shard_inplace(attn.linear_gate, "all-to-sharded", group=group)
        rows_in(attn.o_proj, group)
        summed(attn.o_proj, group)  # (the attention returns its top-k too)
        attn.num_heads //= n
        h = attn.num_heads
        attn.embed_q.apply(lambda w: w[rank * h : (rank + 1) * h])
        attn.unembed_out.apply(lambda w: w[rank * h : (rank + 1) * h])
        sinks = attn.learnable_sink_param
        attn.learnable_sink_param = sinks[rank * h : (rank + 1) * h]
        if not hasattr(mlp, "switch_mlp"):  # a dense layer
            split_layer_mlps((mlp,), group)
            summed(mlp, group)
            continue
        mlp.sharding_group = group  # mlx-vlm's HyV4MoE sums when it has one
        experts = mlp.switch_mlp
        shard_inplace(experts.gate_up_proj, "all-to-sharded", segments=2, group=group)
        rows_in(experts.down_proj, group)
        if "shared_experts" in mlp:
            split_layer_mlps((mlp.shared_experts,), group)
DEFAULT_HIDDEN_TAP = "post"  # after hc_head and the final norm


class ExactIndexer(HyV4Indexer):
    """mlx-vlm's ``HyV4Indexer`` with a top-k that holds for every key count.

    mlx-vlm 0.7.10 picks the top ``index_topk`` keys with a function compiled
    ``shapeless=True`` around ``argpartition(scores, kth=-top_k)``: the
    negative ``kth`` is resolved for the key count of its first call and kept,
    so a later call over more keys partitions at the wrong rank and its last
    ``top_k`` entries are not the top ``top_k`` (``tests/test_hy_v4.py``
    shows it). Which keys a query sees then depends on the lengths of the
    chunks read before, and a verify pass would not read as plain decoding
    does. Here the same scores (ReLU of the per-head dot products, weighted by
    ``weights_proj``, summed over heads, masked) are partitioned at
    ``keys - top_k`` for each call's own count.
    """

    def __call__(self, x, qr, mask, cache=None):
        b, s, _ = x.shape
        q = self.wq_b(qr).reshape(b, s, self.n_heads, self.head_dim).swapaxes(1, 2)
        k = self.k_norm(self.wk(x)).reshape(b, 1, s, self.head_dim)
        offset = cache.offset if cache is not None else 0
        q, k = self.rope(q, offset=offset), self.rope(k, offset=offset)
        if cache is not None:
            k, _ = cache.update_and_fetch(k, mx.zeros([b, 1, s, 0], k.dtype))
        keys = k.shape[2]
        if keys <= self.index_topk:
            return None  # every key is read: dense attention
        scale = self.n_heads**-0.5 * self.softmax_scale
        w = (self.weights_proj(x) * scale).swapaxes(-1, -2)[..., None]
        scores = (mx.maximum(q @ k.swapaxes(-1, -2), 0) * w).sum(axis=1, keepdims=True)
        if mask is not None:
            scores = mx.where(mask, scores, -mx.inf)
        top = mx.argpartition(scores, kth=keys - self.index_topk, axis=-1)
        return top[..., -self.index_topk :]


def exact_indexers(model: nn.Module) -> None:
    """Every ``HyV4Indexer`` of ``model`` becomes an ``ExactIndexer`` (its
    parameters and names unchanged)."""
    for _, m in model.named_modules():
        if type(m) is HyV4Indexer:
            m.__class__ = ExactIndexer


# every hy_v4 trunk ``vlm_text`` loads, with a head or without (lookups and
# drafters verify chunks too)
prepare_trunk = exact_indexers


def patch_trunk(model: nn.Module) -> None:
    """The loader's hook: caches that count and roll back, exact top-k."""
    hy_v4_cache.patch_trunk(model)
    exact_indexers(model)


class _Block(nn.Module):
    """The MTP layer's block: mlx-vlm's attention and MoE on one residual stream."""

    def __init__(self, args: Any):
        super().__init__()
        one = replace(
            args,
            num_hidden_layers=1,
            first_k_dense_replace=0,
            moe_layer_freq=1,
            indexer_types=["full"],
        )
        self.self_attn = HyV4Attention(one, 0)
        self.mlp = HyV4MoE(one)
        self.mlp.switch_mlp = FusedSwitchGLU(
            one.hidden_size, one.moe_intermediate_size, one.n_routed_experts
        )
        self.input_layernorm = nn.RMSNorm(one.hidden_size, eps=one.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(
            one.hidden_size, eps=one.rms_norm_eps
        )

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        r, _ = self.self_attn(self.input_layernorm(x), mask, cache)
        h = x + r
        return h + self.mlp(self.post_attention_layernorm(h))


class HyV4MTP(FusedHead):
    OWN = ("enorm", "hnorm", "eh_proj", "final_layernorm")
    WIRING = Wiring(final_norm="final_layernorm")
    zero_first_embedding = False
    chain_hidden = "post"

    def __init__(self, args: Any):
        super().__init__(
            _Block(args), self.WIRING.modules(args.hidden_size, args.rms_norm_eps)
        )
        exact_indexers(self.block)

    def make_cache(self) -> List[Any]:
        return head_cache()


def num_layers(config: Dict[str, Any]) -> int:
    return int(config.get("num_nextn_predict_layers", 1) or 0)


def prefix(config: Dict[str, Any], j: int = 0) -> str:
    return f"{PREFIX}{j}."


def is_mtp_key(key: str, config: Dict[str, Any]) -> bool:
    return key.startswith(PREFIX)


def build(
    args: Any, config: Dict[str, Any], backbone: nn.Module, weights: Dict[str, mx.array]
) -> MTPHead:
    if any(k.startswith(prefix(config, 1)) for k in weights):
        raise ValueError(
            "this head has more than one MTP layer; mlx-vlm's drafter (the "
            "source of truth) runs model.mtp_layers.0 alone"
        )
    return HyV4MTP(args)
