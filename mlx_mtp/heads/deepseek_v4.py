"""DeepSeek-V4-Flash (``deepseek_v4``) MTP head: hyper-connection streams, window block.

The source of truth is mlx-vlm 0.7.10 (``speculative/drafters/deepseek_v4_mtp/
deepseek_v4_mtp.py`` with ``drafters/mtp_base.py``; the trunk
``models/deepseek_v4/{language.py, hyper_connection.py, config.py}``); mlx-lm
0.32 has no ``deepseek_v4``, and the trunk loads through mlx-vlm's classes
(``mlx_mtp.vlm_text``). The checkpoint is DeepSeek's original layout
(``embed``, ``head``, ``layers.{i}.*``, the head under ``mtp.0.``)::

    mtp.0.enorm / hnorm / e_proj / h_proj      the fuse
    mtp.0.attn.*, ffn.*, attn_norm, ffn_norm,
        hc_attn_{fn,base,scale}, hc_ffn_*      the block: a trunk layer's tensors
    mtp.0.hc_head_{fn,base,scale}, mtp.0.norm  the head's own collapse and norm

- the trunk carries ``hc_mult`` residual streams (``[B, T, hc, D]``) and ends
  ``norm(hc_head(h))``; the head reads ``h``, the streams its last decoder
  layer hands on, before ``hc_head`` and the norm (mlx-vlm's drafter takes
  the trunk's ``skip_final_norm`` output): a tap of that layer's output;
- the fuse is per stream, summed: ``e_proj(enorm(embed(t)))`` broadcast over
  the streams plus ``h_proj(hnorm(h_s))`` for each stream ``s`` (DeepSeek-V4.1's
  head shares it, ``DeepSeekV41MTP.fuse``); the embedding and ``head`` are the
  trunk's; no position-0 zeroing;
- the block is a trunk decoder layer (mlx-vlm's ``DeepseekV4Block``) with only
  the sliding window (the drafter builds it with ``compress_ratios=[0]`` and
  ``num_hash_layers=0``: learned routing, no compressor), its own windowed
  cache; RoPE position ``i`` (the head's cache offset, from 0 at the prompt)
  for the pair ``(h_i, t_{i+1})``;
- then the head's OWN ``hc_head`` (V4's mixer, ``sigmoid(mix * scale + base) +
  hc_eps`` over the normed flattened streams, the formula V4.1's head uses
  where a checkpoint has one), its own ``norm``, the trunk's ``head``;
- a chained draft feeds back the block's output streams, before ``hc_head``
  (``chain_hidden = "pre"``; the drafter feeds back ``h``). Released
  checkpoints have one MTP layer, which drafts every depth.

The trunk's window and compressor caches roll back through
``recurrent.compressed_cache``.
"""

from dataclasses import replace
from typing import Any, Dict, List, Optional

import mlx.core as mx
import mlx.nn as nn

from .base import MTPHead
from .common import rows_in
from .deepseek_v41 import DeepSeekV41MTP, is_mtp_key, unusable_head  # noqa: F401

MODEL_TYPES = {
    "deepseek_v4": "DeepSeek-V4-Flash (source of truth: mlx-vlm 0.7.10 deepseek_v4_mtp)"
}
PREFIX = "mtp.0."
# sanitized as a trunk layer (mlx-vlm's names come out under ``model.``)
TRUNK_LAYER_PREFIX = "layers.0."


# mlx-vlm is imported where it is used: reading a folder's description
# (``info``) or its head's names needs no mlx-vlm, and a command that does
# says so in one line first (``vlm_text.require``)
try:
    from ..recurrent.compressed_cache import WindowedKVCache
    from ..recurrent.compressed_cache import patch_trunk  # noqa: F401  (loader hook)
except ImportError:  # no mlx-vlm: nothing of this family loads to be patched
    pass


def split_counts(config: Dict[str, Any]) -> List[int]:
    """What ``shard_trunk`` divides by the number of processes: the attention
    heads and their output groups (the one KV head is kept whole)."""
    return [config["num_attention_heads"], config["o_groups"]]


def shard_trunk(model: nn.Module, group: Any) -> None:
    """Tensor-split mlx-vlm's DeepSeek-V4 language model (lazy) over ``group``;
    ``model.model.layers`` holds the head's block too while this runs.

    Each process keeps whole output groups, as mlx-lm's DeepSeek-V4.1 split
    does: the heads of ``o_groups / N`` groups (``wq_b``'s rows, ``wo_a``'s
    groups, ``wo_b``'s columns for them, their ``attn_sink``), and ``1 / N`` of
    every expert's and the shared expert's width; the attention and the MoE
    each end with one ``all_sum`` (mlx-vlm's ``sharding_group``). The one KV
    head, the compressor, the indexer, the router and the hyper-connection
    mixes stay whole on every process. mlx-vlm 0.7.10's own ``shard`` is not
    used: it splits every group's heads (``wq_b`` in ``o_groups`` segments) but
    takes a contiguous run of ``attn_sink``, other heads' sinks where
    ``o_groups > 1``. Modules stay of their classes (``shard_inplace``), so
    mlx-vlm's exact-verify projections still see a ``QuantizedLinear``."""
    from mlx.nn.layers.distributed import shard_inplace

    n, rank = group.size(), group.rank()
    for layer in model.model.layers:
        attn, ffn = layer.attn, layer.ffn
        shard_inplace(attn.wq_b, "all-to-sharded", group=group)
        shard_inplace(attn.wo_a, lambda path, w: 0, group=group)  # by group
        rows_in(attn.wo_b, group)
        attn.n_heads //= n
        attn.o_groups //= n
        h = attn.n_heads
        attn.attn_sink = attn.attn_sink[rank * h : (rank + 1) * h]
        attn.sharding_group = group
        ffn.sharding_group = group
        for mlp in (ffn.switch_mlp, ffn.shared_experts):
            shard_inplace(mlp.gate_proj, "all-to-sharded", group=group)
            shard_inplace(mlp.up_proj, "all-to-sharded", group=group)
            rows_in(mlp.down_proj, group)


def num_layers(config: Dict[str, Any]) -> int:
    return int(config.get("num_nextn_predict_layers", 1) or 0)


def prefix(config: Dict[str, Any], j: int = 0) -> str:
    return PREFIX


class DeepSeekV4MTP(DeepSeekV41MTP):
    """V4.1's head (its fuse, norms, projections and ``hc_head`` collapse)
    around V4's block: mlx-vlm's ``DeepseekV4Block``, two-pass hyper-connections."""

    chain_hidden = "pre"

    def __init__(self, args: Any):
        from mlx_vlm.models.deepseek_v4.language import DeepseekV4Block

        one = replace(args, num_hidden_layers=1, compress_ratios=[0], num_hash_layers=0)
        super().__init__(args, DeepseekV4Block(one, layer_idx=0), hc_head=True)

    def make_cache(self) -> List[Any]:
        # every row kept (the mask applies the window), so tentative rows trim away
        return [WindowedKVCache()]

    def states(self, hidden: mx.array, tokens: mx.array, cache: Optional[List[Any]]):
        from mlx_vlm.models.base import create_attention_mask

        c = cache[0] if cache is not None else None
        B, L = tokens.shape
        x = self.fuse(self.embed(tokens), hidden)
        mask = create_attention_mask(
            x[:, :, 0, :], c, window_size=self.args.sliding_window, return_array=True
        )
        offset = 0 if c is None else c.offset
        x = self.block(x, mask, c, tokens, position_offset=offset)
        return self.norm(self._collapse(x, None)), x.reshape(B, L, -1)


def build(
    args: Any, config: Dict[str, Any], backbone: nn.Module, weights: Dict[str, mx.array]
) -> MTPHead:
    found = sorted({k.split(".")[1] for k in weights if k.startswith("mtp.")})
    if found != ["0"]:
        raise ValueError(
            f"the head's tensors are under mtp.{{{','.join(found)}}}.; mlx-vlm's "
            "drafter (the source of truth) runs one layer, mtp.0."
        )
    return DeepSeekV4MTP(args)
