"""Nemotron-H / Nemotron 3 MTP head (Mamba2 + attention + MoE trunks).

Checkpoint layout (vLLM ``model_executor/models/nemotron_h_mtp.py``; llama.cpp
``conversion/nemotron.py`` writes the same tensors)::

    mtp.layers.0.enorm / hnorm / eh_proj      fuse, embedding FIRST (layer 0 only)
    mtp.layers.{i}.norm, mtp.layers.{i}.mixer.*   one sub-layer per pattern char
    mtp.layers.{last}.final_layernorm         closes the block

The sub-layers come from ``mtp_hybrid_override_pattern`` (``"*E"``: attention,
then MoE), or the list ``mtp_layers_block_type`` newer configs write
(transformers' ``NemotronHConfig`` defaults it to ``["attention", "moe"]``);
``num_nextn_predict_layers`` is 1 (vLLM asserts it). Each sub-layer is
mlx-lm's ``NemotronHBlock`` (``x + mixer(norm(x))``), as vLLM's residual
chain computes it. The attention has no rotary embedding, like the trunk's.
Embedding and output head are the trunk's (vLLM loads ``backbone.embeddings``
and ``lm_head`` into the draft), the position-0 embedding is not zeroed, and
the trunk's hidden state is read after ``norm_f`` (vLLM's target output).
"""

from typing import Any, Dict

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.nemotron_h import ModelArgs, NemotronHBlock

from ..errors import MTPError
from ..recurrent.mamba_cache import patch_trunk  # noqa: F401  (the loader's hook)
from .base import MTPHead
from .wiring import FusedHead, Wiring

MODEL_TYPES = {"nemotron_h": "Nemotron-H / Nemotron 3"}
PREFIX = "mtp."
DEFAULT_PATTERN = "*E"


class SubLayers(nn.Module):
    """``mtp.layers``: the pattern's sub-layers, run in order on one KV cache."""

    def __init__(self, layers):
        super().__init__()
        self.layers = layers

    def __call__(self, x: mx.array, mask: Any, cache: Any) -> mx.array:
        for layer in self.layers:
            x = layer(x, mask, cache if layer.block_type == "*" else None)
        return x


class NemotronHMTP(FusedHead):
    # the fuse in the first sub-layer, the closing norm in the last
    WIRING = Wiring(
        "block.layers.0.enorm",
        "block.layers.0.hnorm",
        "block.layers.0.eh_proj",
        "block.layers.-1.final_layernorm",
    )
    zero_first_embedding = False  # vLLM's nemotron_h_mtp keeps position 0

    def __init__(self, args: Any, pattern: str):
        block = SubLayers([NemotronHBlock(args, c) for c in pattern])
        modules = self.WIRING.modules(args.hidden_size, args.layer_norm_epsilon)
        super().__init__(block, modules)


def pattern(config: Dict[str, Any]) -> str:
    """The MTP sub-layer pattern, one character per sub-layer."""
    if config.get("mtp_hybrid_override_pattern"):
        return str(config["mtp_hybrid_override_pattern"])
    names = config.get("mtp_layers_block_type") or ["attention", "moe"]
    chars = ModelArgs._block_type_to_char
    if any(n not in chars for n in names):
        raise MTPError(f"unknown MTP sub-layer types {names}")
    return "".join(chars[n] for n in names)


def num_layers(config: Dict[str, Any]) -> int:
    return int(config.get("num_nextn_predict_layers", 0) or 0)


def prefix(config: Dict[str, Any], j: int = 0) -> str:
    return PREFIX


def is_mtp_key(key: str, config: Dict[str, Any]) -> bool:
    return key.startswith(PREFIX)


def build(
    args: Any, config: Dict[str, Any], backbone: nn.Module, weights: Dict[str, mx.array]
) -> MTPHead:
    chars = pattern(config)
    if num_layers(config) > 1:
        raise MTPError("Nemotron-H MTP with more than one layer is not supported")
    if set(chars) - set("*E-") or chars.count("*") > 1:
        # vLLM builds only attention and MoE sub-layers; one attention, one cache
        raise MTPError(f"unsupported MTP sub-layer pattern {chars!r}")
    return NemotronHMTP(args, chars)


def sanitize_block(weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
    """Per-expert ``up_proj`` / ``down_proj`` -> stacked ``switch_mlp.fc1/fc2``."""
    out, experts = {}, {}
    for key, value in weights.items():
        pre, sep, rest = key.partition(".mixer.experts.")
        if not sep:
            out[key] = value
            continue
        e, proj, leaf = rest.split(".", 2)  # "{e}.up_proj.weight"
        fc = {"up_proj": "fc1", "down_proj": "fc2"}[proj]
        experts.setdefault(f"{pre}.mixer.switch_mlp.{fc}.{leaf}", {})[int(e)] = value
    for key, per_expert in experts.items():
        out[key] = mx.stack([per_expert[e] for e in sorted(per_expert)])
    return out
