"""Tiny random models of the 2026 MTP families, in their real checkpoint layouts.

As in ``tiny.py``: the trunk and the MTP block come from mlx-lm's own classes at
random init and are written back under the checkpoint's names (experts one
tensor each, MLA ``kv_b_proj`` joined, zero-centred norms without the ``+1``);
the head's own tensors are written under the names the engines read (vLLM,
SGLang, FastDeploy; see each head module's docstring), spelled out here, not
derived from our head classes. ``agreeable=True`` makes the head often, not
always, agree with the trunk (small block outputs, the fuse reading the
embedding).
"""

from dataclasses import replace
from pathlib import Path
from typing import Callable, Dict, Tuple

import mlx.core as mx
from mlx.utils import tree_flatten
from tiny import (
    _COMMON,
    _MLA,
    _shrink_outputs,
    _unsanitize,
    save_folder,
)

Weights = Dict[str, mx.array]

_ERNIE = dict(
    _COMMON,
    use_bias=False,
    moe_num_experts=4,
    moe_k=2,
    moe_layer_start_index=1,
    moe_intermediate_size=32,
    moe_num_shared_experts=1,
    num_nextn_predict_layers=1,
)
_EXAONE = dict(
    _COMMON,
    head_dim=16,
    moe_intermediate_size=32,
    num_experts=4,
    num_experts_per_tok=2,
    num_shared_experts=1,
    num_hidden_layers=3,
    sliding_window=6,
    layer_types=["sliding_attention", "sliding_attention", "full_attention"],
    is_moe_layer=[False, True, True],
    num_nextn_predict_layers=1,
    mtp_layer_types=["full_attention"],
    mtp_sliding_windows=[0],
)
_LONGCAT = dict(
    _COMMON,
    **_MLA,
    attention_method="MLA",
    zero_expert_type="identity",
    ffn_hidden_size=96,
    moe_topk=2,
    expert_ffn_hidden_size=32,
    n_routed_experts=4,
    zero_expert_num=2,
    num_layers=2,
    routed_scaling_factor=1.5,
    mla_scale_q_lora=True,
    mla_scale_kv_lora=True,
    num_nextn_predict_layers=1,
)
# three trunk layers + three MTP layers; per-layer lists padded to six as the
# hub configs pad them; MTP layer 4 is MoE (moe_layers_enum), 3 and 5 dense
_STEP = dict(
    vocab_size=_COMMON["vocab_size"],
    hidden_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_attention_groups=2,
    head_dim=16,
    intermediate_size=96,
    rms_norm_eps=1e-5,
    rope_theta=[10000.0, 10000.0, 10000.0, 10000.0, 10000.0, 10000.0],
    max_position_embeddings=4096,
    sliding_window=6,
    layer_types=[
        "full_attention",
        "sliding_attention",
        "sliding_attention",
        "sliding_attention",
        "full_attention",
        "sliding_attention",
    ],
    partial_rotary_factors=[0.5, 1.0, 1.0, 1.0, 0.5, 1.0],
    attention_other_setting={"num_attention_heads": 2, "num_attention_groups": 2},
    use_head_wise_attn_gate=True,
    moe_num_experts=4,
    moe_top_k=2,
    moe_intermediate_size=32,
    share_expert_dim=32,
    moe_layers_enum="1,2,4",
    moe_router_scaling_factor=1.5,
    tie_word_embeddings=False,
    torch_dtype="float32",
    eos_token_id=_COMMON["eos_token_id"],
    num_nextn_predict_layers=3,
)
_MIMO2 = dict(
    _COMMON,
    num_hidden_layers=3,
    head_dim=16,
    v_head_dim=16,
    swa_head_dim=16,
    swa_v_head_dim=16,
    swa_num_attention_heads=4,
    swa_num_key_value_heads=2,
    hybrid_layer_pattern=[0, 1, 1],
    moe_layer_freq=[0, 1, 1],
    add_swa_attention_sink_bias=True,
    add_full_attention_sink_bias=False,
    sliding_window_size=6,
    moe_intermediate_size=32,
    n_routed_experts=4,
    n_shared_experts=None,
    num_experts_per_tok=2,
    routed_scaling_factor=None,
    topk_method="noaux_tc",
    scoring_func="sigmoid",
    norm_topk_prob=True,
    n_group=1,
    topk_group=1,
    layernorm_epsilon=1e-5,
    swa_rope_theta=10000.0,
    partial_rotary_factor=0.5,
    attention_value_scale=0.7,
)
CONFIGS = {
    "ernie4_5_moe": _ERNIE,
    "exaone_moe": _EXAONE,
    "longcat_flash": _LONGCAT,
    "step3p5": _STEP,
    "mimo_v2_flash": _MIMO2,
}


def _trunk(model_type: str, config: dict, agreeable: bool):
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)
    args = args_class.from_dict(config)
    model = model_class(args)
    params = dict(tree_flatten(model.parameters()))
    if agreeable:
        _shrink_outputs(params, 0.1)
    embed = "model.embed_tokens.weight"
    params[embed] = mx.random.normal(params[embed].shape)
    return args, model, params


def _fuse(d: int, agreeable: bool) -> mx.array:
    """The fuse projection over ``[embedding, hidden]``."""
    eye = mx.eye(d)
    if agreeable:
        return mx.concatenate([eye, 0.3 * eye], axis=1)
    return mx.random.normal((d, 2 * d)) * d**-0.5


def _block(layer, agreeable: bool) -> Weights:
    params = dict(tree_flatten(layer.parameters()))
    if agreeable:
        _shrink_outputs(params, 0.1)
    return params


def _norm(d: int) -> mx.array:
    return 1.0 + 0.1 * mx.random.normal((d,))


def _ernie(config: dict, agreeable: bool) -> Tuple[Weights, Weights]:
    args, model, params = _trunk("ernie4_5_moe", config, agreeable)
    d = args.hidden_size
    dense = replace(args, moe_layer_start_index=args.num_hidden_layers + 1)
    block = _block(type(model.model.layers[0])(dense, 0), agreeable)
    mtp = {
        "model.mtp_emb_norm.0.weight": _norm(d),
        "model.mtp_hidden_norm.0.weight": _norm(d),
        "model.mtp_linear_proj.0.weight": _fuse(d, agreeable),
    }
    mtp.update({f"model.mtp_block.0.{k}": v for k, v in block.items()})
    return _unsanitize(params, config), mtp


def _exaone(config: dict, agreeable: bool) -> Tuple[Weights, Weights]:
    args, model, params = _trunk("exaone_moe", config, agreeable)
    trunk = {}
    for k, v in _unsanitize(params, config).items():
        # mlx-lm moves the router bias under the gate
        trunk[
            k.replace(
                ".mlp.gate.e_score_correction_bias", ".mlp.e_score_correction_bias"
            )
        ] = v
    d, n = args.hidden_size, args.num_hidden_layers
    types = config["mtp_layer_types"]
    ext = replace(
        args,
        layer_types=list(args.layer_types) + types,
        is_moe_layer=list(args.is_moe_layer) + [False] * len(types),
    )
    mtp = {
        "mtp.pre_fc_norm_embedding.weight": _norm(d),
        "mtp.pre_fc_norm_hidden.weight": _norm(d),
        "mtp.fc.weight": _fuse(d, agreeable),
        "mtp.norm.weight": _norm(d),
    }
    for j in range(len(types)):
        block = _block(type(model.model.layers[0])(ext, n + j), agreeable)
        mtp.update({f"mtp.layers.{j}.{k}": v for k, v in block.items()})
    return trunk, mtp


def _longcat(config: dict, agreeable: bool) -> Tuple[Weights, Weights]:
    from mlx_lm.models.longcat_flash import LongcatFlashMLA, LongcatFlashMLP

    args, model, params = _trunk("longcat_flash", config, agreeable)
    d = args.hidden_size
    layer = {
        "self_attn": LongcatFlashMLA(args).parameters(),
        "transformer_layer.mlp": LongcatFlashMLP(args).parameters(),
    }
    block = {}
    for name, tree in layer.items():
        for k, v in tree_flatten(tree):
            block[f"{name}.{k}"] = v
    if agreeable:
        _shrink_outputs(block, 0.1)
    pre = "model.mtp."
    mtp = {
        f"{pre}embed_tokens.weight": params["model.embed_tokens.weight"],
        f"{pre}layers.0.enorm.m.weight": _norm(d),
        f"{pre}layers.0.hnorm.m.weight": _norm(d),
        f"{pre}layers.0.eh_proj.weight": _fuse(d, agreeable),
        f"{pre}layers.0.input_layernorm.weight": _norm(d),
        f"{pre}layers.0.post_attention_layernorm.weight": _norm(d),
        f"{pre}norm.weight": _norm(d),
    }
    mtp.update({f"{pre}layers.0.{k}": v for k, v in _unsanitize(block, config).items()})
    return _unsanitize(params, config), mtp


# mlx-lm's Step3p5 sanitize, inverted: its module names -> the checkpoint's
_STEP_NAMES = (
    (".mlp.switch_mlp.gate_proj.", ".moe.gate_proj."),
    (".mlp.switch_mlp.up_proj.", ".moe.up_proj."),
    (".mlp.switch_mlp.down_proj.", ".moe.down_proj."),
    (".mlp.gate.gate.", ".moe.gate."),
    (".mlp.gate.router_bias", ".moe.router_bias"),
    (".mlp.share_expert.", ".share_expert."),
)


def _step_names(params: Weights) -> Weights:
    """Step's checkpoint: packed experts under ``moe.``, norms zero-centred (w, not 1 + w)."""
    out = {}
    for k, v in params.items():
        k = "." + k
        for mine, theirs in _STEP_NAMES:
            if mine in k:
                k = k.replace(mine, theirs, 1)
                break
        k = k[1:]
        if k.endswith(".weight") and "norm" in k:
            v = v - 1.0 + 0.1 * mx.random.normal(v.shape)
        out[k] = v
    return out


def _step3p5(config: dict, agreeable: bool) -> Tuple[Weights, Weights]:
    args, model, params = _trunk("step3p5", config, agreeable)
    d, n = args.hidden_size, args.num_hidden_layers
    mtp = {}
    for j in range(config["num_nextn_predict_layers"]):
        pre = f"model.layers.{n + j}."
        block = _block(type(model.model.layers[0])(args, n + j), agreeable)
        mtp.update({pre + k: v for k, v in _step_names(block).items()})
        mtp.update(
            {
                f"{pre}enorm.weight": 0.1 * mx.random.normal((d,)),
                f"{pre}hnorm.weight": 0.1 * mx.random.normal((d,)),
                f"{pre}eh_proj.weight": _fuse(d, agreeable),
                f"{pre}shared_head.norm.weight": 0.1 * mx.random.normal((d,)),
                # each layer's own output projection (here near the trunk's)
                f"{pre}shared_head.output.weight": params["lm_head.weight"]
                * (1.0 + 0.05 * mx.random.normal(params["lm_head.weight"].shape)),
            }
        )
    return _step_names(params), mtp


def _mimo_v2_flash(config: dict, agreeable: bool) -> Tuple[Weights, Weights]:
    args, model, params = _trunk("mimo_v2_flash", config, agreeable)
    d = args.hidden_size
    mtp = {}
    for j in range(3):
        pre = f"model.mtp.layers.{j}."
        layer = type(model.model.layers[0])(args, is_moe=False, is_sliding_window=True)
        for k, v in _block(layer, agreeable).items():
            k = k.replace("post_attention_layernorm.", "pre_mlp_layernorm.")
            mtp[pre + k] = v
        mtp.update(
            {
                f"{pre}enorm.weight": _norm(d),
                f"{pre}hnorm.weight": _norm(d),
                f"{pre}eh_proj.weight": _fuse(d, agreeable),
                f"{pre}final_layernorm.weight": _norm(d),
            }
        )
    return _unsanitize(params, config), mtp


BUILDERS: Dict[str, Callable] = {
    "ernie4_5_moe": _ernie,
    "exaone_moe": _exaone,
    "longcat_flash": _longcat,
}
# several MTP layers, layer j drafting depth j + 1
MULTI_LAYER_BUILDERS: Dict[str, Callable] = {
    "step3p5": _step3p5,
    "mimo_v2_flash": _mimo_v2_flash,
}
MODEL_TYPES = tuple(BUILDERS)
MULTI_LAYER_TYPES = tuple(MULTI_LAYER_BUILDERS)


def build_weights(model_type: str, seed: int = 0, agreeable: bool = True, **overrides):
    config = dict(CONFIGS[model_type], model_type=model_type, **overrides)
    mx.random.seed(seed)
    builder = {**BUILDERS, **MULTI_LAYER_BUILDERS}[model_type]
    trunk, mtp = builder(config, agreeable)
    return config, trunk, mtp


def build_folder(path: Path, model_type: str, seed: int = 0, agreeable: bool = True):
    """A folder with trunk + MTP layers, and ``<path>-trunk`` without them."""
    config, trunk, mtp = build_weights(model_type, seed, agreeable)
    full = save_folder(Path(path), config, trunk, mtp)
    trunk_only = save_folder(Path(str(path) + "-trunk"), config, trunk)
    return full, trunk_only


def write_step35_gguf(path: Path, config: dict, weights: Weights, mtp: bool = True):
    """Step-3.5 as llama.cpp's converter writes it (``Step35Model``), spelled out here.

    Norms + 1, ``moe.router_bias`` as ``exp_probs_b.bias``, the MTP layers at
    ``blk.{N+j}`` with ``.transformer.`` dropped and ``shared_head.output`` as
    ``nextn.shared_head_head``; per-layer head counts and sliding pattern.
    """
    import gguf
    import numpy as np
    from tiny_plain import _tokenizer_metadata

    n, n_mtp = (
        config["num_hidden_layers"],
        config["num_nextn_predict_layers"] if mtp else 0,
    )
    blocks = n + n_mtp
    arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == "step35")
    tmap = gguf.TensorNameMap(arch, blocks)
    nextn = {}  # gguf's NextN table, for any arch
    for kind, patterns in gguf.TensorNameMap.block_mappings_cfg.items():
        if kind.name.startswith("NEXTN_"):
            for bid in range(blocks):
                for p in patterns:
                    nextn[p.format(bid=bid)] = gguf.TENSOR_NAMES[kind].format(bid=bid)
    writer = gguf.GGUFWriter(str(path), "step35")
    types = config["layer_types"][:blocks]
    other = config["attention_other_setting"]
    sliding = [t == "sliding_attention" for t in types]
    writer.add_block_count(blocks)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(
        [
            other["num_attention_heads"] if s else config["num_attention_heads"]
            for s in sliding
        ]
    )
    writer.add_head_count_kv(
        [
            other["num_attention_groups"] if s else config["num_attention_groups"]
            for s in sliding
        ]
    )
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_rope_dimension_count(config["head_dim"])  # halved on full layers
    writer.add_rope_freq_base(config["rope_theta"][0])
    writer.add_rope_freq_base_swa(config["rope_theta"][1])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_sliding_window(config["sliding_window"])
    writer.add_sliding_window_pattern(sliding)
    writer.add_expert_count(config["moe_num_experts"])
    writer.add_expert_used_count(config["moe_top_k"])
    writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    writer.add_expert_shared_feed_forward_length(config["share_expert_dim"])
    writer.add_expert_weights_scale(config["moe_router_scaling_factor"])
    writer.add_expert_weights_norm(config.get("norm_expert_weight", True))
    moe = sorted(int(i) for i in config["moe_layers_enum"].split(","))
    writer.add_leading_dense_block_count(moe[0])
    writer.add_moe_every_n_layers(1)
    if n_mtp:
        writer.add_nextn_predict_layers(n_mtp)
    _tokenizer_metadata(writer, config["eos_token_id"])
    for name, v in weights.items():
        layer = int(name.split(".")[2]) if name.startswith("model.layers.") else -1
        if layer >= blocks:
            continue
        w = np.array(v.astype(mx.float32))
        if name.endswith(".moe.router_bias"):
            name += ".bias"
        if layer >= n:
            name = name.replace(".transformer.", ".").replace(
                "shared_head.output", "shared_head.head"
            )
        if name.endswith("norm.weight"):
            w = w + 1.0
        base, _, suffix = name.rpartition(".")
        found = (
            {
                "model.embed_tokens": "token_embd",
                "model.norm": "output_norm",
                "lm_head": "output",
            }.get(base)
            or tmap.get_name(base)
            or nextn.get(base)
        )
        if found is None:
            raise KeyError(name)
        writer.add_tensor(
            f"{found}.{suffix}", w.astype(np.float32 if w.ndim < 2 else np.float16)
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)
