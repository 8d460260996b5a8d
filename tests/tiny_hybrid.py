"""Tiny random hybrid (gated delta net + attention) models with an ``mtp.*`` head.

Qwen3-Next (``qwen3_next``, MoE on every layer), Qwen3.5 dense (``qwen3_5``) and
Qwen3.5 MoE (``qwen3_5_moe``), written as Hugging Face stores them, so that
loading runs mlx-lm's real sanitize: RMSNorms zero-centred (stored without the
+1 mlx-lm adds), conv1d weights ``[C, 1, K]``, Qwen3-Next experts one tensor
each, Qwen3.5 experts fused (``experts.gate_up_proj``), Qwen3.5 tensors under
``model.language_model`` with the config in ``text_config``.

``agreeable=True`` works as in ``tiny.py`` (small block outputs, ``mtp.fc`` reading
the embedding) so drafts are often, not always, accepted. Decays are kept mild
so the recurrent state carries many tokens and a wrong rollback shows.
"""

from pathlib import Path
from typing import Dict

import mlx.core as mx
from mlx.utils import tree_flatten
from tiny import VOCAB, _shrink_outputs, _unsanitize, save_folder

MODEL_TYPES = ("qwen3_next", "qwen3_5", "qwen3_5_moe")
# Norms that Qwen stores zero-centred (mlx-lm's sanitize adds 1 to them).
_ZERO_CENTRED = (
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "q_norm.weight",
    "k_norm.weight",
    "model.norm.weight",
)

_TEXT = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,  # three GDN layers, then one full-attention layer
    full_attention_interval=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=32,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    rms_norm_eps=1e-6,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
    attention_bias=False,
)
_MOE = dict(
    num_experts=4,
    num_experts_per_tok=2,
    decoder_sparse_step=1,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
    norm_topk_prob=True,
)
_ROPE = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}


def config_for(model_type: str, **overrides) -> dict:
    """The config; ``overrides`` change the text model's (e.g. a bigger one)."""
    top = dict(model_type=model_type, eos_token_id=VOCAB - 1, torch_dtype="float32")
    if model_type == "qwen3_next":
        return {
            **top,
            **_TEXT,
            **_MOE,
            **overrides,
            "mlp_only_layers": [],
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
            "num_nextn_predict_layers": 1,
        }
    text = {**_TEXT, "model_type": f"{model_type}_text", "rope_parameters": _ROPE}
    if model_type == "qwen3_5_moe":
        text.update(_MOE)
    text.update(overrides)
    text["mtp_num_hidden_layers"] = 1
    return {**top, "tie_word_embeddings": False, "text_config": text}


def _to_hf(
    params: Dict[str, mx.array], model_type: str, shifted: bool = True
) -> Dict[str, mx.array]:
    """mlx-lm parameter names and values -> the checkpoint's.

    ``shifted``: the norms hold ``1 + w`` (mlx-lm's trunk), not ``w`` (our head).
    """
    out = {}
    for k, v in params.items():
        if shifted and any(k.endswith(s) for s in _ZERO_CENTRED):
            v = v - 1.0
        if k.endswith("conv1d.weight"):
            v = v.swapaxes(1, 2)  # mlx [C, K, 1] -> torch [C, 1, K]
        out[k] = v
    if model_type == "qwen3_next":
        return _unsanitize(out, {})
    hf = {}
    for k, v in out.items():
        k = k.replace("language_model.model.", "model.language_model.")
        k = k.replace("language_model.lm_head.", "lm_head.")
        hf[k] = v
    return _fuse_experts(hf)


def _fuse_experts(params: Dict[str, mx.array]) -> Dict[str, mx.array]:
    """``switch_mlp.{gate,up,down}_proj`` -> Qwen3.5's fused ``experts.*`` tensors."""
    out = {}
    for k, v in params.items():
        pre, sep, rest = k.partition(".mlp.switch_mlp.")
        if not sep:
            out[k] = v
        elif rest == "gate_proj.weight":
            up = params[f"{pre}.mlp.switch_mlp.up_proj.weight"]
            out[f"{pre}.mlp.experts.gate_up_proj"] = mx.concatenate([v, up], axis=-2)
        elif rest == "down_proj.weight":
            out[f"{pre}.mlp.experts.down_proj"] = v
    return out


def _mild(params: Dict[str, mx.array]) -> None:
    """Non-trivial norm weights, and decays near 1 so state lasts many tokens."""
    for k, v in list(params.items()):
        if k.endswith("norm.weight"):
            params[k] = v + 0.1 * mx.random.normal(v.shape)
        elif k.endswith("A_log"):
            params[k] = mx.log(mx.random.uniform(0.02, 0.3, v.shape))
        elif k.endswith("linear_attn.out_proj.weight"):
            params[k] = v * 0.5


def build_weights(
    model_type: str, seed: int = 0, agreeable: bool = True, **overrides
):
    """Random trunk and ``mtp.*`` tensors, named and valued as in the checkpoint."""
    from mlx_lm.utils import _get_classes

    from mlx_mtp.heads import qwen3_next as family

    config = config_for(model_type, **overrides)
    mx.random.seed(seed)
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    params = dict(tree_flatten(model.parameters()))
    backbone = model.language_model.model if "text_config" in config else model.model
    args = family._text_args(model.args, type(backbone.layers[0]))
    moe = getattr(args, "num_experts", 0) > 0
    layer = family._mtp_layer(args, type(backbone.layers[0]), moe)
    block = dict(tree_flatten(layer.parameters()))
    _mild(params)
    _mild(block)
    if agreeable:
        _shrink_outputs(params, 0.1)
        _shrink_outputs(block, 0.1)
    embed = next(k for k in params if k.endswith("embed_tokens.weight"))
    params[embed] = mx.random.normal(params[embed].shape)
    trunk_w = _to_hf(params, model_type)

    d = args.hidden_size
    eye = mx.eye(d)
    mtp = {
        "pre_fc_norm_embedding.weight": 0.1 * mx.random.normal((d,)),
        "pre_fc_norm_hidden.weight": 0.1 * mx.random.normal((d,)),
        # embedding first, then the hidden state
        "fc.weight": mx.concatenate([eye, 0.3 * eye], axis=1)
        if agreeable
        else mx.random.normal((d, 2 * d)) * d**-0.5,
        "norm.weight": 0.1 * mx.random.normal((d,)),
    }
    # the head's norms compute 1 + w: its weights are zero-centred already
    block = {f"layers.0.{k}": v for k, v in block.items()}
    mtp.update(_to_hf(block, model_type, shifted=False))
    return config, trunk_w, {f"mtp.{k}": v for k, v in mtp.items()}


def build_folder(
    path: Path, model_type: str, seed: int = 0, agreeable: bool = True, **overrides
):
    """A folder with trunk + ``mtp.*`` head, and ``path-trunk`` without the head."""
    config, trunk_w, mtp_w = build_weights(model_type, seed, agreeable, **overrides)
    full = save_folder(Path(path), config, trunk_w, mtp_w)
    trunk_only = save_folder(Path(str(path) + "-trunk"), config, trunk_w)
    return full, trunk_only
