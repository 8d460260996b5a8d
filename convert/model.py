"""Build the trunk and MTP heads from a ``Source`` and turn them back into tensors.

The trunk is mlx-lm's own class for ``model_type``; the heads are mlx-mtp's
family classes, loaded exactly as ``mlx_mtp.load`` loads them. Building the
real modules lets quantization act on final module shapes (stacked experts,
split MLA projections) and checks every tensor's shape on the way.
"""

import sys
from typing import Any, Dict, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlx_mtp import vlm_text
from mlx_mtp.errors import MTPError, first_line
from mlx_mtp.heads import family_for, load_head_weights, norms
from mlx_mtp.loader import sanitize_block
from mlx_mtp.target import embedding, find_backbone, output_head

from .precision import is_quantized


def model_classes(config: Dict[str, Any]):
    from mlx_lm.utils import _get_classes

    try:
        return _get_classes(config)
    except ValueError:
        raise MTPError(
            f"unsupported architecture {config.get('model_type')!r} (mlx-lm has no such model)"
        ) from None


def split_mtp(config: Dict[str, Any], weights: Dict[str, mx.array]):
    """(trunk tensors, MTP tensors) by the family's own ``is_mtp_key``."""
    family = family_for(config)
    if family is None:
        return weights, {}
    mtp = {k: v for k, v in weights.items() if family.is_mtp_key(k, config)}
    return {k: v for k, v in weights.items() if k not in mtp}, mtp


def _pre_quantized(weights: Dict[str, mx.array]):
    from mlx_lm.utils import infer_quant_config

    def predicate(path, module):
        if not hasattr(module, "to_quantized") or f"{path}.scales" not in weights:
            return False
        return infer_quant_config(path, module, weights)

    return predicate


def build_trunk(config: Dict[str, Any], weights: Dict[str, mx.array]) -> nn.Module:
    """mlx-lm's model for ``config`` holding ``weights`` (trunk tensors only)."""
    if vlm_text.serves(config):  # a language model only mlx-vlm has classes for
        try:
            return vlm_text.trunk_from_weights(config, weights)
        except MTPError:
            raise
        except Exception as e:
            raise MTPError(
                f"the weights do not fit {config['model_type']} ({first_line(e)})"
            ) from None
    model_class, args_class = model_classes(config)
    try:
        model = model_class(args_class.from_dict(config))
        if hasattr(model, "sanitize"):
            weights = model.sanitize(dict(weights))
        nn.quantize(model, class_predicate=_pre_quantized(weights))
        model.load_weights(list(weights.items()), strict=True)
    except (ValueError, KeyError, TypeError) as e:
        raise MTPError(
            f"the weights do not fit {config['model_type']} ({first_line(e)})"
        ) from None
    model.eval()
    return model


def build_heads(
    model: nn.Module, config: Dict[str, Any], mtp: Dict[str, mx.array]
) -> Tuple[List[Tuple[str, nn.Module]], Dict[str, mx.array]]:
    """(prefix, loaded layer) per MTP layer, and MTP tensors no layer took.

    Layers that share tensors (Qwen3-Next's ``mtp.fc``) share one prefix and
    modules; their tensors come out once.
    """
    family = family_for(config)
    if family is None or not mtp:
        return [], dict(mtp)
    args = getattr(model, "args", None)
    backbone = find_backbone(model)
    # a family whose block tensors the trunk's sanitize cannot take brings its own
    sanitize = getattr(family, "sanitize_block", None) or (
        lambda w: sanitize_block(model, family, w)
    )
    if not any(k.startswith(family.prefix(config, 0)) for k in mtp):
        return [], dict(mtp)
    head = family.build(args, config, backbone, mtp)
    layers = []
    for j in range(head.num_layers):
        prefix = family.prefix(config, j)
        try:
            load_head_weights(head.layer(j), prefix, mtp, sanitize, None)
        except ValueError as e:
            raise MTPError(
                f"MTP layer {prefix} does not fit the model ({first_line(e)})"
            ) from None
        layers.append((prefix, head.layer(j)))
    head.bind(embedding(backbone), output_head(model))
    # a head norm in the other convention than its family's is shifted back
    for note in norms.fix(head, [p for p, _ in layers], model):
        print(f"warning: {note}", file=sys.stderr)
    taken = {k for k in mtp for prefix, _ in layers if k.startswith(prefix)}
    return layers, {k: v for k, v in mtp.items() if k not in taken}


def _checkpoint_path(prefix: str, path: str) -> str:
    # inverse of MTPHead.module_path: the block's tensors sit right under the prefix
    return prefix + (path[len("block.") :] if path.startswith("block.") else path)


def head_tensors(prefix: str, head: nn.Module) -> Dict[str, mx.array]:
    return {_checkpoint_path(prefix, k): v for k, v in tree_flatten(head.parameters())}


def head_quantization(prefix: str, head: nn.Module) -> Dict[str, Dict[str, Any]]:
    return {
        _checkpoint_path(prefix, path): {
            "group_size": m.group_size,
            "bits": m.bits,
            "mode": getattr(m, "mode", "affine"),
        }
        for path, m in head.named_modules()
        if is_quantized(m)
    }


def trunk_group_size(model: nn.Module) -> Optional[int]:
    """The most common group size among the trunk's quantized modules, or None."""
    sizes = [m.group_size for _, m in model.named_modules() if is_quantized(m)]
    return max(set(sizes), key=sizes.count) if sizes else None


def normalize_config(config: Dict[str, Any]) -> Dict[str, Any]:
    """A config mlx-lm reads correctly.

    transformers 5 writes rope settings as ``rope_parameters``; mlx-lm 0.32's
    llama reads only a top-level ``rope_theta`` and silently uses 10000
    otherwise (docs/design.md section 8).
    """
    config = dict(config)
    rope = config.get("rope_parameters")
    if isinstance(rope, dict):
        if "rope_theta" in rope:
            config.setdefault("rope_theta", rope["rope_theta"])
        if rope.get("rope_type", "default") != "default" and not config.get(
            "rope_scaling"
        ):
            config["rope_scaling"] = {
                k: v for k, v in rope.items() if k != "rope_theta"
            }
    if "torch_dtype" not in config and "dtype" in config:
        config["torch_dtype"] = config["dtype"]
    for key in ("quantization", "quantization_config"):
        config.pop(key, None)
    return config
