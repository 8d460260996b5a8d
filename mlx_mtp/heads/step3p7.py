"""StepFun Step-3.7 (``step3p7``): Step-3.5's MTP wiring on mlx-vlm's Step-3.7 trunk.

No public runtime runs Step-3.7's MTP layers: mlx-vlm 0.7.10 has no
``step3p7`` drafter, and its ``models/step3p7`` sanitize drops them. The
layout is inferred from mlx-vlm 0.7.10's ``models/step3p7/`` (docs/design.md
section 3f):

- ``config.py``: the language model's config is Step-3.5's (``TextConfig``'s
  ``model_type`` defaults to ``"step3p5"``, 45 layers, MoE layers 3..44, the
  same per-layer fields), and its ``__post_init__`` cuts ``layer_types``,
  ``swiglu_limits`` and ``swiglu_limits_shared`` to ``num_hidden_layers``: the
  released lists are longer, reaching past the trunk into its MTP layers as
  Step-3.5-Flash's do;
- ``step3p7.py`` (``Model.sanitize``) and ``language.py``
  (``LanguageModel.sanitize``) drop ``model.layers.{i}`` (and
  ``model.language_model.layers.{i}``) for ``i >= num_hidden_layers``, the
  place Step-3.5 keeps its MTP layers (``model.layers.{N+j}``); the HF norms
  are zero-centred there too (its sanitize adds 1 to a checkpoint in Hugging
  Face names).

So the head is Step-3.5's (``heads/step3p5.py``: ``eh_proj(concat[enorm(e),
hnorm(h)])``, the embedding first, zero-centred norms, the trunk's hidden
state before its final norm, each layer's own ``shared_head``, layer ``j``
drafting depth ``j + 1``, chained on the block's output before its norm),
with the block being mlx-vlm's Step-3.7 ``DecoderLayer`` at index ``N + j``.
Marked unverified: a wrong guess loses acceptance, never correctness (the
trunk verifies every draft).

The trunk's sliding layers get mlx-mtp's usual treatment: plain caches
whose masks apply the window (mlx-lm's ``KVCache``, which mlx-vlm's
attention and masks take), so every layer rolls back by ``trim`` and the
caches batch and quantize as an mlx-lm model's do.
"""

from dataclasses import replace
from typing import Any, Dict, List

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache

from . import step3p5
from .base import MTPHead, MultiLayerHead
from .common import split_layer, summed
from .step3p5 import HEAD_CONFIG_KEYS, sanitize_block  # noqa: F401  (loader hook)

MODEL_TYPES = {
    "step3p7": "Step-3.7, unverified: Step-3.5's MTP wiring inferred from mlx-vlm "
    "0.7.10 models/step3p7 (no public runtime runs its MTP layers)"
}
RELEASED_LAYERS = 3
DEFAULT_HIDDEN_TAP = "pre"
_LAYERS = ("model.layers.", "model.language_model.layers.")


def _text(config: Dict[str, Any]) -> Dict[str, Any]:
    return config.get("text_config") or config


def _trunk_layers(config: Dict[str, Any]) -> int:
    return int(_text(config)["num_hidden_layers"])


def num_layers(config: Dict[str, Any]) -> int:
    text = _text(config)
    found = text.get("num_nextn_predict_layers", config.get("num_nextn_predict_layers"))
    return int(found or 0)


def prefix(config: Dict[str, Any], j: int = 0) -> str:
    return f"model.layers.{_trunk_layers(config) + j}."


def is_mtp_key(key: str, config: Dict[str, Any]) -> bool:
    for start in _LAYERS:
        if key.startswith(start):
            index = key[len(start) :].split(".", 1)[0]
            return index.isdigit() and int(index) >= _trunk_layers(config)
    return False


def patch_trunk(model: nn.Module) -> None:
    """Plain caches for every layer of mlx-vlm's Step-3.7 language model (its
    sliding layers' ``RotatingKVCache`` cannot drop tokens once it wraps)."""
    base = type(model)
    if getattr(base, "_mtp_step3p7_rollable", False):
        return

    def make_cache(self) -> List[Any]:
        return [KVCache() for _ in self.layers]

    attrs = {"make_cache": make_cache, "_mtp_step3p7_rollable": True}
    model.__class__ = type(base.__name__, (base,), attrs)


def split_counts(config: Dict[str, Any]) -> List[int]:
    """What ``shard_trunk`` divides by the number of processes: the query and
    KV heads of the full and the sliding layers."""
    text = _text(config)
    other = text.get("attention_other_setting") or {}
    keys = ("num_attention_heads", "num_attention_groups")
    return [text[k] for k in keys] + [other[k] for k in keys if k in other]


def shard_trunk(model: nn.Module, group: Any) -> None:
    """Tensor-split mlx-vlm's Step-3.7 language model (lazy) over ``group``:
    mlx-lm's Step-3.5 split (``shard``) on mlx-vlm's layers, which have no
    ``shard`` of their own. Each process keeps ``1 / N`` of the query and KV
    heads (and of the per-head gate ``g_proj``), ``o_proj``'s inputs for
    them, and ``1 / N`` of the width of the dense MLP, every expert and the
    shared expert; the attention and the MLP or MoE each end with one
    ``all_sum``. The router stays whole. ``model.model.layers`` holds the
    head's blocks of the trunk's class too while this runs."""
    n = group.size()
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        gate = "g_proj" if attn.use_head_wise_attn_gate else None
        mlps = (mlp.switch_mlp, mlp.share_expert) if layer.is_moe_layer else (mlp,)
        split_layer(attn, mlps, group, gate)
        attn.n_heads //= n
        attn.n_kv_heads //= n
        summed(attn, group)
        summed(mlp, group)


def _head_args(args: Any, config: Dict[str, Any], n: int) -> Any:
    """The trunk's config with the per-layer lists reaching layer ``n``: the
    released lists (the config's, uncut), else the trunk's last entry."""
    text = _text(config)
    fields = {k: text[k] for k in HEAD_CONFIG_KEYS if k in text}
    for name in ("layer_types", "rope_theta", "partial_rotary_factors"):
        value = fields.get(name, getattr(args, name))
        if isinstance(value, list) and value and len(value) <= n:
            fields[name] = value + [value[-1]] * (n + 1 - len(value))
    # TextConfig cuts its lists to num_hidden_layers: the head's reaches n
    return replace(args, num_hidden_layers=n + 1, **fields)


def build(
    args: Any, config: Dict[str, Any], backbone: nn.Module, weights: Dict[str, mx.array]
) -> MTPHead:
    n_trunk = _trunk_layers(config)
    # the same layers under the VLM's name are the ones Step-3.5 stores here
    for key in [k for k in weights if k.startswith(_LAYERS[1])]:
        if is_mtp_key(key, config):
            weights[_LAYERS[0] + key[len(_LAYERS[1]) :]] = weights.pop(key)
    n = max(1, num_layers(config))
    head_args = _head_args(args, config, n_trunk + n - 1)
    layers = [
        step3p5.layer_for(
            head_args, config, backbone, weights, j, prefix(config, j), n_trunk + j
        )
        for j in range(n)
    ]
    return layers[0] if n == 1 else MultiLayerHead(layers)
