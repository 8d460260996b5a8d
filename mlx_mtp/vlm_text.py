"""Text models that only mlx-vlm loads, behind ``Target``.

Some families ship as a multimodal checkpoint whose language model mlx-lm has
no class for (Qwen3.8-Flash-Next, ``qwen4_exp``: mlx-lm 0.32 has none; mlx-vlm
0.7.10 does). ``load_trunk`` builds the checkpoint's model with mlx-vlm's own
classes and steps (its ``ModelConfig``, ``Model``, the ``sanitize`` of the
model, its tower and its language model, ``load_model_weights``, which
quantizes as the config says), with the MTP tensors moved aside first (the
family's ``is_mtp_key``, as ``loader._model_classes`` does for mlx-lm), and
hands back its language model. A tower whose weights the folder holds loads
with it (``Model.vision_tower``); one it lacks is dropped, as mlx-vlm drops it.

``VLMTextTarget`` runs that language model: mlx-vlm's forward returns a
``LanguageModelOutput`` and reads positions it keeps on the module between
calls, so the target passes each chunk's positions (the cache offset on) and
takes the logits. For single tokens mlx-vlm switches to a batch-invariant
decode that calls its layers' parts directly, past the modules a target taps;
the target keeps the modules' own path, the one mlx-vlm runs for every longer
chunk.

A family joins by naming its model_type in ``FAMILIES``: the module of
``mlx_vlm.models`` that holds its classes.
"""

import glob
from pathlib import Path
from typing import Any, Dict, List, Optional

import mlx.core as mx
from mlx import nn

from .cache import cache_length, cache_offset
from .errors import MTPError, first_line
from .target import Target
from .weights import read_safetensors

MLX_VLM_VERSION = "0.7.10"
INSTALL = "pip install 'mlx-mtp[vision]'"
# model_type -> the module of mlx_vlm.models with its classes
FAMILIES = {"qwen4_exp": "qwen4_exp"}
FAMILIES["glm5_next"] = "glm5_next"  # GLM-5.3-Flash
FAMILIES["hy_v4"] = "hy_v4"  # Hunyuan-V4 (mlx-vlm's models/hy_v4)
FAMILIES["step3p7"] = "step3p7"  # Step-3.7 (mlx-vlm's models/step3p7)
FAMILIES["deepseek_v4"] = "deepseek_v4"  # one flat config, no tower classes


def serves(config: Dict[str, Any]) -> bool:
    """Whether ``config`` is a family whose language model mlx-vlm loads here."""
    return config.get("model_type") in FAMILIES


def _module(config: Dict[str, Any]):
    import importlib

    try:
        name = FAMILIES[config["model_type"]]
        return importlib.import_module(f"mlx_vlm.models.{name}")
    except ImportError:
        raise MTPError(
            f"{config['model_type']} is loaded with mlx-vlm {MLX_VLM_VERSION}: "
            f"{INSTALL}"
        ) from None


def require(config: Dict[str, Any]) -> None:
    """A one-line error where mlx-vlm, which ``config``'s family needs, is missing."""
    _module(config)


def _built(arch, config: Dict[str, Any], weights: Dict[str, mx.array]):
    """(mlx-vlm's model for ``config``, ``weights`` put through its sanitize
    steps); modules the weights do not cover (a tower) are dropped."""
    from mlx_vlm.utils import sanitize_weights, update_module_configs

    model_config = arch.ModelConfig.from_dict(config)
    model_config = update_module_configs(model_config, arch, config, ["text", "vision"])
    model = arch.Model(model_config)
    weights = sanitize_weights(model, weights)
    # (a text-only family, hy_v4, has neither class nor config: mlx-vlm's
    # load_model skips each step the same way)
    if hasattr(arch, "VisionModel") and hasattr(model_config, "vision_config"):
        weights = sanitize_weights(
            arch.VisionModel, weights, model_config.vision_config
        )
    if hasattr(arch, "LanguageModel") and hasattr(model_config, "text_config"):
        weights = sanitize_weights(
            arch.LanguageModel, weights, model_config.text_config
        )
    if not any(k.startswith("vision_tower.") for k in weights):
        model.vision_tower = None  # a text-only checkpoint: no tower to load
    for name in [n for n in model.children() if n != "language_model"]:
        if not any(k.startswith(f"{name}.") for k in weights):
            setattr(model, name, None)  # e.g. step3p7's tower and projector
    return model, weights


def load_trunk(
    path: Path, config: Dict[str, Any], family, split: Dict[str, mx.array]
):
    """mlx-vlm's language model for ``path`` (lazy), MTP tensors moved into
    ``split``; returns ``(language model, config)``. Failures are one line."""
    arch = _module(config)  # first: without mlx-vlm, one line saying so
    from mlx_vlm.utils import load_model_weights

    files = sorted(glob.glob(str(path / "model*.safetensors")))
    if not files:
        raise MTPError(f"{path}: no model*.safetensors weights")
    config = dict(config)
    config.setdefault("vision_config", {})
    try:
        weights = read_safetensors(files)
        if family is not None:
            for key in [k for k in weights if family.is_mtp_key(k, config)]:
                split[key] = weights.pop(key)
        model, weights = _built(arch, config, weights)
        model = load_model_weights(model, config, weights, path, lazy=True)
        if family is not None and hasattr(family, "prepare_trunk"):
            family.prepare_trunk(model.language_model)  # with a head or without
    except MTPError:
        raise
    except Exception as e:
        raise MTPError(f"{path}: cannot load the model ({first_line(e)})") from None
    return model.language_model, config


def trunk_from_weights(config: Dict[str, Any], weights: Dict[str, mx.array]):
    """mlx-vlm's language model holding ``weights`` (float trunk tensors, as a
    checkpoint names them): what ``convert`` quantizes and writes. The
    language model's own parameter names are the ones ``load_trunk`` reads
    back (its sanitize passes them through)."""
    arch = _module(config)
    config = dict(config)
    config.setdefault("vision_config", {})
    model, weights = _built(arch, config, dict(weights))
    lm = model.language_model
    prefix = "language_model."
    lm.load_weights(
        [(k[len(prefix) :], v) for k, v in weights.items() if k.startswith(prefix)],
        strict=True,
    )
    lm.eval()
    return lm


def as_saved(model: nn.Module, config: Dict[str, Any]) -> nn.Module:
    """What ``convert`` saves for ``model``: a language model of a family here
    under ``language_model.``, the names mlx-vlm's own conversions write and
    every such family's sanitize reads back; any other model as it is."""
    if not serves(config):
        return model
    holder = nn.Module()
    holder.language_model = model
    return holder


def saved_quantization(
    quant: Optional[Dict[str, Any]], trunk: Dict[str, Any], config: Dict[str, Any]
) -> Optional[Dict[str, Any]]:
    """``quant`` with, for a family here, every quantized trunk module listed
    under its saved path: mlx-vlm re-quantizes a module without an entry only
    where its weight's size divides by 64 (tiny or odd-shaped ones, a gate of
    one output, would not load back)."""
    if quant is None or not serves(config):
        return quant
    return {**quant, **{f"language_model.{p}": dict(q) for p, q in trunk.items()}}


class _ModulesPath:
    """Mixin over mlx-vlm's language model: single tokens run the modules'
    path (``_supports_batch_invariant_decode`` False) so taps see them."""

    def _supports_batch_invariant_decode(self) -> bool:
        return False


def _modules_path(lm: nn.Module) -> None:
    base = type(lm)
    if issubclass(base, _ModulesPath):
        return
    sub = type(base.__name__, (_ModulesPath, base), {})
    sub.__module__ = base.__module__
    lm.__class__ = sub


class VLMTextTarget(Target):
    """mlx-vlm's language model of a text prompt, as the runtime sees it."""

    def __init__(self, model: nn.Module, hidden_tap: str = "pre"):
        _modules_path(model)
        super().__init__(model, hidden_tap)
        inner = self.backbone
        self._offset_layer = getattr(inner, "fa_idx", 0)

    def make_cache(self) -> List[Any]:
        return self.model.make_cache()

    def _positions(self, tokens: mx.array, cache: Optional[List[Any]]) -> mx.array:
        B, T = tokens.shape
        offset = 0
        if cache:
            c = cache[self._offset_layer]
            # a cache of caches (hy_v4's ``CacheList``) counts by its first member
            offset = c.offset if hasattr(c, "offset") else cache_offset(c)
            if offset is None:  # a recurrent layer first (GLM-5.3): the first that counts
                # (a batch's, per stream: ``glm5_cache.BatchDSACache``)
                ragged = [
                    c.lengths for c in cache if isinstance(getattr(c, "lengths", None), list)
                ]
                offset = mx.array(ragged[0], mx.int32) if ragged else cache_length(cache)
        if isinstance(offset, mx.array):
            offset = offset.reshape(-1, 1)
        return (mx.arange(T, dtype=mx.int32)[None] + offset) * mx.ones(
            (B, 1), mx.int32
        )

    def _logits(self, tokens: mx.array, cache: List[Any], **kwargs) -> mx.array:
        kwargs.setdefault("position_ids", self._positions(tokens, cache))
        out = self.model(tokens, cache=cache, **kwargs)
        return getattr(out, "logits", out)
