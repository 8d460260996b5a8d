"""Muse Glimmer's assistant (Meta, ``meta-models/Muse-Glimmer-30B-assistant``):
a DFlash block drafter (``dflash.py``) for Muse Glimmer (``muse_glimmer``,
which mlx-lm loads), in its own checkpoint's layout.

What differs from z-lab's DFlash, and nothing else does (layers, norms, the
block ``[y, MASK x k]``, the target's embedding and output head, the
context's keys and values kept and the block's rolled back):

- the tapped layers' outputs go through ``encoder.fc`` and
  ``encoder.output_norm_enc`` (DFlash's ``fc`` and ``hidden_norm``);
- every layer is a sliding-window layer whose mask is both ways and reaches
  ``sliding_window`` positions each side, ``|q - k| <= sliding_window``
  (DFlash's sliding rule is ``|q - k| < sliding_window``, causal by default),
  so the window given DFlash's masks is one more;
- the block embeds with the target's raw table (Muse's own forward norms its
  embeddings; the assistant does not), and its logits are the target's
  ``lm_head`` alone, without Muse's output multiplier and softcap;
- defaults where the published config leaves a key out (it has no
  ``vocab_size`` nor ``num_target_layers``: the target's are taken).

Pinned from mlx-vlm 0.7.10
``mlx_vlm/speculative/drafters/muse_glimmer_assistant/{config,dflash}.py``
(``MuseGlimmerAssistantConfig``, ``MuseGlimmerAssistantDraftModel``); mlx-vlm
keeps only the last ``sliding_window`` context positions in a rotating cache,
this keeps them all and masks (docs/design.md section 4c).
"""

from dataclasses import replace
from typing import Any, Dict

import mlx.core as mx
import mlx.nn as nn

from . import dflash
from .dflash import DFlashArgs, DFlashDrafter, DFlashModel
from .dflash import read_weights, with_weights  # noqa: F401  (convert reads them)

KINDS = {
    "MuseGlimmerAssistantModel": "Muse Glimmer's DFlash assistant (Meta)",
    "DFlashMuseGlimmerAssistantModel": "Muse Glimmer's DFlash assistant (Meta)",
    "muse_glimmer_assistant": "Muse Glimmer's DFlash assistant (Meta)",
}

# the model types of the target it was made for (the checkpoint's, mlx-vlm's text config's)
TARGETS = ("muse_glimmer", "muse_glimmer_text")
# the published config's values where it leaves a key out (mlx-vlm's defaults)
DEFAULTS = dict(
    rms_norm_eps=1e-5,
    sliding_window=2048,
    max_position_embeddings=131072,
    head_dim=128,
)
ROPE_THETA = 500000.0


def assistant_args(config: Dict[str, Any], vocab: int = 0) -> DFlashArgs:
    """The assistant's config as DFlash's layers read it (``vocab``: the
    target's, where the config names none)."""
    c = {**DEFAULTS, **config}
    n = c["num_hidden_layers"]
    types = c.get("layer_types") or ["sliding_attention"] * n
    if list(types) != ["sliding_attention"] * n:
        raise ValueError(
            f"layer_types {list(types)}: the assistant's layers are all sliding_attention"
        )
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    c.setdefault("rope_theta", rope.get("rope_theta", ROPE_THETA))
    c.setdefault("vocab_size", vocab)
    window = int(c["sliding_window"])
    c.update(layer_types=list(types), sliding_window=window + 1, is_causal=False)
    args = DFlashArgs.from_config(c)
    # its logits are the target's lm_head's alone (mlx-vlm's ``_logits``)
    return replace(
        args, input_embedding_scale=1.0, output_multiplier=1.0,
        final_logit_softcapping=None,
    )  # fmt: skip


class Encoder(nn.Module):
    def __init__(self, args: DFlashArgs):
        super().__init__()
        dim = args.hidden_size
        self.fc = nn.Linear(len(args.target_layer_ids) * dim, dim, bias=False)
        self.output_norm_enc = nn.RMSNorm(dim, eps=args.rms_norm_eps)

    def __call__(self, features: mx.array) -> mx.array:
        return self.output_norm_enc(self.fc(features))


class MuseAssistantModel(DFlashModel):
    """DFlash's model with the assistant's ``encoder`` for ``fc`` and
    ``hidden_norm``."""

    def add_projection(self, args: DFlashArgs) -> None:
        self.encoder = Encoder(args)

    def project(self, features: mx.array) -> mx.array:
        return self.encoder(features)


class MuseAssistantDrafter(DFlashDrafter):
    name = "muse_glimmer"


def check_target(target) -> None:
    """A ``ValueError`` where ``target`` is no Muse Glimmer model."""
    model_type = target.model_type or "?"
    if model_type not in TARGETS:
        raise ValueError(
            f"made for Muse Glimmer (muse_glimmer), the model is {model_type}"
        )


def load(folder, config: Dict[str, Any], target) -> MuseAssistantDrafter:
    check_target(target)
    args = assistant_args(config, vocab=dflash.target_shape(target)[1])
    dflash.check_fits(args, target)
    model = MuseAssistantModel(args)
    with_weights(model, read_weights(folder), config)
    model.eval()
    mx.eval(model.parameters())
    return MuseAssistantDrafter(model, *dflash.attach_parts(model, target))


def make_model(config: Dict[str, Any]) -> nn.Module:
    return MuseAssistantModel(assistant_args(config))


def summary(config: Dict[str, Any]) -> Dict[str, Any]:
    args = assistant_args(config)
    return {
        "block_size": args.block_size,
        "target_layer_ids": list(args.target_layer_ids),
        "num_target_layers": args.num_target_layers,
        "mask_token_id": args.mask_token_id,
        "hidden_size": args.hidden_size,
        "sliding_window": args.sliding_window - 1,
        "sliding_window_layers": args.num_hidden_layers,
    }
