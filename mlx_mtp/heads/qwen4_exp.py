"""Qwen3.8-Flash-Next (``qwen4_exp``) MTP head: hyper-connection streams, one QSA layer.

The source of truth is mlx-vlm 0.7.10 (``speculative/drafters/qwen4_exp_mtp/
qwen4_exp_mtp.py``, ``models/qwen4_exp/language.py``); mlx-lm 0.32 has no such
model, and the trunk loads through mlx-vlm's classes (``mlx_mtp.vlm_text``).

The trunk carries ``hc_count`` streams of width ``H`` (``[B, L, hc * H]``) and
ends with no norm: its ``hyper_connection_mixer`` folds the streams into the
one state the output head reads. The head reads the streams before that mixer
(the target's "pre" tap on it) at position ``i`` with the embedding of
``t_{i+1}``::

    x = fc_hidden(pre_fc_norm_hidden(h).split(hc))
        + fc_embedding(pre_fc_norm_embedding(e))

one RMSNorm over all ``hc * H`` of ``h`` and ``fc_hidden`` applied to each
stream, the projected embedding added to every stream; then one decoder layer
of the trunk's QSA kind (``mtp.layers.0``: QSA attention with its indexer, MoE,
the two hyper-connection gates; no per-layer n-gram embedding), then the head's
OWN ``hyper_connection_mixer``, then the trunk's output head. The next draft
reads the layer's streams before the mixer (``chain_hidden = "pre"``). Positions
are the head's own (its cache offset, from 0 at the prompt), the embedding at
position 0 is kept, the RMSNorms are zero-centred (``1 + w``, mlx-vlm's
``Qwen4ExpRMSNorm``). Released checkpoints have one MTP layer, which drafts
every depth, as mlx-vlm's drafter runs it.

The blocks are mlx-vlm's own (``Qwen4ExpDecoderLayer``,
``Qwen4ExpGatedResidual``, ``Qwen4ExpRMSNorm``): the family needs mlx-vlm,
which the loader checks first (``vlm_text.require``), so that its absence is
one line.
"""

from dataclasses import replace
from typing import Any, Dict, List

import mlx.core as mx
import mlx.nn as nn
from mlx_vlm.models.qwen3_5.language import _create_qwen3_5_attention_mask
from mlx_vlm.models.qwen4_exp.language import (
    Qwen4ExpDecoderLayer,
    Qwen4ExpGatedResidual,
    Qwen4ExpRMSNorm,
)

from ..recurrent.vlm_cache import RollbackQSACache, ragged_qsa
from ..recurrent.vlm_cache import patch_trunk  # noqa: F401  (the loader's hook)
from .base import MTPHead
from .qwen3_next import sanitize_block  # noqa: F401  (fused experts -> switch_mlp)

MODEL_TYPES = {
    "qwen4_exp": "Qwen3.8-Flash-Next (source of truth: mlx-vlm 0.7.10 qwen4_exp_mtp)"
}
PREFIX = "mtp."
# Over several processes: why ``mlx_mtp.distributed`` refuses it (one line)
NO_SPLIT = (
    "mlx-mtp has no tensor split written for its mlx-vlm layers (gated delta "
    "nets, QSA sparse attention with its indexer cache, per-layer embeddings), "
    "and mlx-vlm has none"
)
DEFAULT_HIDDEN_TAP = "pre"  # the streams before the trunk's mixer


class _Block(nn.Module):
    """``mtp.layers``: the head's one decoder layer, where the checkpoint puts it."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layers = [layer]


class Qwen4ExpMTP(MTPHead):
    OWN = (
        "pre_fc_norm_embedding",
        "pre_fc_norm_hidden",
        "fc_embedding",
        "fc_hidden",
        "hyper_connection_mixer",
    )
    zero_first_embedding = False
    chain_hidden = "pre"

    def __init__(self, args: Any):
        super().__init__()
        self.hc = args.hc_count
        self.width = args.hidden_size
        eps = args.rms_norm_eps
        self.pre_fc_norm_embedding = Qwen4ExpRMSNorm(self.width, eps=eps)
        self.pre_fc_norm_hidden = Qwen4ExpRMSNorm(self.hc * self.width, eps=eps)
        self.fc_embedding = nn.Linear(self.width, self.width, bias=False)
        self.fc_hidden = nn.Linear(self.width, self.width, bias=False)
        one = replace(
            args,
            num_hidden_layers=1,
            layer_types=["qwen_sparse_attention"],
            full_attention_interval=1,
            ple_layer_ids=[],
        )
        self.block = _Block(Qwen4ExpDecoderLayer(one, layer_idx=0))
        self.hyper_connection_mixer = Qwen4ExpGatedResidual(one, use_combine=False)
        ragged_qsa(self.block)  # a batch's streams, each at its own offset

    def fuse(self, embedded: mx.array, hidden: mx.array) -> mx.array:
        if hidden.shape[-1] != self.hc * self.width:
            raise ValueError(
                f"the head reads {self.hc} streams of {self.width} "
                f"({self.hc * self.width}), not {hidden.shape[-1]}"
            )
        e = self.fc_embedding(self.pre_fc_norm_embedding(embedded))
        streams = self.pre_fc_norm_hidden(hidden)
        streams = streams.reshape(*hidden.shape[:-1], self.hc, self.width)
        return (self.fc_hidden(streams) + e[..., None, :]).reshape(hidden.shape)

    def final_norm(self, x: mx.array) -> mx.array:
        return self.hyper_connection_mixer(x)

    def states(self, hidden, tokens, cache):
        c = cache[0] if cache is not None else None
        x = self.fuse(self.embed(tokens), hidden)
        B, L = tokens.shape
        offset = 0 if c is None else c.offset
        if isinstance(offset, mx.array):  # a batch's streams, one offset each
            offset = offset.reshape(-1, 1)
        positions = mx.broadcast_to(mx.arange(L, dtype=mx.int32)[None] + offset, (B, L))
        mask = _create_qwen3_5_attention_mask(x, c)
        x = self.block.layers[0](
            x, tokens, mask=mask, cache=c, position_ids=positions
        )
        return self.final_norm(x), x

    def make_cache(self) -> List[Any]:
        return [RollbackQSACache()]


def _text(config: Dict[str, Any]) -> Dict[str, Any]:
    return config.get("text_config", config)


def num_layers(config: Dict[str, Any]) -> int:
    return int(_text(config).get("mtp_num_hidden_layers", 1) or 0)


def prefix(config: Dict[str, Any], j: int = 0) -> str:
    return PREFIX


def is_mtp_key(key: str, config: Dict[str, Any]) -> bool:
    return key.startswith(PREFIX)


def layers_present(names, config: Dict[str, Any]) -> int:
    return 1 if any(k.startswith(PREFIX) for k in names) else 0


def build(
    args: Any, config: Dict[str, Any], backbone: nn.Module, weights: Dict[str, mx.array]
) -> MTPHead:
    if any(k.startswith(f"{PREFIX}layers.1.") for k in weights):
        raise ValueError(
            "this head has more than one MTP layer; mlx-vlm's drafter (the "
            "source of truth) runs one"
        )
    return Qwen4ExpMTP(args)

