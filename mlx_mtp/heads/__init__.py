"""MTP head families, one module each, resolved by ``model_type``.

A config resolves as mlx-lm picks the trunk's module: Ling-3 is
``model_type`` ``bailing_hybrid`` with the architecture
``BailingMoeV3ForCausalLM``, which mlx-lm loads as ``bailing_moe_v3``.

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
caches that roll back) and ``NO_HEAD_NOTICE`` (what the loader says of a model
of the family found without its head).
"""

import importlib
from types import ModuleType
from typing import Any, Dict, Optional, Union

from ..families import NOT_YET, RELEASED  # noqa: F401  (the families' names)
from .base import MTPHead, MultiLayerHead, load_head_weights

FAMILY_MODULES = (
    "deepseek",
    "mimo",
    "qwen3_next",
    "ernie",
    "exaone_moe",
    "longcat",
    "step3p5",
    "mimo_v2_flash",
    "nemotron_h",
    "kimi_linear",
    "kimi_k3",
    "bailing_hybrid",
    "bailing_moe_v3",
    "gemma4_assistant",
)


def not_yet(config: Dict[str, Any]) -> Optional[str]:
    """Why the MTP layers of ``config``'s family cannot be used yet, if they cannot."""
    from mlx_lm.utils import MODEL_REMAPPING

    model_type = module_type(config)
    return NOT_YET.get(MODEL_REMAPPING.get(model_type, model_type))


def module_type(config: Dict[str, Any]) -> str:
    """``config``'s model_type, or the mlx-lm module its architecture maps it to."""
    from mlx_lm.utils import MODEL_ARCHITECTURE_REMAPPING

    model_type = config.get("model_type", "")
    architectures = config.get("architectures") or ()
    if isinstance(architectures, str):
        architectures = (architectures,)
    for architecture in architectures:
        remapped = MODEL_ARCHITECTURE_REMAPPING.get((model_type, architecture))
        if remapped is not None:
            return remapped
    return model_type


def family_for(model_type: Union[str, Dict[str, Any]]) -> Optional[ModuleType]:
    """The head family serving ``model_type`` (or a config, see ``module_type``),
    or None when MTP is unsupported."""
    if isinstance(model_type, dict):
        model_type = module_type(model_type)
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
    "MultiLayerHead",
    "family_for",
    "layers_present",
    "module_type",
    "not_yet",
    "RELEASED",
    "load_head_weights",
    "supported_model_types",
]
