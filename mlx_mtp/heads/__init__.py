"""MTP head families, one module each, resolved by ``model_type``.

A config resolves as mlx-lm picks the trunk's module: Ling-3 is
``model_type`` ``bailing_hybrid`` with the architecture
``BailingMoeV3ForCausalLM``, which mlx-lm loads as ``bailing_moe_v3``.

A family is one module here (``mlx_mtp.families`` finds it: no list to
keep). It provides:

- ``MODEL_TYPES``: a dict literal, each ``model_type`` it serves -> the
  released models of that type (what ``mlx-mtp info`` lists), and
  ``RELEASED_LAYERS`` where those checkpoints have more than one MTP layer;
- ``num_layers(config)``: MTP layers the config declares;
- ``prefix(config, j)``: where layer ``j``'s tensors live in a checkpoint;
- ``is_mtp_key(key, config)``: whether a checkpoint tensor belongs to the head;
- ``build(args, config, backbone, weights)``: an unloaded ``MTPHead`` (a
  ``MultiLayerHead`` when its layers draft successive depths); the loader
  loads ``prefix(config, j)`` into ``head.layer(j)``. A head wired as
  DeepSeek's (enorm, hnorm, eh_proj, a closing norm) is a ``wiring.FusedHead``
  with its ``Wiring``.

Optional: ``TRUNK_LAYER_PREFIX`` (where the trunk's sanitize expects layer 0;
or a function of the trunk model naming a trunk layer of the block's kind),
``sanitize_block(weights)`` (replaces the trunk's sanitize for the block) and
``patch_trunk(model)`` (called once the head is loaded, e.g. to give the trunk
caches that roll back) and ``NO_HEAD_NOTICE`` (what the loader says of a model
of the family found without its head).
``prepare_trunk(model)``: called on every trunk ``vlm_text`` loads for the
family, with a head or without (Hunyuan-V4's exact indexer top-k).
``unusable_head(weights)``: why tensors under the head's names are no head of
the family (DeepSeek-V4.1's DSpark stages), so the loader generates without
MTP. ``layer_view(x)``: a tapped layer's output as a drafter reads it (GLM-5.3's
streams, averaged).
Over several processes, for a trunk ``vlm_text`` loads (``mlx_mtp.distributed``):
``shard_trunk(model, group)`` (the family's tensor split of mlx-vlm's lazily
loaded language model) with ``split_counts(config)`` (the counts it divides
by the number of processes), or ``NO_SPLIT`` (why it is refused, one line).
"""

import importlib
from types import ModuleType
from typing import Any, Dict, List, Optional, Union

from .. import families
from ..families import NOT_YET
from .base import MTPHead, MultiLayerHead, load_head_weights


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
    return family_named(families.module_for(model_type))


def family_named(name: Any) -> Optional[ModuleType]:
    """The family module ``name`` (as a trained head's config names it), or None."""
    if not isinstance(name, str) or name not in {d.module for d in families.declared()}:
        return None
    return importlib.import_module(f"{__name__}.{name}")


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


def supported_model_types() -> List[str]:
    return families.model_types()


__all__ = [
    "MTPHead",
    "MultiLayerHead",
    "family_for",
    "family_named",
    "layers_present",
    "module_type",
    "not_yet",
    "load_head_weights",
    "supported_model_types",
]
