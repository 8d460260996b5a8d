"""Ling's hybrid MTP head (``bailing_hybrid``: lightning attention + MLA trunks).

Checkpoint layout (vLLM ``model_executor/models/bailing_moe_mtp.py``,
``BailingMoeV25MTPModel``; ``N = num_hidden_layers``, count in
``num_nextn_predict_layers``; mlx-lm's ``sanitize`` drops these layers)::

    model.layers.{N}.enorm / hnorm / eh_proj            fuse, embedding FIRST
    model.layers.{N}.input_layernorm, attention.*, post_attention_layernorm, mlp.*
    model.layers.{N}.final_layernorm                    closes the block
    model.layers.{N}.shared_head.head                   optional output head

The block is the trunk's decoder layer built at index ``N``: past the last
full group, so MLA with rotary positions, and MoE. Embedding and output head
are the trunk's (vLLM loads ``model.word_embeddings`` and ``lm_head`` into the
draft; its shared head adds no norm). vLLM zeroes the embedding at position 0
and feeds the trunk's output hidden state, after the final norm.
"""

from typing import Any, Dict

import mlx.core as mx
import mlx.nn as nn

from ..recurrent.lightning_cache import patch_trunk  # noqa: F401  (the loader's hook)
from . import deepseek
from .base import MTPHead
from .wiring import FusedHead, Wiring

MODEL_TYPES = {"bailing_hybrid": "Ling hybrid (Ling-2.5)"}

num_layers = deepseek.num_layers
prefix = deepseek.prefix
is_mtp_key = deepseek.is_mtp_key


class BailingMTP(FusedHead):
    OWN = ("enorm", "hnorm", "eh_proj", "final_layernorm", "shared_head")
    WIRING = Wiring(final_norm="final_layernorm")

    def __init__(self, args: Any, block: nn.Module, has_head: bool):
        dims = args.hidden_size
        super().__init__(block, self.WIRING.modules(dims, args.rms_norm_eps))
        if has_head:
            self.shared_head = nn.Module()
            self.shared_head.head = nn.Linear(dims, args.vocab_size, bias=False)

    def output(self):
        if "shared_head" in self:
            return self.shared_head.head
        return super().output()


def build(
    args: Any, config: Dict[str, Any], backbone: nn.Module, weights: Dict[str, mx.array]
) -> MTPHead:
    block = deepseek.make_block(backbone, args, args.num_hidden_layers)
    head = f"{prefix(config)}shared_head.head."
    return BailingMTP(args, block, any(k.startswith(head) for k in weights))
