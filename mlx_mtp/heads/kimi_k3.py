"""Kimi-K3 MTP head (Kimi delta attention + MLA trunks, attention residuals).

Wiring read from vLLM ``model_executor/models/kimi_k3/mtp.py`` (``KimiK3MTP``,
the draft model of Kimi-K3 and Kimi-Linear) and ``kimi_k3/linear.py``
(``KimiDecoderLayer``, ``KimiLinearModel``). The count is the text config's
``num_nextn_predict_layers``; layer ``j`` sits at ``N + j``
(``N = num_hidden_layers``), under ``language_model.`` as the trunk's tensors
in mlx-lm's naming::

    language_model.model.layers.{N}.enorm / hnorm / eh_proj    fuse, embedding FIRST
    language_model.model.layers.{N}.shared_head.norm / .head   head optional
    language_model.model.layers.{N}.embed_tokens               optional
    language_model.model.layers.{N}.input_layernorm, self_attn.*,
        post_attention_layernorm, block_sparse_moe.* (or mlp.*)   the block

- the block is the trunk's decoder layer built at index ``N``: full attention
  (MLA, NoPE), since ``kda_layers`` names trunk layers only (vLLM parses the
  index from the layer's prefix "so that KimiDecoderLayer can pick MLA"), and
  MoE where the trunk's layer ``N`` would be; vLLM builds it with
  ``attn_res_block_size=None``: no attention residuals in the draft;
- ``fused_mtp_input`` zeroes the embedding where the position is 0 and
  concatenates ``[enorm(e), hnorm(h)]``;
- the trunk hands over its hidden state BEFORE its final norm
  (``KimiLinearModel.forward`` returns it un-normed: "the final norm is
  applied in compute_logits ... so the MTP draft model receives the pre-norm
  hidden states"), after the output attention-residual mix;
- the layer returns ``shared_head.norm``'s output for the logits and the sum
  before it "for the recurrent state": a chained draft reads the pre-norm
  block output (vLLM's proposer feeds the second tensor back).

The block's cache is a ``KVCache``; the trunk's KDA layers roll back through
``kda_cache``.
"""

from dataclasses import replace
from typing import Any, Dict

import mlx.core as mx
import mlx.nn as nn

from ..errors import MTPError
from ..recurrent.kda_cache import patch_k3_trunk as patch_trunk  # noqa: F401  (loader hook)
from .base import MTPHead, MultiLayerHead
from .deepseek import DeepSeekMTP

MODEL_TYPES = {"kimi_k3": "Kimi-K3"}
DEFAULT_HIDDEN_TAP = "pre"
PREFIX = "language_model.model.layers."


def _text(config: Dict[str, Any]) -> Dict[str, Any]:
    return config.get("text_config") or config


def num_layers(config: Dict[str, Any]) -> int:
    return int(_text(config).get("num_nextn_predict_layers", 0) or 0)


def prefix(config: Dict[str, Any], j: int = 0) -> str:
    return f"{PREFIX}{_text(config)['num_hidden_layers'] + j}."


def is_mtp_key(key: str, config: Dict[str, Any]) -> bool:
    layer = key[len(PREFIX) :].split(".", 1)[0] if key.startswith(PREFIX) else ""
    return layer.isdigit() and int(layer) >= _text(config)["num_hidden_layers"]


def _is_moe(args: Any, i: int) -> bool:
    # mlx-lm kimi_k3.KimiK3DecoderLayer's rule (vLLM's is_moe_layer)
    return (
        (args.num_experts or 0) > 0
        and i >= args.first_k_dense_replace
        and i % args.moe_layer_freq == 0
    )


def _is_kda(args: Any, i: int) -> bool:
    return (i + 1) in args.linear_attn_config["kda_layers"]


def TRUNK_LAYER_PREFIX(model: nn.Module) -> str:
    """A trunk MLA layer whose MLP is dense or MoE as the MTP block's is."""
    args = model.language_model.args
    moe = _is_moe(args, args.num_hidden_layers)
    for i in range(args.num_hidden_layers):
        if not _is_kda(args, i) and _is_moe(args, i) == moe:
            return f"{PREFIX}{i}."
    raise MTPError("no trunk MLA layer has the MTP block's kind of MLP")


def _one_output(block: nn.Module) -> nn.Module:
    """mlx-lm's layer returns ``(h, residual blocks)``; the head wants ``h``."""
    base = type(block)

    class Block(base):
        def __call__(self, x: mx.array, mask: Any = None, cache: Any = None):
            return base.__call__(self, x, mask, cache)[0]

    Block.__name__ = base.__name__
    block.__class__ = Block
    return block


class KimiK3MTP(DeepSeekMTP):
    chain_hidden = "pre"


def _layer(args, config, weights, j: int) -> KimiK3MTP:
    from mlx_lm.models.kimi_k3 import KimiK3DecoderLayer

    n = args.num_hidden_layers + j
    if _is_kda(args, n):
        # vLLM's MTP block is MLA; a KDA one would need its state rolled back
        raise MTPError(f"MTP layer {n} is a Kimi delta attention layer")
    block = KimiK3DecoderLayer(replace(args, attn_res_block_size=None), n)
    pre = prefix(config, j)
    return KimiK3MTP(
        args,
        _one_output(block),
        has_embed=f"{pre}embed_tokens.weight" in weights,
        has_head=any(k.startswith(f"{pre}shared_head.head.") for k in weights),
    )


def build(
    args: Any, config: Dict[str, Any], backbone: nn.Module, weights: Dict[str, mx.array]
) -> MTPHead:
    text = args.text_config  # mlx-lm's kimi_k3.ModelArgs
    # vLLM runs layer ``spec_step_idx % n``: layer j drafts depth j + 1
    n = max(1, num_layers(config))
    layers = [_layer(text, config, weights, j) for j in range(n)]
    return layers[0] if n == 1 else MultiLayerHead(layers)
