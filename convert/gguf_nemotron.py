"""Nemotron-H GGUF files: llama.cpp archs ``nemotron_h`` and ``nemotron_h_moe``.

What llama.cpp's converter writes (``conversion/nemotron.py``:
``NemotronHModel``, on ``GraniteHybridModel`` and ``Mamba2Model`` in
``conversion/granite.py`` and ``conversion/mamba.py``; tensor names from
``gguf-py/gguf/tensor_mapping.py``), undone here:

- Mamba2 mixers: ``ssm_a`` holds ``-exp(A_log)`` as ``[H, 1]``, ``ssm_d`` is
  ``[H, 1]``, ``dt_bias`` is ``ssm_dt.bias``, the conv kernel is squeezed to
  ``[C, K]`` and the gated norm reshaped to ``[n_groups, d_inner / n_groups]``;
- MoE layers (``nemotron_h_moe``, chosen when the config has
  ``num_experts_per_tok``): experts stacked as ``ffn_up_exps`` /
  ``ffn_down_exps``, the router bias as ``exp_probs_b.bias``;
- no layer pattern in the metadata: ``head_count_kv`` and
  ``feed_forward_length`` are per-layer arrays with 0 where a block has no
  attention or MLP; the pattern is read here from the tensors each block has;
- the MTP layer (only ``nemotron_h_moe``, and only one:
  ``num_nextn_predict_layers`` must be 1) is folded into ONE block
  ``blk.N`` counted by ``block_count``, with ``nemotron_h_moe.nextn_predict_layers``:
  ``mtp.layers.0.{enorm, hnorm, eh_proj}`` -> ``nextn.{enorm, hnorm, eh_proj}``,
  ``mtp.layers.1.final_layernorm`` -> ``nextn.shared_head_norm``,
  ``mtp.layers.0.norm`` -> ``attn_norm``, ``mtp.layers.1.norm`` -> ``ffn_norm``,
  and the attention (``mtp.layers.0.mixer``) and MoE (``mtp.layers.1.mixer``)
  tensors under ``blk.N`` as a trunk layer's; so the head's pattern is ``*E``.

Norms are plain RMSNorm scales (no ``+1``); the vocabulary is padded to a
multiple of 8 with ``[PAD]`` tokens, which the embedding rows follow.
"""

from typing import Any, Dict, List

import mlx.core as mx

from mlx_mtp.errors import MTPError

from .gguf_hybrid import dense_tensor

ARCHS = {"nemotron_h": "nemotron_h", "nemotron_h_moe": "nemotron_h"}
MTP_PATTERN = "*E"  # what the folded block holds: attention, then MoE
NEXTN = {
    "nextn.enorm": "mtp.layers.0.enorm",
    "nextn.hnorm": "mtp.layers.0.hnorm",
    "nextn.eh_proj": "mtp.layers.0.eh_proj",
    "nextn.shared_head_norm": "mtp.layers.1.final_layernorm",
    "attn_norm": "mtp.layers.0.norm",
    "ffn_norm": "mtp.layers.1.norm",
}
# mlx-lm's stacked experts -> the merged names llama.cpp's converter gives them
_EXPERTS = {"fc1": "up_proj", "fc2": "down_proj"}


def _kind(names, i: int) -> str:
    """The pattern character of block ``i``, from the tensors it holds."""
    kinds = [
        c
        for c, t in (("M", "ssm_in"), ("*", "attn_q"), ("E", "ffn_gate_inp"))
        if f"blk.{i}.{t}.weight" in names
    ]
    if not kinds and f"blk.{i}.ffn_up.weight" in names:
        kinds = ["-"]
    if len(kinds) != 1:
        raise MTPError(f"block {i} is not one Nemotron-H layer ({kinds or 'empty'})")
    return kinds[0]


def _scalar(value):
    """A per-layer array's value (its layers without the part hold 0)."""
    return max(value) if isinstance(value, (list, tuple)) else value


def build_config(meta, tensor_names: List[str]) -> Dict[str, Any]:
    key, names = meta.arch_key, set(tensor_names)
    n_mtp = int(key("nextn_predict_layers", 0) or 0)
    if n_mtp > 1:
        raise MTPError(f"Nemotron-H GGUF with {n_mtp} MTP layers (llama.cpp folds 1)")
    n = int(key("block_count")) - n_mtp
    pattern = "".join(_kind(names, i) for i in range(n))
    first = {c: pattern.index(c) for c in set(pattern)}
    heads, inner = int(key("ssm.time_step_rank")), int(key("ssm.inner_size"))
    tokens = meta.get("tokenizer.ggml.tokens")
    cfg: Dict[str, Any] = {
        "model_type": "nemotron_h",
        "hidden_size": key("embedding_length"),
        "num_hidden_layers": n,
        "hybrid_override_pattern": pattern,
        "vocab_size": key("vocab_size") or len(tokens),
        "max_position_embeddings": key("context_length"),
        "num_attention_heads": _scalar(key("attention.head_count")),
        "num_key_value_heads": _scalar(key("attention.head_count_kv")),
        "head_dim": key("attention.key_length"),
        "intermediate_size": _scalar(key("feed_forward_length", 0)),
        "layer_norm_epsilon": key("attention.layer_norm_rms_epsilon"),
        "mamba_num_heads": heads,
        "mamba_head_dim": inner // heads,
        "ssm_state_size": key("ssm.state_size"),
        "conv_kernel": key("ssm.conv_kernel"),
        "n_groups": key("ssm.group_count"),
        "mamba_proj_bias": f"blk.{first.get('M')}.ssm_in.bias" in names,
        "use_conv_bias": f"blk.{first.get('M')}.ssm_conv1d.bias" in names,
        "attention_bias": f"blk.{first.get('*')}.attn_q.bias" in names,
        "mlp_bias": any(
            f"blk.{i}.ffn_up{s}.bias" in names for i in range(n) for s in ("", "_shexp")
        ),  # fmt: skip
        "use_bias": False,
        "tie_word_embeddings": "output.weight" not in names,
        "torch_dtype": "float16",
    }
    if key("expert_count"):
        cfg.update(
            n_routed_experts=key("expert_count"),
            num_experts_per_tok=key("expert_used_count"),
            n_shared_experts=key("expert_shared_count", 1),
            moe_intermediate_size=key("expert_feed_forward_length"),
            moe_shared_expert_intermediate_size=key(
                "expert_shared_feed_forward_length"
            ),
            norm_topk_prob=bool(key("expert_weights_norm", True)),
            routed_scaling_factor=key("expert_weights_scale", 1.0),
            n_group=key("expert_group_count", 1) or 1,
            topk_group=key("expert_group_used_count", 1) or 1,
        )
        if key("moe_latent_size"):
            cfg["moe_latent_size"] = key("moe_latent_size")
    if n_mtp:
        cfg.update(num_nextn_predict_layers=1, mtp_hybrid_override_pattern=MTP_PATTERN)
    for name in ("bos_token_id", "eos_token_id"):
        if meta.get(f"tokenizer.ggml.{name}") is not None:
            cfg[name] = int(meta.get(f"tokenizer.ggml.{name}"))
    return cfg


def name_map(config: Dict[str, Any], tmap, candidates, variants) -> Dict[str, str]:
    """GGUF name -> mlx-lm's name (trunk) or the head's checkpoint name (MTP)."""
    out: Dict[str, str] = {}
    for name in candidates:
        hf = name
        if ".mixer.switch_mlp." in name:  # model.layers.{i}.mlp.experts.up_proj
            i, fc = name.split(".")[2], name.split(".")[-2]
            hf = f"model.layers.{i}.mlp.experts.{_EXPERTS[fc]}.weight"
        if hf.endswith((".mixer.A_log", ".mixer.D")):  # ssm_a, ssm_d: no suffix
            found = tmap.get_name(hf)
            if found is not None:
                out[found] = name
            continue
        if hf.endswith(".mixer.dt_bias"):  # written as ssm_dt.bias
            hf = hf.replace(".mixer.dt_bias", ".mixer.dt.bias")
        for base, suffix in variants(hf):
            found = tmap.get_name(base)
            if found is not None:
                out.setdefault(found + suffix, name)
                break
    if config.get("num_nextn_predict_layers"):
        out.update(_mtp_names(config, out))
    return out


def _mtp_names(config: Dict[str, Any], trunk: Dict[str, str]) -> Dict[str, str]:
    """The folded block ``blk.N``: named as a trunk attention layer's and a trunk
    MoE layer's tensors, and the NextN tensors."""
    pattern, n = config["hybrid_override_pattern"], config["num_hidden_layers"]
    if "*" not in pattern or "E" not in pattern:
        raise MTPError("a Nemotron-H MTP block needs a trunk attention and MoE layer")
    out = {f"blk.{n}.{g}.weight": f"{hf}.weight" for g, hf in NEXTN.items()}
    for layer, c in enumerate(MTP_PATTERN):
        i = pattern.index(c)
        trunk_prefix = f"backbone.layers.{i}."
        for gguf_name, name in trunk.items():
            part = gguf_name.split(".", 2)
            if part[:2] == ["blk", str(i)] and not part[2].startswith("attn_norm."):
                rest = name[len(trunk_prefix) :]
                out[f"blk.{n}.{part[2]}"] = f"mtp.layers.{layer}.{rest}"
    return out


def fix(config: Dict[str, Any], name: str, tensors: Dict[str, mx.array]):
    """Undo llama.cpp's value transforms on one tensor (``tensors``: it, its scales)."""
    if name.endswith(".mixer.A_log"):
        a = dense_tensor(tensors, name).astype(mx.float32)
        return {name: mx.log(-a).reshape(-1)}
    if name.endswith((".mixer.D", ".mixer.norm.weight")):
        return {name: dense_tensor(tensors, name).reshape(-1)}
    if name.endswith(".mixer.conv1d.weight"):  # [C, K] -> mlx-lm's [C, K, 1]
        return {name: dense_tensor(tensors, name)[..., None]}
    return tensors
