"""A tiny random Hunyuan-V4 (``hy_v4``) checkpoint with its ``model.mtp_layers.0`` head.

Written as mlx-vlm 0.7.10's ``hy_v4`` sanitize reads a Hugging Face folder:
the language model at the top (``model.embed_tokens``, ``model.layers``,
``model.hc_head``, ``model.norm``, ``lm_head``), routed experts one by one
(``mlp.experts.{e}.{gate,up,down}_proj``, which the sanitize stacks), and the
MTP layer under ``model.mtp_layers.0.`` with the names mlx-vlm's splitter
renames (``enorm``, ``hnorm``, ``eh_proj``, ``input_layernorm``,
``self_attn.*``, ``post_attention_layernorm``, ``mlp.*``, ``final_layernorm``).
The published checkpoint stores MXFP8 tensors (``*.weight_scale``); mlx-vlm
0.7.10 reads ``self_attn.kv_b_proj`` only in that form, so this float fixture
stores the attention's absorbed projections as mlx-vlm names them
(``embed_q``, ``unembed_out``).

Three layers (indexer kinds ``full, full, shared``), two hyper-connection
streams with small random mixes, a top-k of 8 so prompts of a few dozen
tokens attend sparsely. Float32 (MLX's CPU MoE kernel). ``agreeable=True``
shrinks block outputs and makes ``eh_proj`` read the embedding nearly as it
is, so drafts are often, not always, accepted.
"""

from pathlib import Path
from typing import Dict

import mlx.core as mx
from mlx.utils import tree_flatten
from tiny import VOCAB, _shrink_outputs, save_folder, special_id

EOS = special_id("<|im_end|>")
CONFIG = dict(
    model_type="hy_v4",
    architectures=["HYV4ForCausalLM"],
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=1,
    n_shared_experts=1,
    n_routed_experts=4,
    routed_scaling_factor=1.5,
    kv_lora_rank=16,
    q_lora_rank=24,
    qk_rope_head_dim=8,
    v_head_dim=16,
    qk_nope_head_dim=16,
    index_head_dim=16,
    index_n_heads=2,
    index_topk=8,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    hc_mult=2,
    num_nextn_predict_layers=1,
    eos_token_id=EOS,
    tie_word_embeddings=False,
)


def _randomize(params: Dict[str, mx.array]) -> None:
    """mlx-vlm initializes the mixes and gates to zeros: small random values."""
    for k, v in params.items():
        if k.endswith(("hc_fn", "hc_head_fn")):
            params[k] = 0.1 * mx.random.normal(v.shape)
        elif k.endswith(("hc_base", "hc_head_base", "e_score_correction_bias")):
            params[k] = 0.1 * mx.random.normal(v.shape)
        elif k.endswith("learnable_sink_param"):
            params[k] = 0.5 * mx.random.normal(v.shape)
        elif k.endswith("mlp.gate.weight"):
            params[k] = mx.random.normal(v.shape) * v.shape[-1] ** -0.5
        elif k.endswith("norm.weight"):
            params[k] = 1.0 + 0.1 * mx.random.normal(v.shape)


def _per_expert(params: Dict[str, mx.array]) -> Dict[str, mx.array]:
    """mlx-vlm's fused ``switch_mlp`` -> the checkpoint's experts one by one."""
    out = {}
    for k, v in params.items():
        pre, sep, rest = k.partition(".mlp.switch_mlp.")
        if not sep:
            out[k] = v
            continue
        if rest == "gate_up_proj.weight":
            gate, up = mx.split(v, 2, axis=1)
            parts = {"gate_proj": gate, "up_proj": up}
        else:
            parts = {"down_proj": v}
        for name, w in parts.items():
            for e in range(w.shape[0]):
                out[f"{pre}.mlp.experts.{e}.{name}.weight"] = w[e]
    return out


def build_weights(seed: int = 0, agreeable: bool = True, **overrides):
    """(config, trunk tensors, ``model.mtp_layers.0.*`` tensors), as stored."""
    from mlx_vlm.models.hy_v4 import Model, ModelConfig
    from mlx_vlm.speculative.drafters.hy_v4_mtp import Model as Drafter
    from mlx_vlm.speculative.drafters.hy_v4_mtp import ModelConfig as DrafterConfig

    config = {**CONFIG, **overrides}
    mx.random.seed(seed)
    model = Model(ModelConfig.from_dict(config))
    lm = {
        k[len("language_model.") :]: v for k, v in tree_flatten(model.parameters())
    }
    _randomize(lm)
    if agreeable:
        _shrink_outputs(lm, 0.1)
    embed = "model.embed_tokens.weight"
    lm[embed] = mx.random.normal(lm[embed].shape)
    trunk = _per_expert(lm)

    head = Drafter(DrafterConfig.from_dict({"text_config": config}))
    own = dict(tree_flatten(head.parameters()))
    _randomize(own)
    d = config["hidden_size"]
    if agreeable:
        _shrink_outputs(own, 0.1)
        own["eh_proj.weight"] = mx.concatenate(
            [mx.eye(d) + 0.05 * mx.random.normal((d, d)), 0.3 * mx.eye(d)], axis=1
        )
    mtp = {}
    for k, v in _per_expert(own).items():
        if k.startswith("decoder."):
            k = k[len("decoder.") :]
        elif k.startswith("norm."):
            k = "final_layernorm." + k[len("norm.") :]
        mtp[f"model.mtp_layers.0.{k}"] = v
    return config, trunk, mtp


def build_folder(path: Path, seed: int = 0, agreeable: bool = True, **overrides):
    """A folder with trunk + MTP layer, and ``path-trunk`` without the layer."""
    config, trunk, mtp = build_weights(seed, agreeable, **overrides)
    full = save_folder(Path(path), config, trunk, mtp)
    trunk_only = save_folder(Path(str(path) + "-trunk"), config, trunk)
    return full, trunk_only
