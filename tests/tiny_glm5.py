"""A tiny random GLM-5.3-Flash (``glm5_next``) checkpoint with its MTP layer.

Written as Hugging Face stores it (the names mlx-vlm 0.7.10's
``glm5_next.Model.sanitize`` and its ``glm5_next_mtp`` splitter read): the
language model under ``model.language_model``, ``lm_head``, hyper-connection
parameters ``hc_{attn,ffn}_{fn,base,scale}``, the delta-attention projections
and convs apart (``q_proj``, ``k_proj``, ``v_proj``, ``q_conv1d`` ``[C, 1, K]``,
``f_a_proj``, ``b_proj``, ``g_a_proj``), MLA's ``q_a_proj``,
``kv_a_proj_with_mqa`` and ``kv_b_proj``, experts one by one
(``experts.{e}.gate_proj``) and the MTP layer as layer ``num_hidden_layers``
(``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm`` and its block). No
vision tower weights: the tower is dropped at load (a text-only checkpoint).

The trunk mixes Kimi-style delta attention and DSA layers (one with its own
indexer, one sharing it), ``hc_mult`` 2 streams, a dense first MLP; the
indexer keeps 2 pools of 4 keys (and the window under way), so prompts of a
few dozen tokens attend sparsely. Float32 (MLX's CPU MoE kernel).
``agreeable=True`` shrinks block outputs and makes the head's ``eh_proj`` read
the embedding nearly as it is, so drafts are often, not always, accepted.
"""

from pathlib import Path
from typing import Dict

import mlx.core as mx
from mlx.utils import tree_flatten
from tiny import VOCAB, _shrink_outputs, save_folder, special_id

EOS = special_id("<|im_end|>")
TEXT = dict(
    model_type="glm5_next_text",
    hidden_size=32,
    intermediate_size=32,
    moe_intermediate_size=16,
    num_hidden_layers=4,
    layer_types=[
        "linear_attention",
        "deepseek_sparse_attention",
        "linear_attention",
        "deepseek_sparse_attention",
    ],
    index_topk_pattern="FFFS",  # layer 3 reuses layer 1's selection
    first_k_dense_replace=1,
    num_nextn_predict_layers=1,
    num_attention_heads=2,
    num_key_value_heads=2,
    n_shared_experts=1,
    n_routed_experts=4,
    num_experts_per_tok=2,
    routed_scaling_factor=1.5,
    kv_lora_rank=16,
    q_lora_rank=16,
    qk_rope_head_dim=0,
    qk_nope_head_dim=16,
    v_head_dim=16,
    index_topk=8,
    index_kpool=4,
    index_head_dim=8,
    index_n_heads=2,
    linear_num_heads=2,
    linear_head_dim=16,
    linear_conv_kernel_dim=4,
    hc_mult=2,
    hc_sinkhorn_iters=4,
    rms_norm_eps=1e-6,
    vocab_size=VOCAB,
    max_position_embeddings=4096,
    pad_token_id=0,
    eos_token_id=EOS,
    tie_word_embeddings=False,
)
VISION = dict(
    depth=1,
    hidden_size=16,
    intermediate_size=32,
    projection_intermediate_size=32,
    num_heads=2,
    out_hidden_size=32,
    patch_size=2,
    spatial_merge_size=2,
    temporal_patch_size=2,
    in_channels=3,
)


def config_for(**overrides) -> dict:
    text = {**TEXT, **overrides}
    return {
        "model_type": "glm5_next",
        "architectures": ["Glm5NextForConditionalGeneration"],
        "text_config": text,
        "vision_config": dict(VISION),
        "eos_token_id": EOS,
        "tie_word_embeddings": False,
    }


def _split(v: mx.array, sizes, axis: int = 0):
    cuts, at = [], 0
    for s in sizes[:-1]:
        at += s
        cuts.append(at)
    return mx.split(v, cuts, axis=axis)


def _hf_layer(params: Dict[str, mx.array], text: dict) -> Dict[str, mx.array]:
    """One layer's mlx-vlm parameters (names relative to it) -> the checkpoint's."""
    heads, nope = text["num_attention_heads"], text["qk_nope_head_dim"]
    P = text["linear_num_heads"] * text["linear_head_dim"]
    D, Hn = text["linear_head_dim"], text["linear_num_heads"]
    out, experts = {}, {}
    for k, v in params.items():
        for site in ("attn", "ffn"):
            for name in ("fn", "base", "scale"):
                k = k.replace(f"{site}_hc.{name}", f"hc_{site}_{name}")
        if k == "self_attn.qkv_proj.weight":
            for n, part in zip("qkv", _split(v, [P, P, P])):
                out[f"self_attn.{n}_proj.weight"] = part
        elif k == "self_attn.qkv_conv.conv.weight":  # [3P, K, 1] -> [P, 1, K] each
            for n, part in zip("qkv", _split(v, [P, P, P])):
                out[f"self_attn.{n}_conv1d.weight"] = part.moveaxis(2, 1)
        elif k == "self_attn.fbg_a_proj.weight":
            names = ("f_a_proj", "b_proj", "g_a_proj")
            for n, part in zip(names, _split(v, [D, Hn, D])):
                out[f"self_attn.{n}.weight"] = part
        elif k == "self_attn.qkv_a_proj.weight":
            q, kv = _split(v, [text["q_lora_rank"], text["kv_lora_rank"]])
            out["self_attn.q_a_proj.weight"] = q
            out["self_attn.kv_a_proj_with_mqa.weight"] = kv
        elif k == "self_attn.embed_q.weight":  # with unembed_out: kv_b_proj
            wv = params["self_attn.unembed_out.weight"]
            kv_b = mx.concatenate([v.swapaxes(-1, -2), wv], axis=1)
            out["self_attn.kv_b_proj.weight"] = kv_b.reshape(
                heads * (nope + wv.shape[1]), -1
            )
        elif k == "self_attn.unembed_out.weight":
            continue
        elif k.endswith("gate_up_proj.weight"):
            pre = k[: -len("gate_up_proj.weight")]
            gate, up = mx.split(v, 2, axis=0)
            out[f"{pre}gate_proj.weight"], out[f"{pre}up_proj.weight"] = gate, up
        elif k.startswith("mlp.switch_mlp."):
            name = k.split(".")[2]
            for e in range(v.shape[0]):
                experts[f"mlp.experts.{e}.{name}.weight"] = v[e]
        else:
            out[k] = v
    return {**out, **experts}


def _by_layer(params: Dict[str, mx.array], head: str):
    """``{layer: {name: v}}`` of ``head{i}.name`` and the rest."""
    layers, rest = {}, {}
    for k, v in params.items():
        if k.startswith(head):
            i, name = k[len(head) :].split(".", 1)
            layers.setdefault(int(i), {})[name] = v
        else:
            rest[k] = v
    return layers, rest


def _randomize(params: Dict[str, mx.array]) -> None:
    """mlx-vlm initialises gates, hyper-connection mixes and the pools'
    parameters to zeros or ones: small random values, so each path matters."""
    for k, v in params.items():
        if k.endswith("norm.weight") or k.endswith("layernorm.weight"):
            params[k] = 1.0 + 0.1 * mx.random.normal(v.shape)
        elif k.endswith(("_hc.fn", "_hc.base")):
            params[k] = 0.1 * mx.random.normal(v.shape)
        elif k.endswith(("gate.weight", "index_kpool_compress_gate")):
            params[k] = 0.3 * mx.random.normal(v.shape)
        elif k.endswith(("e_score_correction_bias", "index_kpool_compress_ape")):
            params[k] = 0.1 * mx.random.normal(v.shape)
        elif k.endswith("A_log"):
            params[k] = mx.log(mx.random.uniform(0.5, 2.0, v.shape))  # mild decays


def build_weights(seed: int = 0, agreeable: bool = True, silent=(), **overrides):
    """(config, trunk tensors, MTP tensors), named as the checkpoint has them;
    the tokens ``silent`` embed to zero (a DFlash drafter's mask token)."""
    from mlx_vlm.models.glm5_next import Model, ModelConfig
    from mlx_vlm.speculative.drafters.glm5_next_mtp import Model as Drafter
    from mlx_vlm.speculative.drafters.glm5_next_mtp import (
        ModelConfig as DrafterConfig,
    )

    config = config_for(**overrides)
    text = config["text_config"]
    mx.random.seed(seed)
    model = Model(ModelConfig.from_dict(config))
    lm = dict(tree_flatten(model.language_model.parameters()))
    _randomize(lm)
    if agreeable:
        _shrink_outputs(lm, 0.1)
    embed = "model.embed_tokens.weight"
    lm[embed] = mx.random.normal(lm[embed].shape)
    for t in silent:
        lm[embed][t] = 0.0
    layers, rest = _by_layer(lm, "model.layers.")
    trunk = {}
    for i, params in layers.items():
        for k, v in _hf_layer(params, text).items():
            trunk[f"model.language_model.layers.{i}.{k}"] = v
    for k, v in rest.items():
        name = k if k.startswith("lm_head") else "model.language_model." + k[6:]
        trunk[name] = v

    head = Drafter(DrafterConfig.from_dict(config))
    mtp = dict(tree_flatten(head.parameters()))
    _randomize(mtp)
    d = text["hidden_size"]
    if agreeable:
        _shrink_outputs(mtp, 0.1)
        w = mtp["eh_proj.weight"]  # [d, 2d]: embedding half first
        mtp["eh_proj.weight"] = mx.concatenate(
            [mx.eye(d) + 0.05 * mx.random.normal((d, d)), 0.3 * w[:, d:]], axis=1
        )
    block = {k[len("mtp_block.") :]: v for k, v in mtp.items() if "mtp_block." in k}
    own = {k: v for k, v in mtp.items() if "mtp_block." not in k}
    own["shared_head.norm.weight"] = own.pop("shared_head_norm.weight")
    at = f"model.language_model.layers.{text['num_hidden_layers']}."
    out = {f"{at}{k}": v for k, v in {**own, **_hf_layer(block, text)}.items()}
    return config, trunk, out


def build_folder(
    path: Path, seed: int = 0, agreeable: bool = True, silent=(), **overrides
):
    """A folder with trunk + MTP layer, and ``path-trunk`` without it."""
    config, trunk, mtp = build_weights(seed, agreeable, silent, **overrides)
    full = save_folder(Path(path), config, trunk, mtp)
    trunk_only = save_folder(Path(str(path) + "-trunk"), config, trunk)
    return full, trunk_only
