"""Qwen3-Next and Qwen3.5/3.6 MTP head (hybrid gated-delta-net trunks).

Checkpoint layout (vLLM ``qwen3_next_mtp.py``, ``qwen3_5_mtp.py``)::

    mtp.pre_fc_norm_embedding / mtp.pre_fc_norm_hidden / mtp.fc   fuse, embedding FIRST
    mtp.layers.{j}.input_layernorm, self_attn.*, post_attention_layernorm, mlp.*
    mtp.norm

Each ``mtp.layers.{j}`` is a full-attention decoder layer of the trunk's class,
MoE where the checkpoint has experts (stored per expert or fused as
``experts.gate_up_proj``). Embedding and output head are the trunk's.

Qwen's RMSNorms are zero-centred, ``x * (1 + w)``, and the head's tensors are
read as Hugging Face stores them (``wiring.ZeroCentredRMSNorm``).

With several MTP layers, layer ``j`` drafts depth ``j + 1`` and ``fc``, its
norms and ``mtp.norm`` are shared by all of them: vLLM's ``qwen3_next_mtp.py``
and ``qwen3_5_mtp.py`` run ``layers[spec_step_idx % n]`` between the one
``fc`` and the one ``norm``. Released checkpoints have one layer.
"""

import importlib
from typing import Any, Dict

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.qwen3_next import Qwen3NextMLP, Qwen3NextSparseMoeBlock

from ..recurrent.gdn_cache import patch_trunk  # noqa: F401  (the loader's hook)
from .base import MTPHead, MultiLayerHead
from .common import Depth
from .wiring import FusedHead, Wiring, ZeroCentredRMSNorm

MODEL_TYPES = {
    "qwen3_next": "Qwen3-Next",
    "qwen3_5": "Qwen3.5/3.6",
    "qwen3_5_moe": "Qwen3.5/3.6 MoE",
}
PREFIX = "mtp."
_LAYERS = "mtp.layers."
_LAYER_NORMS = ("input_layernorm", "post_attention_layernorm")
_ATTN_NORMS = ("q_norm", "k_norm")


class Qwen3NextMTP(FusedHead):
    OWN = ("fc", "norm", "pre_fc_norm_embedding", "pre_fc_norm_hidden")
    WIRING = Wiring(
        "pre_fc_norm_embedding",
        "pre_fc_norm_hidden",
        "fc",
        "norm",
        norm=ZeroCentredRMSNorm,
    )
    zero_first_embedding = False  # vLLM's qwen3_next_mtp keeps position 0


def _text_config(config: Dict[str, Any]) -> Dict[str, Any]:
    return config.get("text_config", config)


def num_layers(config: Dict[str, Any]) -> int:
    for cfg in (config, _text_config(config)):
        for key in ("mtp_num_hidden_layers", "num_nextn_predict_layers"):
            if cfg.get(key):
                return int(cfg[key])
    return 0


def prefix(config: Dict[str, Any], j: int = 0) -> str:
    # fc and the norms are shared by all layers, so the whole head is one prefix
    return PREFIX


def is_mtp_key(key: str, config: Dict[str, Any]) -> bool:
    return key.startswith(PREFIX)


def layers_present(names, config: Dict[str, Any]) -> int:
    js = [int(k.split(".")[2]) for k in names if k.startswith(_LAYERS)]
    return 1 + max(js) if js else 0


def _text_args(args: Any, layer_class: type) -> Any:
    """The trunk's text-model arguments (Qwen3.5 nests them in ``text_config``)."""
    if not hasattr(args, "text_config"):
        return args
    module = importlib.import_module(layer_class.__module__)
    return module.TextModelArgs.from_dict(args.text_config)


def _mtp_layer(args: Any, layer_class: type, moe: bool) -> nn.Module:
    """A full-attention decoder layer of the trunk's class, dense or MoE."""
    layer = layer_class(args, args.full_attention_interval - 1)
    layer.mlp = (
        Qwen3NextSparseMoeBlock(args)
        if moe
        else Qwen3NextMLP(args.hidden_size, args.intermediate_size)
    )
    eps = args.rms_norm_eps
    for name in _LAYER_NORMS:
        setattr(layer, name, ZeroCentredRMSNorm(args.hidden_size, eps))
    for name in _ATTN_NORMS:
        setattr(layer.self_attn, name, ZeroCentredRMSNorm(args.head_dim, eps))
    return layer


def build(
    args: Any, config: Dict[str, Any], backbone: nn.Module, weights: Dict[str, mx.array]
) -> MTPHead:
    layer_class = type(backbone.layers[0])
    args = _text_args(args, layer_class)
    # Count layers in the tensors: Qwen3-Next configs may not declare them.
    n = max(1, layers_present(weights, config))
    layers = [
        _mtp_layer(args, layer_class, f"{_LAYERS}{j}.mlp.gate.weight" in weights)
        for j in range(n)
    ]
    shared = Qwen3NextMTP.WIRING.modules(args.hidden_size, args.rms_norm_eps)
    heads = [Qwen3NextMTP(Depth(layers, j), shared) for j in range(n)]
    return heads[0] if n == 1 else MultiLayerHead(heads)


def sanitize_block(weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
    """Checkpoint experts (per expert, or fused ``gate_up_proj``) -> ``switch_mlp``."""
    out, per_expert = {}, {}
    for key, value in weights.items():
        pre, sep, rest = key.partition(".mlp.experts.")
        if not sep:
            out[key] = value
        elif rest == "gate_up_proj":
            gate, up = mx.split(value, 2, axis=-2)
            out[f"{pre}.mlp.switch_mlp.gate_proj.weight"] = gate
            out[f"{pre}.mlp.switch_mlp.up_proj.weight"] = up
        elif rest == "down_proj":
            out[f"{pre}.mlp.switch_mlp.down_proj.weight"] = value
        else:  # "{e}.{gate_proj|up_proj|down_proj}.weight"
            e, name = rest.split(".", 1)
            per_expert.setdefault(f"{pre}.mlp.switch_mlp.{name}", {})[int(e)] = value
    for key, experts in per_expert.items():
        out[key] = mx.stack([experts[e] for e in sorted(experts)])
    return out
