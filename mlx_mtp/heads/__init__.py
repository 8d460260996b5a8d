"""MTP head families, one module each, resolved by ``model_type``.

A family module provides:

- ``MODEL_TYPES``: the ``model_type`` values it serves;
- ``num_layers(config)``: MTP layers the config declares;
- ``prefix(config, j)``: where layer ``j``'s tensors live in a checkpoint;
- ``is_mtp_key(key, config)``: whether a checkpoint tensor belongs to the head;
- ``build(args, config, backbone, weights)``: an unloaded ``MTPHead``.

Optional: ``TRUNK_LAYER_PREFIX`` (where the trunk's sanitize expects layer 0),
``sanitize_block(weights)`` (replaces the trunk's sanitize for the block) and
``patch_trunk(model)`` (called once the head is loaded, e.g. to give the trunk
caches that roll back).
"""

import importlib
from types import ModuleType
from typing import Optional

from .base import MTPHead, load_head_weights

FAMILY_MODULES = (
    "deepseek",
    "mimo",
    "qwen3_next",
    "ernie",
    "exaone_moe",
    "longcat",
    "step3p5",
    "mimo_v2_flash",
)


def family_for(model_type: str) -> Optional[ModuleType]:
    """The head family serving ``model_type``, or None when MTP is unsupported."""
    for name in FAMILY_MODULES:
        module = importlib.import_module(f"{__name__}.{name}")
        if model_type in module.MODEL_TYPES:
            return module
    return None


def layers_present(family: ModuleType, config, names) -> int:
    """How many MTP layers the tensor ``names`` of a checkpoint hold."""
    if hasattr(family, "layers_present"):  # layers sharing one prefix
        return family.layers_present(names, config)
    n, prefixes = 0, set()
    while family.prefix(config, n) not in prefixes and any(
        k.startswith(family.prefix(config, n)) for k in names
    ):
        prefixes.add(family.prefix(config, n))
        n += 1
    return n


def supported_model_types():
    return [
        t
        for name in FAMILY_MODULES
        for t in importlib.import_module(f"{__name__}.{name}").MODEL_TYPES
    ]


__all__ = [
    "MTPHead",
    "family_for",
    "layers_present",
    "load_head_weights",
    "supported_model_types",
]
