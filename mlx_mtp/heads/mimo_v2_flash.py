"""Xiaomi MiMo-V2-Flash / V2.6 MTP head (``mimo_v2_flash``): layer j drafts depth j+1.

Checkpoint layout (vLLM ``models/mimo_v2_mtp.py``; three layers)::

    model.mtp.layers.{j}.enorm / hnorm / eh_proj          fuse, embedding FIRST
    model.mtp.layers.{j}.input_layernorm, self_attn.* (+ attention_sink_bias),
        pre_mlp_layernorm, mlp.{gate,up,down}_proj
    model.mtp.layers.{j}.final_layernorm

Plain RMSNorms (``layernorm_epsilon``); the block is a sliding-window
attention layer with the ``swa_*`` settings (heads, head dims, RoPE base,
sink bias, the trunk's ``sliding_window_size``) and a dense MLP of
``intermediate_size``; embedding and ``lm_head`` are the trunk's; no position-0
zeroing; the trunk hands over its final-norm output (vLLM's MiMo-V2 model
returns it normed). vLLM and SGLang (``models/mimo_v2_mtp.py``) run only the
first layer; the model was trained with one layer per depth (arXiv
2601.02780, mean accepted length up to 3.6 with all three), so layer ``j``
drafts depth ``j + 1`` here, each with its own cache, chaining its
``final_layernorm`` output as vLLM returns it. The config declares no layer
count: the checkpoint's tensors give it.
"""

from typing import Any, Dict

import mlx.core as mx
import mlx.nn as nn

from .base import MTPHead, MultiLayerHead
from .common import rollback_caches as patch_trunk  # noqa: F401  (loader hook)
from .common import windowed
from .wiring import FusedHead, Wiring

MODEL_TYPES = {"mimo_v2_flash": "MiMo-V2-Flash"}
RELEASED_LAYERS = 3
PREFIX = "model.mtp.layers."


class MiMoV2MTP(FusedHead):
    OWN = ("enorm", "hnorm", "eh_proj", "final_layernorm")
    WIRING = Wiring(final_norm="final_layernorm")
    zero_first_embedding = False


def layers_present(names, config: Dict[str, Any]) -> int:
    js = [int(k[len(PREFIX) :].split(".")[0]) for k in names if k.startswith(PREFIX)]
    return 1 + max(js) if js else 0


def num_layers(config: Dict[str, Any]) -> int:
    return int(config.get("num_nextn_predict_layers", 0) or 0)


def prefix(config: Dict[str, Any], j: int = 0) -> str:
    return f"{PREFIX}{j}."


def is_mtp_key(key: str, config: Dict[str, Any]) -> bool:
    return key.startswith("model.mtp.")


def sanitize_block(weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
    # mlx-lm's decoder layer names the pre-MLP norm post_attention_layernorm
    return {
        k.replace("pre_mlp_layernorm.", "post_attention_layernorm.", 1): v
        for k, v in weights.items()
    }


def _layer(args: Any, layer_class: type) -> MiMoV2MTP:
    block = layer_class(args, is_moe=False, is_sliding_window=True)
    modules = MiMoV2MTP.WIRING.modules(args.hidden_size, args.layernorm_epsilon)
    return MiMoV2MTP(windowed(block, args.sliding_window_size), modules)


def build(
    args: Any, config: Dict[str, Any], backbone: nn.Module, weights: Dict[str, mx.array]
) -> MTPHead:
    n = max(1, layers_present(weights, config))
    layers = [_layer(args, type(backbone.layers[0])) for _ in range(n)]
    return layers[0] if n == 1 else MultiLayerHead(layers)
