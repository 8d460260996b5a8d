"""Step-3.5/3.7-Flash GGUF files (llama.cpp arch ``step35``) with their MTP layers.

What llama.cpp's converter (``Step35Model``: per-layer lists in
``set_gguf_parameters``, ``filter_tensors``, ``modify_tensors``) writes:

- per-layer arrays: head counts (sliding layers take
  ``attention_other_setting``'s), the sliding-window pattern, SwiGLU clamps;
  ``rope.freq_base`` and ``rope.freq_base_swa`` from the ``rope_theta`` list;
  partial RoPE 0.5 on full-attention layers and 1.0 on sliding ones (it
  asserts exactly that); the MTP layers appended at ``blk.{N+j}`` with
  ``{arch}.nextn_predict_layers``;
- every ``*norm.weight`` as ``1 + w`` (mlx-lm's trunk keeps ``1 + w``; the MTP
  head reads ``w``, so MTP norms get ``- 1``);
- ``moe.router_bias`` as ``exp_probs_b.bias``; ``shared_head.output`` (under
  ``.transformer.``) as ``nextn.shared_head_head``;
- Llama-3 RoPE scaling as a ``rope_freqs`` tensor (refused, as for every arch:
  the file holds the factors, not the scaling's parameters).
"""

from typing import Any, Dict, List

# mlx-lm's Step3p5 module names -> the Hugging Face names llama.cpp's tables know
ALIASES = (
    (".mlp.switch_mlp.", ".moe."),
    (".mlp.gate.gate.", ".moe.gate."),
    (".mlp.share_expert.", ".share_expert."),
    (".shared_head.output.", ".shared_head.head."),
)


def build_config(meta, tensor_names: List[str]) -> Dict[str, Any]:
    key = meta.arch_key
    n_mtp = int(key("nextn_predict_layers", 0) or 0)
    n_blocks = int(key("block_count"))
    sliding = list(key("attention.sliding_window_pattern"))
    heads, kv = key("attention.head_count"), key("attention.head_count_kv")
    heads = heads if isinstance(heads, list) else [heads] * n_blocks
    kv = kv if isinstance(kv, list) else [kv] * n_blocks
    full = next(i for i, s in enumerate(sliding) if not s)
    swa = next((i for i, s in enumerate(sliding) if s), full)
    theta, theta_swa = key("rope.freq_base"), key("rope.freq_base_swa")
    names = set(tensor_names)
    moe = [i for i in range(n_blocks) if f"blk.{i}.ffn_gate_exps.weight" in names]
    config: Dict[str, Any] = {
        "model_type": "step3p5",
        "hidden_size": key("embedding_length"),
        "num_hidden_layers": n_blocks - n_mtp,
        "num_nextn_predict_layers": n_mtp,
        "vocab_size": key("vocab_size") or len(meta.get("tokenizer.ggml.tokens")),
        "num_attention_heads": heads[full],
        "num_attention_groups": kv[full],
        "attention_other_setting": {
            "num_attention_heads": heads[swa],
            "num_attention_groups": kv[swa],
        },
        "head_dim": key("attention.key_length"),
        "intermediate_size": key("feed_forward_length"),
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon"),
        "max_position_embeddings": key("context_length"),
        "sliding_window": key("attention.sliding_window"),
        "layer_types": [
            "sliding_attention" if s else "full_attention" for s in sliding
        ],
        "partial_rotary_factors": [1.0 if s else 0.5 for s in sliding],
        "rope_theta": [theta_swa if s and theta_swa else theta for s in sliding],
        "use_head_wise_attn_gate": "blk.0.attn_gate.weight" in names,
        "moe_num_experts": key("expert_count"),
        "moe_top_k": key("expert_used_count"),
        "moe_intermediate_size": key("expert_feed_forward_length"),
        "share_expert_dim": key("expert_shared_feed_forward_length"),
        "moe_layers_enum": ",".join(str(i) for i in moe),
        "moe_router_scaling_factor": key("expert_weights_scale", 1.0),
        "norm_expert_weight": bool(key("expert_weights_norm", True)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "torch_dtype": "float16",
    }
    for gguf_key, name in (
        ("swiglu_clamp_exp", "swiglu_limits"),
        ("swiglu_clamp_shexp", "swiglu_limits_shared"),
    ):
        if key(gguf_key) is not None:
            config[name] = list(key(gguf_key))
    for name in ("bos_token_id", "eos_token_id"):
        if meta.get(f"tokenizer.ggml.{name}") is not None:
            config[name] = int(meta.get(f"tokenizer.ggml.{name}"))
    return config


def name_map(
    config: Dict[str, Any], tmap, nextn, candidates, variants
) -> Dict[str, str]:
    """GGUF name -> mlx-lm's name (trunk) or the head's checkpoint name (MTP layers)."""
    out: Dict[str, str] = {}
    for name in candidates:
        hf = name
        for mine, theirs in ALIASES:
            hf = hf.replace(mine, theirs)
        if hf.endswith(".mlp.gate.router_bias"):  # written as exp_probs_b.bias
            found = tmap.get_name(
                hf.replace(".mlp.gate.router_bias", ".moe.router_bias")
            )
            if found is not None:
                out[found + ".bias"] = name
            continue
        for base, suffix in variants(hf):
            found = tmap.get_name(base) or nextn.get(base)
            if found is not None:
                out.setdefault(found + suffix, name)
                break
    return out


def is_mtp_name(config: Dict[str, Any], name: str) -> bool:
    parts = name.split(".")
    return (
        len(parts) > 3
        and parts[:2] == ["model", "layers"]
        and int(parts[2]) >= config["num_hidden_layers"]
    )


def fix(config: Dict[str, Any], name: str, tensors):
    module = name.rsplit(".", 2)[-2] if name.endswith(".weight") else ""
    if "norm" in module and is_mtp_name(config, name):  # stored 1 + w
        return {k: v - 1 for k, v in tensors.items()}
    return tensors
