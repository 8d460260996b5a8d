"""A tiny random Step-3.7 (``step3p7``) checkpoint with MTP layers in Step-3.5's layout.

The language model as mlx-vlm 0.7.10's ``step3p7`` sanitize reads a Hugging
Face folder (``model.embed_tokens``, ``model.layers.{i}``, ``model.norm``,
``lm_head``; experts packed under ``moe.``, ``share_expert.``, norms stored
zero-centred), the config nested (``text_config``, ``vision_config``), and
three MTP layers at ``model.layers.{N+j}`` (``enorm``, ``hnorm``,
``eh_proj``, ``shared_head.{norm, output}`` and a decoder block of the
trunk's kind at index ``N + j``), as Step-3.5-Flash stores them: the layout
mlx-vlm's sanitize drops and docs/design.md section 3f infers. The per-layer
lists of the text config reach past the trunk into the MTP layers. No vision
tower weights: it is dropped at load. Float32 (MLX's CPU MoE kernel).
``agreeable=True`` shrinks block outputs and makes ``eh_proj`` read the
embedding nearly as it is, so drafts are often, not always, accepted.
"""

from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from tiny import save_folder
from tiny_own_layout import _STEP, _block, _fuse, _shrink_outputs, _step_names

TEXT = {k: v for k, v in _STEP.items() if k not in ("torch_dtype",)}
TEXT["model_type"] = "step3p5"
TEXT["swiglu_limits"] = [0, 0, 7.0, 0, 7.0, 0]  # clamped SwiGLU on some layers
VISION = dict(width=16, layers=1, heads=2, image_size=28, patch_size=14)


def config_for(**overrides) -> dict:
    text = {**TEXT, **overrides}
    return {
        "model_type": "step3p7",
        "architectures": ["Step3p7ForConditionalGeneration"],
        "text_config": text,
        "vision_config": dict(VISION),
        "eos_token_id": text["eos_token_id"],
        "torch_dtype": "float32",
    }


def build_weights(seed: int = 0, agreeable: bool = True, **overrides):
    """(config, trunk tensors, MTP tensors), named as the checkpoint has them."""
    from dataclasses import replace

    from mlx_vlm.models.step3p7 import Model, ModelConfig
    from mlx_vlm.models.step3p7.language import DecoderLayer

    config = config_for(**overrides)
    mx.random.seed(seed)
    model = Model(ModelConfig.from_dict(config))
    lm = model.language_model
    params = dict(tree_flatten(lm.parameters()))
    if agreeable:
        _shrink_outputs(params, 0.1)
    embed = "model.embed_tokens.weight"
    params[embed] = mx.random.normal(params[embed].shape)
    trunk = _step_names(params)

    text = config["text_config"]
    args, n, d = lm.args, text["num_hidden_layers"], text["hidden_size"]
    whole = replace(
        args,
        num_hidden_layers=n + text["num_nextn_predict_layers"],
        layer_types=text["layer_types"],
        swiglu_limits=text["swiglu_limits"],
    )
    mtp = {}
    for j in range(text["num_nextn_predict_layers"]):
        pre = f"model.layers.{n + j}."
        block = _block(DecoderLayer(whole, n + j), agreeable)
        mtp.update({pre + k: v for k, v in _step_names(block).items()})
        mtp.update(
            {
                f"{pre}enorm.weight": 0.1 * mx.random.normal((d,)),
                f"{pre}hnorm.weight": 0.1 * mx.random.normal((d,)),
                f"{pre}eh_proj.weight": _fuse(d, agreeable),
                f"{pre}shared_head.norm.weight": 0.1 * mx.random.normal((d,)),
                f"{pre}shared_head.output.weight": params["lm_head.weight"]
                * (1.0 + 0.05 * mx.random.normal(params["lm_head.weight"].shape)),
            }
        )
    return config, trunk, mtp


def build_folder(path: Path, seed: int = 0, agreeable: bool = True, **overrides):
    """A folder with trunk + MTP layers, and ``path-trunk`` without them."""
    config, trunk, mtp = build_weights(seed, agreeable, **overrides)
    full = save_folder(Path(path), config, trunk, mtp)
    trunk_only = save_folder(Path(str(path) + "-trunk"), config, trunk)
    return full, trunk_only
