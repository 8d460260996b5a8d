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
import numpy as np
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


def config_for(model_type: str) -> dict:
    top = dict(model_type=model_type, eos_token_id=VOCAB - 1, torch_dtype="float32")
    if model_type == "qwen3_next":
        return {
            **top,
            **_TEXT,
            **_MOE,
            "mlp_only_layers": [],
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
            "num_nextn_predict_layers": 1,
        }
    text = {**_TEXT, "model_type": f"{model_type}_text", "rope_parameters": _ROPE}
    if model_type == "qwen3_5_moe":
        text.update(_MOE)
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
    model_type: str, seed: int = 0, agreeable: bool = True, mtp_layers: int = 1
):
    """Random trunk and ``mtp.*`` tensors, named and valued as in the checkpoint.

    ``mtp_layers`` > 1 gives ``mtp.layers.{0..}`` sharing ``fc`` and the norms.
    """
    from mlx_lm.utils import _get_classes

    from mlx_mtp.heads import qwen3_next as family

    config = config_for(model_type)
    if "text_config" in config:
        config["text_config"]["mtp_num_hidden_layers"] = mtp_layers
    else:
        config["num_nextn_predict_layers"] = mtp_layers
    mx.random.seed(seed)
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    params = dict(tree_flatten(model.parameters()))
    backbone = model.language_model.model if "text_config" in config else model.model
    args = family._text_args(model.args, type(backbone.layers[0]))
    moe = getattr(args, "num_experts", 0) > 0
    blocks = [
        dict(tree_flatten(family._mtp_layer(args, type(backbone.layers[0]), moe).parameters()))
        for _ in range(mtp_layers)
    ]
    _mild(params)
    for block in blocks:
        _mild(block)
    if agreeable:
        _shrink_outputs(params, 0.1)
        for block in blocks:
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
    for j, block in enumerate(blocks):
        block = {f"layers.{j}.{k}": v for k, v in block.items()}
        mtp.update(_to_hf(block, model_type, shifted=False))
    return config, trunk_w, {f"mtp.{k}": v for k, v in mtp.items()}


def build_folder(
    path: Path,
    model_type: str,
    seed: int = 0,
    agreeable: bool = True,
    mtp_layers: int = 1,
):
    """A folder with trunk + ``mtp.*`` head, and ``path-trunk`` without the head."""
    config, trunk_w, mtp_w = build_weights(model_type, seed, agreeable, mtp_layers)
    full = save_folder(Path(path), config, trunk_w, mtp_w)
    trunk_only = save_folder(Path(str(path) + "-trunk"), config, trunk_w)
    return full, trunk_only


# --- the same checkpoints as llama.cpp's converter writes them --------------
# (conversion/qwen.py: Qwen3NextModel, _LinearAttentionVReorderBase,
# _Qwen35MtpMixin; leaf names from gguf-py/gguf/tensor_mapping.py). Written out
# here from those facts, independently of mlx_mtp.convert.

GGUF_ARCH = {"qwen3_next": "qwen3next", "qwen3_5": "qwen35", "qwen3_5_moe": "qwen35moe"}
_LEAVES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "post_attention_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "linear_attn.in_proj_qkv": "attn_qkv",
    "linear_attn.in_proj_z": "attn_gate",
    "linear_attn.in_proj_a": "ssm_alpha",
    "linear_attn.in_proj_b": "ssm_beta",
    "linear_attn.in_proj_ba": "ssm_ba",
    "linear_attn.conv1d": "ssm_conv1d",
    "linear_attn.norm": "ssm_norm",
    "linear_attn.out_proj": "ssm_out",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
    "mlp.experts.gate_proj": "ffn_gate_exps",
    "mlp.experts.up_proj": "ffn_up_exps",
    "mlp.experts.down_proj": "ffn_down_exps",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
    "eh_proj": "nextn.eh_proj",
    "enorm": "nextn.enorm",
    "hnorm": "nextn.hnorm",
    "shared_head.norm": "nextn.shared_head_norm",
}
_MTP_OWN = {
    "fc": "eh_proj",
    "pre_fc_norm_embedding": "enorm",
    "pre_fc_norm_hidden": "hnorm",
    "norm": "shared_head.norm",
}


def _llamacpp_names(config: dict, weights: Dict[str, mx.array]):
    """HF names -> ``model.layers.{i}.*`` as llama.cpp's converter sees them."""
    n = config.get("text_config", config)["num_hidden_layers"]
    out = {}
    for k, v in weights.items():
        k = k.replace("model.language_model.", "model.")
        if k.startswith("mtp.layers."):
            j, rest = k[len("mtp.layers.") :].split(".", 1)
            k = f"model.layers.{n + int(j)}.{rest}"
        elif k.startswith("mtp."):
            leaf, suffix = k[len("mtp.") :].split(".", 1)
            k = f"model.layers.{n}.{_MTP_OWN[leaf]}.{suffix}"
        out[k] = np.array(v.astype(mx.float32))
    return out


def _tiled(w: np.ndarray, axis: int, nk: int, r: int, d: int) -> np.ndarray:
    """V heads grouped by key head -> llama.cpp's tiled order, along ``axis``."""
    w = np.moveaxis(w, axis, 0)
    shape = w.shape
    w = w.reshape(nk, r, d, *shape[1:]).swapaxes(0, 1).reshape(shape)
    return np.moveaxis(w, 0, axis)


def llamacpp_tensors(model_type: str, config: dict, weights) -> Dict[str, np.ndarray]:
    """GGUF tensors as llama.cpp's converter writes them (numpy, torch layout)."""
    cfg = config.get("text_config", config)
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    reorder = model_type != "qwen3_next" and nv != nk
    r, qk = nv // nk, 2 * nk * dk
    experts: Dict[str, Dict[int, np.ndarray]] = {}
    out = {}
    for name, w in _llamacpp_names(config, weights).items():
        if name == "model.embed_tokens.weight":
            out["token_embd.weight"] = w
            continue
        if name == "lm_head.weight":
            out["output.weight"] = w
            continue
        if name == "model.norm.weight":
            out["output_norm.weight"] = w + 1
            continue
        _, _, i, rest = name.split(".", 3)
        leaf, _, suffix = rest.rpartition(".")
        if rest.endswith("norm.weight") and "linear_attn.norm" not in rest:
            w = w + 1
        if reorder and "linear_attn." in rest:
            if leaf == "linear_attn.in_proj_qkv":
                w = np.concatenate([w[:qk], _tiled(w[qk:], 0, nk, r, dv)])
            elif leaf == "linear_attn.in_proj_z":
                w = _tiled(w, 0, nk, r, dv)
            elif leaf in ("linear_attn.in_proj_a", "linear_attn.in_proj_b"):
                w = _tiled(w, 0, nk, r, 1)
            elif rest in ("linear_attn.A_log", "linear_attn.dt_bias"):
                w = _tiled(w, 0, nk, r, 1)
            elif leaf == "linear_attn.conv1d":
                w = np.concatenate([w[:qk], _tiled(w[qk:], 0, nk, r, dv)])
            elif leaf == "linear_attn.out_proj":
                w = _tiled(w, 1, nk, r, dv)
        if rest == "linear_attn.A_log":
            out[f"blk.{i}.ssm_a"] = -np.exp(w)
            continue
        if rest == "linear_attn.dt_bias":
            out[f"blk.{i}.ssm_dt.bias"] = w
            continue
        if leaf == "linear_attn.conv1d":
            w = w.squeeze()
        if leaf == "linear_attn.in_proj_qkvz":  # [q, k, v, z] per key head -> split
            per = w.reshape(nk, -1, w.shape[-1])
            q, k, v, z = np.split(per, [dk, 2 * dk, 2 * dk + r * dv], axis=1)
            flat = [t.reshape(-1, w.shape[-1]) for t in (q, k, v)]
            out[f"blk.{i}.attn_qkv.weight"] = np.concatenate(flat)
            out[f"blk.{i}.attn_gate.weight"] = z.reshape(-1, w.shape[-1])
            continue
        if leaf == "mlp.experts.gate_up_proj" or rest == "mlp.experts.gate_up_proj":
            gate, up = np.split(w, 2, axis=-2)
            out[f"blk.{i}.ffn_gate_exps.weight"] = gate
            out[f"blk.{i}.ffn_up_exps.weight"] = up
            continue
        if rest == "mlp.experts.down_proj":
            out[f"blk.{i}.ffn_down_exps.weight"] = w
            continue
        if ".mlp.experts." in f".{rest}":  # one tensor per expert: stacked
            e, proj = rest[len("mlp.experts.") :].split(".", 1)
            experts.setdefault(f"blk.{i}.{_LEAVES['mlp.experts.' + proj[:-7]]}.weight", {})[
                int(e)
            ] = w
            continue
        if leaf == "mlp.shared_expert_gate":
            w = w.reshape(-1)  # squeezed to 1-D
        out[f"blk.{i}.{_LEAVES[leaf]}.{suffix}"] = w
    for name, per in experts.items():
        out[name] = np.stack([per[e] for e in sorted(per)])
    return out


def write_gguf(
    path: Path,
    model_type: str,
    config: dict,
    weights,
    mtp: bool = True,
    qtype=None,
    rename=None,
):
    """A GGUF with llama.cpp's metadata and tensors; ``mtp=False`` leaves the head out.

    ``rename`` (GGUF name -> GGUF name) writes a tensor under another name.
    """
    import gguf
    from tiny_plain import _tokenizer_metadata

    cfg = config.get("text_config", config)
    arch = GGUF_ARCH[model_type]
    if model_type == "qwen3_next" or not mtp:  # qwen3next files drop the head
        weights = {k: v for k, v in weights.items() if not k.startswith("mtp.")}
    n_mtp = sum(1 for k in weights if k.startswith("mtp.") and k.endswith("fc.weight"))
    n_mtp = n_mtp and 1 + max(
        int(k.split(".")[2]) for k in weights if k.startswith("mtp.layers.")
    )
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg["num_hidden_layers"] + n_mtp)
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_key_length(cfg["head_dim"])
    writer.add_value_length(cfg["head_dim"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    rope = cfg.get("rope_parameters", cfg)
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_rope_dimension_count(int(cfg["head_dim"] * rope["partial_rotary_factor"]))
    writer.add_vocab_size(cfg["vocab_size"])
    writer.add_ssm_conv_kernel(cfg["linear_conv_kernel_dim"])
    writer.add_ssm_state_size(cfg["linear_key_head_dim"])
    writer.add_ssm_group_count(cfg["linear_num_key_heads"])
    writer.add_ssm_time_step_rank(cfg["linear_num_value_heads"])
    writer.add_ssm_inner_size(cfg["linear_value_head_dim"] * cfg["linear_num_value_heads"])
    writer.add_full_attention_interval(cfg["full_attention_interval"])
    if cfg.get("num_experts"):
        writer.add_expert_count(cfg["num_experts"])
        writer.add_expert_used_count(cfg["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        writer.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    if n_mtp:
        writer.add_nextn_predict_layers(n_mtp)
    _tokenizer_metadata(writer, config["eos_token_id"])
    for name, w in llamacpp_tensors(model_type, config, weights).items():
        name = (rename or {}).get(name, name)
        if qtype is not None and w.ndim >= 2 and w.shape[-1] % 32 == 0:
            writer.add_tensor(name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, w.astype(np.float32 if w.ndim < 2 else np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)
