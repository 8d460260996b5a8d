"""LG EXAONE-MoE / K-EXAONE MTP head (``exaone_moe``).

Checkpoint layout (vLLM ``exaone_moe_mtp.py``, which maps ``mtp.`` onto its
predictor)::

    mtp.pre_fc_norm_embedding / mtp.pre_fc_norm_hidden / mtp.fc   fuse, embedding FIRST
    mtp.layers.{j}.input_layernorm, self_attn.*, post_attention_layernorm, mlp.*
    mtp.norm

Plain RMSNorms (``x * w``). Each ``mtp.layers.{j}`` is a decoder layer of the
trunk's class with a dense MLP (``intermediate_size``; vLLM builds it with
``is_mtp=True``, which never picks the MoE) whose attention type is
``mtp_layer_types[j]`` (full attention when the config has none; K-EXAONE's
is full attention and therefore without RoPE, as the trunk's full layers when
the trunk has sliding ones). Layer ``j`` drafts depth ``j + 1`` with ``fc``
and the norms shared (``layers[step % n]``). No position-0 zeroing; the trunk
hands over its final-norm output; embedding and output head are the trunk's.
"""

from dataclasses import replace
from typing import Any, Dict

import mlx.core as mx
import mlx.nn as nn

from .base import MTPHead, MultiLayerHead
from .common import Depth, windowed
from .common import rollback_caches as patch_trunk  # noqa: F401  (loader hook)
from .wiring import FusedHead, Wiring

MODEL_TYPES = {"exaone_moe": "EXAONE-MoE, K-EXAONE"}
PREFIX = "mtp."
# config keys of the MTP layers, brought along by --mtp-only
HEAD_CONFIG_KEYS = ("mtp_layer_types", "mtp_sliding_windows")


class ExaoneMoeMTP(FusedHead):
    OWN = ("fc", "norm", "pre_fc_norm_embedding", "pre_fc_norm_hidden")
    WIRING = Wiring("pre_fc_norm_embedding", "pre_fc_norm_hidden", "fc", "norm")
    zero_first_embedding = False  # vLLM's exaone_moe_mtp keeps position 0


def num_layers(config: Dict[str, Any]) -> int:
    return int(config.get("num_nextn_predict_layers", 0) or 0)


def prefix(config: Dict[str, Any], j: int = 0) -> str:
    return PREFIX  # fc and the norms are shared by all layers


def is_mtp_key(key: str, config: Dict[str, Any]) -> bool:
    return key.startswith(PREFIX)


def layers_present(names, config: Dict[str, Any]) -> int:
    js = [int(k.split(".")[2]) for k in names if k.startswith(f"{PREFIX}layers.")]
    return 1 + max(js) if js else 0


def sanitize_block(weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
    return weights  # dense layers, stored as mlx-lm names them


def _mtp_layer(args: Any, config: Dict[str, Any], layer_class: type, j: int):
    types = config.get("mtp_layer_types") or []
    kind = types[j] if j < len(types) else "full_attention"
    windows = config.get("mtp_sliding_windows") or []
    window = windows[j] if j < len(windows) and windows[j] else args.sliding_window
    n = args.num_hidden_layers
    # built as one more layer of the trunk: dense, of its own attention type
    ext = replace(
        args,
        layer_types=list(args.layer_types[:n]) + [kind],
        is_moe_layer=list(args.is_moe_layer[:n]) + [False],
    )
    # (mlx-lm then applies RoPE exactly where vLLM does: on a sliding layer,
    # or on any layer when the trunk has no sliding one)
    layer = layer_class(ext, n)
    return windowed(layer, window if kind == "sliding_attention" else None)


def build(
    args: Any, config: Dict[str, Any], backbone: nn.Module, weights: Dict[str, mx.array]
) -> MTPHead:
    n = max(1, layers_present(weights, config))
    layer_class = type(backbone.layers[0])
    layers = [_mtp_layer(args, config, layer_class, j) for j in range(n)]
    shared = ExaoneMoeMTP.WIRING.modules(args.hidden_size, args.rms_norm_eps)
    heads = [ExaoneMoeMTP(Depth(layers, j), shared) for j in range(n)]
    return heads[0] if n == 1 else MultiLayerHead(heads)
