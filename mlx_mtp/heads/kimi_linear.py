"""Kimi-Linear MTP head (Kimi delta attention + MLA trunks).

The layout is DeepSeek's (``N = num_hidden_layers``, count in
``num_nextn_predict_layers``), read from vLLM ``models/kimi_k3/mtp.py``
(``KimiK3MTP``, the MTP model of configs of type ``KimiLinearConfig``)::

    model.layers.{N}.enorm / hnorm / eh_proj            fuse, embedding FIRST
    model.layers.{N}.shared_head.norm / .head           head optional
    model.layers.{N}.embed_tokens                       optional
    model.layers.{N}.input_layernorm, self_attn.*, post_attention_layernorm,
        block_sparse_moe.* (or mlp.*)                   a ``KimiDecoderLayer``

The block is the trunk's decoder layer built at index ``N``: not in
``kda_layers``, so MLA (full attention), and MoE where the trunk's layer
``N`` would be. vLLM zeroes the embedding at position 0 (``fused_mtp_input``
masks it where ``position == 0``). Both hidden states are read BEFORE a norm
(vLLM ``kimi_k3/linear.py`` and ``mtp.py``, see ``kimi_k3.py`` here): the
trunk's, because ``KimiLinearModel`` applies its final norm only in
``compute_logits``, and a chained draft's, because the MTP layer returns the
block output before ``shared_head.norm`` as the state it feeds back. The
trunk's ``sanitize`` turns the block's checkpoint tensors
(``block_sparse_moe`` experts, joined ``kv_b_proj``) into mlx-lm's, run on a
trunk layer whose MLP is of the block's kind.
"""

from typing import Any, Dict

import mlx.core as mx
import mlx.nn as nn

from ..errors import MTPError
from ..recurrent.kda_cache import patch_trunk  # noqa: F401  (the loader's hook)
from . import deepseek
from .base import MTPHead

MODEL_TYPES = {"kimi_linear": "Kimi-Linear"}
DEFAULT_HIDDEN_TAP = "pre"

num_layers = deepseek.num_layers
prefix = deepseek.prefix
is_mtp_key = deepseek.is_mtp_key


def _is_moe(args: Any, i: int) -> bool:
    # mlx-lm kimi_linear.KimiDecoderLayer's rule
    return (
        args.num_experts > 0
        and i >= args.first_k_dense_replace
        and i % args.moe_layer_freq == 0
    )


def TRUNK_LAYER_PREFIX(model: nn.Module) -> str:
    """A trunk layer whose MLP is dense or MoE as the MTP block's is."""
    args = model.args
    moe = _is_moe(args, args.num_hidden_layers)
    for i in range(args.num_hidden_layers):
        if _is_moe(args, i) == moe:
            return f"model.layers.{i}."
    raise MTPError("no trunk layer has the MTP block's kind of MLP")


def build(
    args: Any, config: Dict[str, Any], backbone: nn.Module, weights: Dict[str, mx.array]
) -> MTPHead:
    head = deepseek.build(args, config, backbone, weights)
    for j in range(head.num_layers):
        head.layer(j).chain_hidden = "pre"
    return head
