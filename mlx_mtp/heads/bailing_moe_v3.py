"""Ling-3 MTP head (``bailing_moe_v3``: Kimi delta attention + MLA trunks).

Ling-3 checkpoints say ``model_type`` ``bailing_hybrid`` with the architecture
``BailingMoeV3ForCausalLM``; mlx-lm loads them as ``bailing_moe_v3`` and so
does this family (``heads.module_type``). Layout and wiring from vLLM
``model_executor/models/bailing_moe_v3_mtp.py`` (``BailingMoeV3MTPModel``;
``N = num_hidden_layers``, count in ``num_nextn_predict_layers``; mlx-lm's
``sanitize`` drops these layers)::

    model.layers.{N}.enorm / hnorm / eh_proj            fuse, embedding FIRST
    model.layers.{N}.input_layernorm, attention.*, post_attention_layernorm, mlp.*
    model.layers.{N}.final_layernorm                    closes the block
    model.layers.{N}.shared_head.head                   optional output head

- the block is an MLA attention (``BailingMoeV3MLAAttention``, rotary
  positions) and a MoE (``BailingMoeV3MoE``) with the trunk's layer norms:
  mlx-lm's ``BailingDecoderLayer`` built at index ``N``, which is past the
  last full layer group and so MLA; its cache is a ``KVCache``;
- embedding and output head are the trunk's (vLLM loads
  ``model.word_embeddings`` and ``lm_head`` into the draft; its shared head
  adds no norm); a checkpoint's own ``shared_head.head`` is used if present;
- the embedding is NOT zeroed at position 0 (the layer's forward takes the
  embeddings as they come);
- the trunk's hidden state is read after its final norm (``BailingMoeV3Model``
  returns it normed) and a chained draft reads ``final_layernorm``'s output,
  the one tensor the layer returns;
- vLLM renames ``mlp.gate.e_score_correction_bias`` to ``mlp.gate.expert_bias``
  for this layer; so does ``LingV3MTP.load_weights``.

The trunk's KDA layers roll back through ``kda_cache``.
"""

from typing import Any, Dict

import mlx.core as mx
import mlx.nn as nn

from ..errors import MTPError
from ..recurrent.kda_cache import patch_bailing_trunk as patch_trunk  # noqa: F401  (loader)
from . import deepseek
from .bailing_hybrid import BailingMTP
from .base import MTPHead

MODEL_TYPES = {"bailing_moe_v3": "Ling-3 (bailing_hybrid)"}

num_layers = deepseek.num_layers
prefix = deepseek.prefix
is_mtp_key = deepseek.is_mtp_key


class LingV3MTP(BailingMTP):
    zero_first_embedding = False

    def load_weights(self, weights, strict: bool = True):
        # vLLM's name for the router bias of this layer; mlx-lm's is expert_bias
        old, new = ".mlp.gate.e_score_correction_bias", ".mlp.gate.expert_bias"
        weights = [(k.replace(old, new), v) for k, v in weights]
        return super().load_weights(weights, strict)


def TRUNK_LAYER_PREFIX(model: nn.Module) -> str:
    """A trunk MoE layer: mlx-lm's sanitize stacks experts from there on."""
    args = model.args
    if args.first_k_dense_replace >= args.num_hidden_layers:
        raise MTPError("the trunk has no MoE layer to sanitize the MTP block as")
    return f"model.layers.{args.first_k_dense_replace}."


def build(
    args: Any, config: Dict[str, Any], backbone: nn.Module, weights: Dict[str, mx.array]
) -> MTPHead:
    n = args.num_hidden_layers
    if num_layers(config) > 1:
        raise MTPError("Ling-3 MTP with more than one layer is not supported")
    block = deepseek.make_block(backbone, args, n)
    if block.is_linear:  # mlx-lm's rule: layers past the last group are MLA
        raise MTPError(f"MTP layer {n} is a Kimi delta attention layer")
    head = f"{prefix(config)}shared_head.head."
    return LingV3MTP(args, block, any(k.startswith(head) for k in weights))
