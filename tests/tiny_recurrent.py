"""Tiny random recurrent hybrids with their MTP layer, in the real checkpoint layout.

Nemotron-H (``nemotron_h``: Mamba2 + attention + MoE, head ``mtp.layers.{0,1}``
with the ``"*E"`` sub-layer pattern), Kimi-Linear (``kimi_linear``: Kimi delta
attention + MLA, DeepSeek-style head at ``model.layers.{N}``), Ling's hybrid
(``bailing_hybrid``: lightning attention + MLA, head at ``model.layers.{N}``),
Kimi-K3 (``kimi_k3``: joined-projection KDA with bounded full-rank gates, MLA
with an output gate, latent MoE, attention residuals; a ``text_config`` and
tensors under ``language_model.``) and Ling-3 (``bailing_moe_v3``, a
``bailing_hybrid`` config with the ``BailingMoeV3ForCausalLM`` architecture:
KDA + MLA, head at ``model.layers.{N}`` with vLLM's router-bias name).
Weights come from mlx-lm's own classes (the head's from ours) at random init
and are written under the Hugging Face names mlx-lm's ``sanitize`` reads:
per-expert tensors, joined MLA ``kv_b_proj``, torch conv layouts, Kimi's
``block_sparse_moe`` with ``w1/w2/w3``, Bailing's ``mlp.gate.weight``.

``agreeable=True`` works as in ``tiny.py`` (small block outputs, the fuse
reading the embedding) so drafts are often, not always, accepted; decays are
kept mild so the recurrent state carries many tokens and a wrong rollback shows.
"""

from pathlib import Path
from typing import Dict

import mlx.core as mx
from mlx.utils import tree_flatten
from tiny import VOCAB, save_folder

MODEL_TYPES = (
    "nemotron_h",
    "kimi_linear",
    "bailing_hybrid",
    "kimi_k3",
    "bailing_moe_v3",
)

_TOP = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    tie_word_embeddings=False,
    torch_dtype="float32",
    eos_token_id=VOCAB - 1,
    num_nextn_predict_layers=1,
)
_MLA = dict(kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)

CONFIGS: Dict[str, dict] = {
    "nemotron_h": dict(
        **_TOP,
        max_position_embeddings=4096,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        attention_bias=False,
        mamba_num_heads=4,
        mamba_head_dim=16,
        mamba_proj_bias=False,
        ssm_state_size=32,
        conv_kernel=4,
        n_groups=2,
        mlp_bias=False,
        layer_norm_epsilon=1e-5,
        use_bias=False,
        use_conv_bias=True,
        hybrid_override_pattern="M*ME",
        n_routed_experts=4,
        n_shared_experts=1,
        moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=48,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=1.5,
        mtp_hybrid_override_pattern="*E",
    ),
    "kimi_linear": dict(
        **_TOP,
        **_MLA,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=16,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        model_max_length=4096,
        linear_attn_config=dict(
            num_heads=2,
            head_dim=32,
            short_conv_kernel_size=4,
            kda_layers=[1, 2, 3],
            full_attn_layers=[4],
        ),
        num_experts=4,
        moe_intermediate_size=32,
        num_experts_per_token=2,
        num_shared_experts=1,
        first_k_dense_replace=1,
        routed_scaling_factor=1.5,
        mla_use_nope=True,
    ),
    "bailing_hybrid": dict(
        **_TOP,
        **_MLA,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        num_experts=4,
        num_experts_per_tok=2,
        num_shared_experts=1,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        layer_group_size=4,  # layers 0-2 lightning attention, 3 MLA
        group_norm_size=2,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=4096,
        routed_scaling_factor=1.5,
        head_dim=16,
        q_lora_rank=32,
    ),
    "kimi_k3": dict(
        architectures=["KimiK3ForConditionalGeneration"],
        torch_dtype="float32",
        eos_token_id=VOCAB - 1,
        tie_word_embeddings=False,
        text_config=dict(
            **{
                k: v
                for k, v in _TOP.items()
                if k not in ("torch_dtype", "eos_token_id")
            },
            **_MLA,
            num_hidden_layers=5,
            num_attention_heads=4,
            num_key_value_heads=4,
            rms_norm_eps=1e-6,
            linear_attn_config=dict(
                num_heads=2,
                head_dim=32,
                short_conv_kernel_size=4,
                kda_layers=[1, 2, 4],
                full_attn_layers=[3, 5],
                gate_lower_bound=-5.0,
                use_full_rank_gate=True,
            ),
            hidden_act="situ",
            activation_situ_beta=4.0,
            activation_situ_linear_beta=25.0,
            attn_res_block_size=2,
            q_lora_rank=32,
            mla_use_nope=True,
            mla_use_output_gate=True,
            num_experts=4,
            num_experts_per_token=2,
            num_shared_experts=1,
            moe_intermediate_size=32,
            routed_expert_hidden_size=32,
            latent_moe_use_norm=True,
            routed_scaling_factor=1.5,
            first_k_dense_replace=1,
        ),
    ),
    "bailing_moe_v3": dict(
        **_TOP,
        **_MLA,
        model_type="bailing_hybrid",
        architectures=["BailingMoeV3ForCausalLM"],
        moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=48,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_experts=4,
        num_experts_per_tok=2,
        num_shared_experts=1,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1,
        layer_group_size=4,  # layers 0-2 KDA, 3 MLA
        head_dim=16,
        q_lora_rank=32,
        kda_lower_bound=-5.0,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=4096,
        routed_scaling_factor=1.5,
    ),
}


def text_config(config: dict) -> dict:
    return config.get("text_config") or config


# mlx-lm's stacked expert projections -> the checkpoint's per-expert names
_EXPERTS = {
    "nemotron_h": {"fc1": "up_proj", "fc2": "down_proj"},
    "kimi_linear": {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"},
    "bailing_hybrid": {p: p for p in ("gate_proj", "up_proj", "down_proj")},
    "kimi_k3": {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"},
    "bailing_moe_v3": {p: p for p in ("gate_proj", "up_proj", "down_proj")},
}
# Kimi-K3's attention residuals: mlx-lm's modules -> the checkpoint's names
_ATTN_RES = {
    "_res_proj.weight": "_res.proj_weight",
    "_res_norm.weight": "_res.norm_weight",
}


def _unsanitize(params: Dict[str, mx.array], model_type: str) -> Dict[str, mx.array]:
    """mlx-lm parameter names and layouts -> the checkpoint's."""
    out = {}
    for k, v in params.items():
        if k.endswith("embed_q.weight"):  # MLA: re-join kv_b_proj
            pre = k[: -len("embed_q.weight")]
            wv = params[pre + "unembed_out.weight"]
            kv_b = mx.concatenate([v.swapaxes(-1, -2), wv], axis=1)
            out[pre + "kv_b_proj.weight"] = kv_b.reshape(-1, kv_b.shape[-1])
        elif k.endswith("unembed_out.weight"):
            continue
        elif "switch_mlp." in k:
            pre, post = k.split("switch_mlp.")
            proj, leaf = post.split(".", 1)
            name = _EXPERTS[model_type][proj]
            for e in range(v.shape[0]):
                out[f"{pre}experts.{e}.{name}.{leaf}"] = v[e]
        elif k.endswith("qkv_proj.weight"):  # Kimi-K3: q, k, v apart
            for name, part in zip("qkv", mx.split(v, 3, axis=0)):
                out[k.replace("qkv_proj", f"{name}_proj")] = part
        elif k.endswith("qkv_conv.conv.weight"):
            for name, part in zip("qkv", mx.split(v, 3, axis=0)):
                out[k.replace("qkv_conv.conv", f"{name}_conv1d")] = part.swapaxes(1, 2)
        elif k.endswith(tuple(_ATTN_RES)):
            end = next(e for e in _ATTN_RES if k.endswith(e))
            out[k[: -len(end)] + _ATTN_RES[end]] = v
        elif k.endswith(("conv1d.weight", "_conv.conv.weight")):
            # mlx [C, K, 1] -> torch [C, 1, K]; Kimi's q_conv.conv is q_conv1d
            out[k.replace("_conv.conv.", "_conv1d.")] = v.swapaxes(1, 2)
        else:
            out[k.replace(".mlp.gate.gate_proj.", ".mlp.gate.")] = v  # Bailing
    if model_type in ("kimi_linear", "kimi_k3"):  # MoE: mlp.* -> block_sparse_moe.*
        moe = {k.split(".mlp.")[0] for k in out if ".mlp.experts." in k}
        renamed = {}
        for k, v in out.items():
            if k.split(".mlp.")[0] in moe:
                k = k.replace(
                    ".mlp.e_score_correction_bias", ".mlp.gate.e_score_correction_bias"
                )
                k = k.replace(".mlp.", ".block_sparse_moe.")
            renamed[k] = v
        out = renamed
    return out


def _mild(params: Dict[str, mx.array], agreeable: bool) -> None:
    """Non-trivial norms, slow decays, and (agreeable) small block outputs."""
    for k, v in list(params.items()):
        if k.endswith("norm.weight"):
            params[k] = v + 0.1 * mx.random.normal(v.shape)
        elif k.endswith("A_log"):  # Mamba2 and KDA decays near 1
            params[k] = mx.log(mx.random.uniform(0.02, 0.3, v.shape))
        elif agreeable and any(
            s in k
            for s in (
                "o_proj.",
                "out_proj.",
                "dense.",
                "down_proj.",
                "fc2.",
                "unembed_out",
            )
        ):
            params[k] = v * 0.1


def _head_params(model_type: str, model, config: dict, agreeable: bool):
    """The MTP layer's tensors, named relative to its checkpoint prefix."""
    import importlib

    family = importlib.import_module(f"mlx_mtp.heads.{model_type}")
    from mlx_mtp.target import find_backbone

    head = family.build(model.args, config, find_backbone(model), {})
    params = {k[len("block.") :] if k.startswith("block.") else k: v
              for k, v in tree_flatten(head.parameters())}  # fmt: skip
    _mild(params, agreeable)
    d = text_config(config)["hidden_size"]
    eye = mx.eye(d)
    fuse = (
        mx.concatenate([eye, 0.3 * eye], axis=1)  # embedding first, then the hidden
        if agreeable
        else mx.random.normal((d, 2 * d)) * d**-0.5
    )
    fuse_key = next(k for k in params if k.endswith("eh_proj.weight"))
    params[fuse_key] = fuse
    return params


def build_weights(model_type: str, seed: int = 0, agreeable: bool = True):
    """Random trunk and MTP tensors, named and valued as in the checkpoint."""
    from mlx_lm.utils import _get_classes

    config = dict({"model_type": model_type, **CONFIGS[model_type]})
    mx.random.seed(seed)
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    params = dict(tree_flatten(model.parameters()))
    _mild(params, agreeable)
    embed = next(k for k in params if "embed" in k and k.endswith(".weight"))
    params[embed] = mx.random.normal(params[embed].shape)
    head = _head_params(model_type, model, config, agreeable)
    if model_type == "nemotron_h":
        mtp = {f"mtp.{k}": v for k, v in head.items()}
    else:
        pre = "language_model." if model_type == "kimi_k3" else ""
        n = text_config(config)["num_hidden_layers"]
        mtp = {f"{pre}model.layers.{n}.{k}": v for k, v in head.items()}
    mtp = _unsanitize(mtp, model_type)
    if model_type == "bailing_moe_v3":  # vLLM's name for the MTP router bias
        mtp = {k.replace(".gate.expert_bias", ".gate.e_score_correction_bias"): v
               for k, v in mtp.items()}  # fmt: skip
    return config, _unsanitize(params, model_type), mtp


def build_folder(path: Path, model_type: str, seed: int = 0, agreeable: bool = True):
    """A folder with trunk + MTP layer, and ``path-trunk`` without it."""
    config, trunk_w, mtp_w = build_weights(model_type, seed, agreeable)
    full = save_folder(Path(path), config, trunk_w, mtp_w)
    trunk_only = save_folder(Path(str(path) + "-trunk"), config, trunk_w)
    return full, trunk_only
