"""A toy MTP family for Llama trunks, for the tests only: what adding a family is.

Checkpoint layout::

    mtp.embed_norm / mtp.hidden_norm / mtp.proj     fuse, the HIDDEN state first
    mtp.input_layernorm, self_attn.*, post_attention_layernorm, mlp.*
    mtp.out_norm                                    closes the block

Zero-centred norms (``1 + w``), the embedding zeroed at position 0, the
trunk's embedding and output head. ``test_new_family`` puts this folder on
``mlx_mtp.heads``'s path, where a real family's module lives.
"""

from typing import Any, Dict

import mlx.core as mx
import mlx.nn as nn

from .base import MTPHead
from .wiring import FusedHead, Wiring, ZeroCentredRMSNorm

MODEL_TYPES = {"llama": "a toy head on Llama (tests only)"}
PREFIX = "mtp."


class ToyMTP(FusedHead):
    OWN = ("embed_norm", "hidden_norm", "proj", "out_norm")
    WIRING = Wiring(*OWN, hidden_first=True, norm=ZeroCentredRMSNorm)


def num_layers(config: Dict[str, Any]) -> int:
    return 1


def prefix(config: Dict[str, Any], j: int = 0) -> str:
    return PREFIX


def is_mtp_key(key: str, config: Dict[str, Any]) -> bool:
    return key.startswith(PREFIX)


def build(
    args: Any, config: Dict[str, Any], backbone: nn.Module, weights: Dict[str, mx.array]
) -> MTPHead:
    block = type(backbone.layers[0])(args)
    return ToyMTP(block, ToyMTP.WIRING.modules(args.hidden_size, args.rms_norm_eps))
