"""Xiaomi MiMo MTP head.

Checkpoint layout::

    model.mtp_layers.{j}.token_layernorm / hidden_layernorm / input_proj
    model.mtp_layers.{j}.final_layernorm
    model.mtp_layers.{j}.input_layernorm, self_attn.*, post_attention_layernorm, mlp.*

The fuse concatenates the HIDDEN state first (vLLM ``mimo_mtp.py``), unlike the
DeepSeek family. Embedding and output head are the trunk's.
"""

from typing import Any, Dict

import mlx.core as mx
import mlx.nn as nn

from .base import MTPHead
from .wiring import FusedHead, Wiring

MODEL_TYPES = {"mimo": "MiMo-7B"}


class MiMoMTP(FusedHead):
    OWN = ("token_layernorm", "hidden_layernorm", "input_proj", "final_layernorm")
    WIRING = Wiring(
        "token_layernorm",
        "hidden_layernorm",
        "input_proj",
        "final_layernorm",
        hidden_first=True,
    )


def num_layers(config: Dict[str, Any]) -> int:
    return int(config.get("num_nextn_predict_layers", 0) or 0)


def prefix(config: Dict[str, Any], j: int = 0) -> str:
    return f"model.mtp_layers.{j}."


def is_mtp_key(key: str, config: Dict[str, Any]) -> bool:
    return key.startswith("model.mtp_layers.")


def build(
    args: Any, config: Dict[str, Any], backbone: nn.Module, weights: Dict[str, mx.array]
) -> MTPHead:
    block = type(backbone.layers[0])(args)
    return MiMoMTP(block, MiMoMTP.WIRING.modules(args.hidden_size, args.rms_norm_eps))
