"""MTP head families, one module each, resolved by ``model_type``.

A family module provides:

- ``MODEL_TYPES``: the ``model_type`` values it serves;
- ``num_layers(config)``: MTP layers the config declares;
- ``prefix(config, j)``: where layer ``j``'s tensors live in a checkpoint;
- ``is_mtp_key(key, config)``: whether a checkpoint tensor belongs to the head;
- ``build(args, config, backbone, weights)``: an unloaded ``MTPHead`` (a
  ``MultiLayerHead`` when its layers draft successive depths); the loader
  loads ``prefix(config, j)`` into ``head.layer(j)``.

Optional: ``TRUNK_LAYER_PREFIX`` (where the trunk's sanitize expects layer 0;
or a function of the trunk model naming a trunk layer of the block's kind),
``sanitize_block(weights)`` (replaces the trunk's sanitize for the block) and
``patch_trunk(model)`` (called once the head is loaded, e.g. to give the trunk
caches that roll back).
"""

import importlib
from types import ModuleType
from typing import Optional

from .base import MTPHead, MultiLayerHead, load_head_weights

FAMILY_MODULES = (
    "deepseek",
    "mimo",
    "qwen3_next",
    "nemotron_h",
    "kimi_linear",
    "bailing_hybrid",
)


def family_for(model_type: str) -> Optional[ModuleType]:
    """The head family serving ``model_type``, or None when MTP is unsupported."""
    for name in FAMILY_MODULES:
        module = importlib.import_module(f"{__name__}.{name}")
        if model_type in module.MODEL_TYPES:
            return module
    return None


def supported_model_types():
    return [
        t
        for name in FAMILY_MODULES
        for t in importlib.import_module(f"{__name__}.{name}").MODEL_TYPES
    ]


__all__ = [
    "MTPHead",
    "MultiLayerHead",
    "family_for",
    "load_head_weights",
    "supported_model_types",
]
