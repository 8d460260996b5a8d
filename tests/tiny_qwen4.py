"""A tiny random Qwen3.8-Flash-Next (``qwen4_exp``) checkpoint with its ``mtp.*`` head.

Written as Hugging Face stores it (the names mlx-vlm 0.7.10's
``qwen4_exp.Model.sanitize`` reads): the language model under
``model.language_model``, ``lm_head``, RMSNorms zero-centred (``1 + w``),
conv1d weights ``[C, 1, K]``, experts fused (``experts.gate_up_proj``,
``experts.down_proj``), the n-gram table in shards (``ngram_embedding.shard_i``)
and the head under ``mtp.``. No vision tower weights: the tower is dropped at
load (a text-only checkpoint), so text prompts run the language model alone.

The trunk mixes gated delta nets, QSA layers, hyper-connection streams
(``hc_count``) and one per-layer n-gram embedding (PLE) on a linear layer; the
QSA budget is small so prompts of a few dozen tokens attend sparsely. Float32
(MLX's CPU MoE kernel). ``agreeable=True`` shrinks block outputs and makes the
head's ``fc_embedding`` read the embedding nearly as it is, so drafts are
often, not always, accepted.
"""

import re
from pathlib import Path
from typing import Dict

import mlx.core as mx
from mlx.utils import tree_flatten
from tiny import VOCAB, _shrink_outputs, save_folder, special_id

EOS = special_id("<|im_end|>")
TEXT = dict(
    model_type="qwen4_exp_text",
    hidden_size=32,
    num_hidden_layers=4,
    layer_types=[
        "linear_attention",
        "qwen_sparse_attention",
        "linear_attention",
        "qwen_sparse_attention",
    ],
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    shared_expert_intermediate_size=24,
    rms_norm_eps=1e-6,
    vocab_size=VOCAB,
    max_position_embeddings=4096,
    hc_count=2,
    hc_lowrank=8,
    ple_layer_ids=[1],
    ple_embed_dim=16,
    ngram_size=3,
    heads_per_ngram=2,
    ngram_vocab_size_base=64,
    make_ngram_vocab_size_divisible_by=8,
    split_ngram_parts=2,
    indexer_n_heads=2,
    indexer_kv_heads=1,
    indexer_head_dim=8,
    indexer_budget=8,
    indexer_compress_ratio=2,
    mtp_num_hidden_layers=1,
    eos_token_id=EOS,
    tie_word_embeddings=False,
    rope_parameters={
        "rope_type": "default",
        "mrope_section": [2, 1, 1],
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5,
    },
)
VISION = dict(
    depth=1,
    hidden_size=16,
    intermediate_size=32,
    num_heads=2,
    out_hidden_size=32,
    patch_size=2,
    spatial_merge_size=2,
    temporal_patch_size=2,
    num_position_embeddings=16,
    in_channels=3,
)


def config_for(**overrides) -> dict:
    text = {**TEXT, **overrides}
    return {
        "model_type": "qwen4_exp",
        "architectures": ["Qwen4ExpForConditionalGeneration"],
        "text_config": text,
        "vision_config": dict(VISION),
        "eos_token_id": EOS,
        "tie_word_embeddings": False,
    }


def _hf_block(params: Dict[str, mx.array]) -> Dict[str, mx.array]:
    """mlx-vlm's parameter names and layouts -> the checkpoint's."""
    out = {}
    fused = {}
    for k, v in params.items():
        pre, sep, rest = k.partition(".mlp.switch_mlp.")
        if sep:
            fused.setdefault(pre, {})[rest.split(".")[0]] = v
            continue
        if k.endswith("conv1d.weight"):
            v = v.moveaxis(2, 1)  # [C, K, 1] -> [C, 1, K]
        k = re.sub(
            r"\.ngram_embedding\.shards\.(\d+)\.",
            r".ngram_embedding.shard_\1.",
            k,
        )
        out[k] = v
    for pre, parts in fused.items():
        gate_up = mx.concatenate([parts["gate_proj"], parts["up_proj"]], axis=-2)
        out[f"{pre}.mlp.experts.gate_up_proj"] = gate_up
        out[f"{pre}.mlp.experts.down_proj"] = parts["down_proj"]
    return out


def _centred_norms(params: Dict[str, mx.array]) -> None:
    """Qwen4's RMSNorms store ``w`` of ``1 + w``: small random values."""
    for k, v in params.items():
        if k.endswith("norm.weight") and "linear_attn.norm" not in k:
            params[k] = 0.1 * mx.random.normal(v.shape)


def build_weights(seed: int = 0, agreeable: bool = True, **overrides):
    """(config, trunk tensors, ``mtp.*`` tensors), named as the checkpoint has them."""
    from mlx_vlm.models.qwen4_exp import Model, ModelConfig
    from mlx_vlm.speculative.drafters.qwen4_exp_mtp import (
        Model as Drafter,
    )
    from mlx_vlm.speculative.drafters.qwen4_exp_mtp import (
        ModelConfig as DrafterConfig,
    )

    config = config_for(**overrides)
    mx.random.seed(seed)
    model = Model(ModelConfig.from_dict(config))
    lm = dict(tree_flatten(model.language_model.parameters()))
    _centred_norms(lm)
    for k in [k for k in lm if k.endswith("A_log")]:
        lm[k] = mx.log(mx.random.uniform(0.5, 2.0, lm[k].shape))  # mild decays
    if agreeable:
        _shrink_outputs(lm, 0.1)
    embed = "model.embed_tokens.weight"
    lm[embed] = mx.random.normal(lm[embed].shape)
    trunk = {}
    for k, v in _hf_block(lm).items():
        name = k if k.startswith("lm_head") else "model.language_model." + k[6:]
        trunk[name] = v

    head = Drafter(DrafterConfig.from_dict(config))
    mtp = dict(tree_flatten(head.parameters()))
    _centred_norms(mtp)
    if agreeable:
        _shrink_outputs(mtp, 0.1)
        d = config["text_config"]["hidden_size"]
        mtp["fc_embedding.weight"] = mx.eye(d) + 0.05 * mx.random.normal((d, d))
        mtp["fc_hidden.weight"] = 0.3 * mtp["fc_hidden.weight"]
    mtp = {f"mtp.{k}": v for k, v in _hf_block(mtp).items()}
    return config, trunk, mtp


def build_folder(path: Path, seed: int = 0, agreeable: bool = True, **overrides):
    """A folder with trunk + ``mtp.*`` head, and ``path-trunk`` without the head."""
    config, trunk, mtp = build_weights(seed, agreeable, **overrides)
    full = save_folder(Path(path), config, trunk, mtp)
    trunk_only = save_folder(Path(str(path) + "-trunk"), config, trunk)
    return full, trunk_only
