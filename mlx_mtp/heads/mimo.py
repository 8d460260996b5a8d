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

MODEL_TYPES = ("mimo",)


class MiMoMTP(MTPHead):
    OWN = ("token_layernorm", "hidden_layernorm", "input_proj", "final_layernorm")

    def __init__(self, args: Any, block: nn.Module):
        super().__init__()
        dims, eps = args.hidden_size, args.rms_norm_eps
        self.token_layernorm = nn.RMSNorm(dims, eps=eps)
        self.hidden_layernorm = nn.RMSNorm(dims, eps=eps)
        self.input_proj = nn.Linear(2 * dims, dims, bias=False)
        self.final_layernorm = nn.RMSNorm(dims, eps=eps)
        self.block = block

    def fuse(self, embedded: mx.array, hidden: mx.array) -> mx.array:
        x = mx.concatenate(
            [self.hidden_layernorm(hidden), self.token_layernorm(embedded)], axis=-1
        )
        return self.input_proj(x)

    def final_norm(self, x: mx.array) -> mx.array:
        return self.final_layernorm(x)


def num_layers(config: Dict[str, Any]) -> int:
    return int(config.get("num_nextn_predict_layers", 0) or 0)


def prefix(config: Dict[str, Any], j: int = 0) -> str:
    return f"model.mtp_layers.{j}."


def is_mtp_key(key: str, config: Dict[str, Any]) -> bool:
    return key.startswith("model.mtp_layers.")


def build(
    args: Any, config: Dict[str, Any], backbone: nn.Module, weights: Dict[str, mx.array]
) -> MTPHead:
    return MiMoMTP(args, type(backbone.layers[0])(args))
