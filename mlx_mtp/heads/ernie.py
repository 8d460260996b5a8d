"""Baidu ERNIE-4.5 MoE MTP head (``ernie4_5_moe``).

Checkpoint layout (``num_nextn_predict_layers`` = 1)::

    model.mtp_emb_norm.0 / model.mtp_hidden_norm.0 / model.mtp_linear_proj.0
    model.mtp_block.0.input_layernorm, self_attn.*, post_attention_layernorm, mlp.*

The fuse is ``mtp_linear_proj(concat[emb_norm(embed(t_{i+1})), hidden_norm(h_i)])``,
embedding first, plain RMSNorms; the block is a dense decoder layer of the
trunk's class (MLP width ``intermediate_size``). Embedding and output head
are the trunk's.

Wiring from Baidu's own engine, FastDeploy
(``fastdeploy/model_executor/models/ernie4_5_mtp.py``): the block output goes
through the trunk's final norm (the shared ``ernie.norm``) before the shared
``lm_head``, the embedding at position 0 is kept, and the trunk hands over its
final-norm output. vLLM's ``ernie_mtp.py`` zeroes position 0 and applies no
norm before the head; FastDeploy is the reference the model was released with.
A checkpoint with several ``mtp_block`` layers (FastDeploy stacks them in one
depth) is refused: released ones have one.
"""

from dataclasses import replace
from types import SimpleNamespace
from typing import Any, Dict

import mlx.core as mx
import mlx.nn as nn

from .base import MTPHead
from .wiring import FusedHead, Wiring

MODEL_TYPES = {"ernie4_5_moe": "ERNIE-4.5 MoE"}
PREFIX = "model."
_OWN = ("mtp_emb_norm", "mtp_hidden_norm", "mtp_linear_proj")


class _Block(nn.Module):
    """``mtp_block.0``, so the block's tensors keep their checkpoint names."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.mtp_block = [layer]

    def __call__(self, x: mx.array, mask: Any, cache: Any) -> mx.array:
        return self.mtp_block[0](x, mask, cache)


class ErnieMTP(FusedHead):
    OWN = _OWN
    WIRING = Wiring(
        "mtp_emb_norm.0", "mtp_hidden_norm.0", "mtp_linear_proj.0", final_norm=None
    )
    zero_first_embedding = False  # FastDeploy keeps position 0

    def __init__(self, args: Any, block: nn.Module, trunk_norm: nn.Module):
        modules = self.WIRING.modules(args.hidden_size, args.rms_norm_eps)
        super().__init__(_Block(block), modules)
        # the trunk's final norm, not a parameter of the head
        self._trunk = SimpleNamespace(norm=trunk_norm)

    def final_norm(self, x: mx.array) -> mx.array:
        norm = self._trunk.norm
        return mx.fast.rms_norm(x, norm.weight, norm.eps)


def num_layers(config: Dict[str, Any]) -> int:
    return int(config.get("num_nextn_predict_layers", 0) or 0)


def prefix(config: Dict[str, Any], j: int = 0) -> str:
    return PREFIX


def is_mtp_key(key: str, config: Dict[str, Any]) -> bool:
    return key.startswith(tuple(f"{PREFIX}{n}." for n in _OWN + ("mtp_block",)))


def sanitize_block(weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
    # a dense block needs no rewriting; the trunk's sanitize would drop it by name
    return weights


def build(
    args: Any, config: Dict[str, Any], backbone: nn.Module, weights: Dict[str, mx.array]
) -> MTPHead:
    # dense: mlx-lm builds the MLP as MoE only from moe_layer_start_index on
    dense = replace(args, moe_layer_start_index=args.num_hidden_layers + 1)
    block = type(backbone.layers[0])(dense, 0)
    return ErnieMTP(args, block, backbone.norm)
