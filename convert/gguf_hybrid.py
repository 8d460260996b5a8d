"""Qwen3-Next and Qwen3.5/3.6 GGUF files: llama.cpp archs ``qwen3next``, ``qwen35``, ``qwen35moe``.

What llama.cpp's converter does to these models (``conversion/qwen.py``:
``Qwen3NextModel``, ``_LinearAttentionVReorderBase``, ``_Qwen35MtpMixin``;
names from ``gguf-py/gguf/tensor_mapping.py``), undone here:

- every ``*norm.weight`` but the gated-delta ``linear_attn.norm`` is stored
  as ``1 + w``. mlx-lm's trunk keeps ``1 + w`` too, so trunk norms stay; the
  MTP head reads ``w`` (it adds the 1 itself), so MTP norms get ``- 1``;
- ``ssm_a`` holds ``-exp(A_log)``; ``dt_bias`` is ``ssm_dt.bias``; the conv
  kernel is squeezed to ``[C, K]`` (mlx-lm's is ``[C, K, 1]``);
- ``qwen3next``: ``in_proj_qkvz`` (per key head ``[q, k, v, z]``) is split
  into ``attn_qkv`` = all q, all k, all v and ``attn_gate`` = all z, and
  the MTP tensors are dropped;
- ``qwen35``/``qwen35moe``: with more value heads than key heads, V heads go
  from grouped-by-key-head order to tiled order on ``in_proj_qkv``'s V rows,
  ``in_proj_z``, ``in_proj_a/b``, ``A_log``, ``dt_bias``, the conv's V
  channels and ``out_proj``'s columns; experts' ``gate_up_proj`` is split;
  the shared-expert gate is squeezed to 1-D (transformers' GGUF reader
  ``integrations/gguf`` undoes the same list);
- MTP (qwen35*): ``mtp.fc`` -> ``blk.N.nextn.eh_proj``, ``pre_fc_norm_embedding``
  -> ``nextn.enorm``, ``pre_fc_norm_hidden`` -> ``nextn.hnorm``, ``mtp.norm`` ->
  ``nextn.shared_head_norm``, ``mtp.layers.j.*`` -> ``blk.{N+j}.*``, with
  ``block_count`` counting them and ``{arch}.nextn_predict_layers`` their number.
"""

from typing import Any, Dict, List

import mlx.core as mx

from mlx_mtp.errors import MTPError

# llama.cpp architecture -> Hugging Face model_type
ARCHS = {"qwen3next": "qwen3_next", "qwen35": "qwen3_5", "qwen35moe": "qwen3_5_moe"}
# GGUF NextN names -> the head's checkpoint names (DESIGN of llama.cpp's _Qwen35MtpMixin)
NEXTN = {
    "nextn.eh_proj": "mtp.fc",
    "nextn.enorm": "mtp.pre_fc_norm_embedding",
    "nextn.hnorm": "mtp.pre_fc_norm_hidden",
    "nextn.shared_head_norm": "mtp.norm",
}
# written by the linear-attention split of qwen3next, fused back after reading
_QKV, _Z = "linear_attn.in_proj_qkv.weight", "linear_attn.in_proj_z.weight"


def text(config: Dict[str, Any]) -> Dict[str, Any]:
    return config.get("text_config", config)


def build_config(meta, tensor_names: List[str]) -> Dict[str, Any]:
    key = meta.arch_key
    head_dim = int(key("attention.key_length"))
    value_heads = int(key("ssm.time_step_rank"))
    n_mtp = int(key("nextn_predict_layers", 0) or 0)
    cfg: Dict[str, Any] = {
        "hidden_size": key("embedding_length"),
        "num_hidden_layers": int(key("block_count")) - n_mtp,
        "num_attention_heads": key("attention.head_count"),
        "num_key_value_heads": key("attention.head_count_kv"),
        "head_dim": head_dim,
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon"),
        "max_position_embeddings": key("context_length"),
        "full_attention_interval": key("full_attention_interval", 4),
        "linear_conv_kernel_dim": key("ssm.conv_kernel"),
        "linear_key_head_dim": key("ssm.state_size"),
        "linear_num_key_heads": key("ssm.group_count"),
        "linear_num_value_heads": value_heads,
        "linear_value_head_dim": int(key("ssm.inner_size")) // value_heads,
        "intermediate_size": key("feed_forward_length", 0),
        "vocab_size": key("vocab_size") or len(meta.get("tokenizer.ggml.tokens")),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": False,
    }
    theta = key("rope.freq_base")
    partial = key("rope.dimension_count") / head_dim
    if key("expert_count"):
        cfg.update(
            num_experts=key("expert_count"),
            num_experts_per_tok=key("expert_used_count"),
            moe_intermediate_size=key("expert_feed_forward_length"),
            shared_expert_intermediate_size=key("expert_shared_feed_forward_length", 0),
            decoder_sparse_step=1,
            norm_topk_prob=bool(key("expert_weights_norm", True)),
        )
    model_type = ARCHS[meta.arch]
    top = {"model_type": model_type, "torch_dtype": "float16"}
    for name in ("bos_token_id", "eos_token_id"):
        if meta.get(f"tokenizer.ggml.{name}") is not None:
            top[name] = int(meta.get(f"tokenizer.ggml.{name}"))
    if model_type == "qwen3_next":
        cfg.update(rope_theta=theta, partial_rotary_factor=partial, mlp_only_layers=[])
        cfg.setdefault("num_experts", 0)
        return {**top, **cfg, "num_nextn_predict_layers": n_mtp}
    cfg.update(
        model_type=f"{model_type}_text",
        mtp_num_hidden_layers=n_mtp,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": theta,
            "partial_rotary_factor": partial,
        },
    )
    return {
        **top,
        "tie_word_embeddings": cfg["tie_word_embeddings"],
        "text_config": cfg,
    }


def _hf_alias(name: str) -> str:
    """mlx-lm's Qwen3.5 names (``language_model.model.*``) as llama.cpp's tables know them."""
    name = name.replace("language_model.model.", "model.", 1)
    return name.replace("language_model.lm_head.", "lm_head.", 1)


def name_map(
    arch: str, config: Dict[str, Any], tmap, candidates, variants
) -> Dict[str, str]:
    """GGUF name -> the name the converter carries it under.

    Target tensors get mlx-lm's names; MTP tensors the head's checkpoint names
    (``mtp.*``); qwen3next's split linear-attention input gets temporary
    ``in_proj_qkv`` / ``in_proj_z`` names until ``finish`` fuses it.
    """
    cfg = text(config)
    n = cfg["num_hidden_layers"]
    out: Dict[str, str] = {}
    names = list(candidates)
    if arch == "qwen3next":
        for i in range(n):
            names += [f"model.layers.{i}.{_QKV}", f"model.layers.{i}.{_Z}"]
    for name in names:
        if arch == "qwen3next" and name.endswith("in_proj_qkvz.weight"):
            continue  # only as attn_qkv + attn_gate (older files' ssm_in: refused)
        hf = _hf_alias(name)
        if hf.endswith(("linear_attn.A_log", "linear_attn.dt_bias")):
            # ssm_a (no suffix) and ssm_dt.bias, llama.cpp's dt_proj.bias
            base = hf.replace("dt_bias", "dt_proj")
            found = tmap.get_name(base)
            if found is not None:
                out[found + (".bias" if "dt_proj" in base else "")] = name
            continue
        for base, suffix in variants(hf):
            found = tmap.get_name(base)
            if found is not None:
                out.setdefault(found + suffix, name)
                break
    n_mtp = int(
        cfg.get("mtp_num_hidden_layers", cfg.get("num_nextn_predict_layers", 0))
    )
    for gguf_name, hf in NEXTN.items():
        out[f"blk.{n}.{gguf_name}.weight"] = f"{hf}.weight"
    # an MTP layer is a full-attention layer of the trunk's kind
    full = next(
        i for i in range(n) if (i + 1) % cfg.get("full_attention_interval", 4) == 0
    )
    for j in range(n_mtp):
        for gguf_name, name in list(out.items()):
            if gguf_name.startswith(f"blk.{full}."):
                rest = _hf_alias(name).split(f"model.layers.{full}.", 1)[1]
                out[f"blk.{n + j}.{gguf_name[len(f'blk.{full}.') :]}"] = (
                    f"mtp.layers.{j}.{rest}"
                )
    return out


def dense_tensor(tensors: Dict[str, mx.array], name: str) -> mx.array:
    """The float value of ``name`` (dequantized when the file packed it)."""
    w = tensors[name]
    base = name[: -len("weight")]
    if f"{base}scales" not in tensors:
        return w
    scales, biases = tensors[f"{base}scales"], tensors[f"{base}biases"]
    bits = w.shape[-1] // scales.shape[-1]  # 32-value blocks: bits words per block
    return mx.dequantize(w, scales, biases, group_size=32, bits=bits)


def _regroup(x: mx.array, axis: int, nk: int, r: int, d: int, offset: int = 0):
    """llama.cpp's tiled V-head order back to grouped-by-key-head, along ``axis``."""
    x = mx.moveaxis(x, axis, 0)
    head, tail = x[:offset], x[offset:]
    tail = tail.reshape(r, nk, d, *tail.shape[1:]).swapaxes(0, 1).reshape(tail.shape)
    return mx.moveaxis(mx.concatenate([head, tail]) if offset else tail, 0, axis)


def fix(arch: str, config: Dict[str, Any], name: str, tensors: Dict[str, mx.array]):
    """Undo llama.cpp's value transforms on one tensor (``tensors``: it and its scales)."""
    cfg = text(config)
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    regroup = arch != "qwen3next" and nv != nk
    r = nv // nk

    def value() -> mx.array:
        return dense_tensor(tensors, name).astype(mx.float32)

    module = name.rsplit(".", 2)[-2] if name.endswith(".weight") else ""
    if "norm" in module and "linear_attn.norm" not in name:  # stored 1 + w
        return {name: value() - 1} if name.startswith("mtp.") else tensors
    if name.endswith("linear_attn.A_log"):
        w = mx.log(-value())
        return {name: _regroup(w, 0, nk, r, 1) if regroup else w}
    if name.endswith("linear_attn.dt_bias"):
        w = value()
        return {name: _regroup(w, 0, nk, r, 1) if regroup else w}
    if name.endswith("linear_attn.conv1d.weight"):
        w = value()
        if regroup:
            w = _regroup(w, 0, nk, r, dv, offset=2 * nk * dk)
        return {name: w[..., None]}  # [C, K] -> mlx-lm's [C, K, 1]
    if name.endswith("shared_expert_gate.weight") and tensors[name].ndim == 1:
        return {name: value()[None]}
    if not regroup:
        return tensors
    if name.endswith(_QKV):
        return {name: _regroup(value(), 0, nk, r, dv, offset=2 * nk * dk)}
    if name.endswith(_Z):
        return {name: _regroup(value(), 0, nk, r, dv)}
    if name.endswith(("linear_attn.in_proj_a.weight", "linear_attn.in_proj_b.weight")):
        return {name: _regroup(value(), 0, nk, r, 1)}
    if name.endswith("linear_attn.out_proj.weight"):
        return {name: _regroup(value(), 1, nk, r, dv)}
    return tensors


def finish(arch: str, config: Dict[str, Any], weights: Dict[str, mx.array]):
    """qwen3next: fuse ``attn_qkv`` and ``attn_gate`` back into ``in_proj_qkvz``."""
    if arch != "qwen3next":
        return weights
    cfg = text(config)
    nk, dk = cfg["linear_num_key_heads"], cfg["linear_key_head_dim"]
    for key in [k for k in weights if k.endswith(_QKV)]:
        pre = key[: -len(_QKV)]
        gate = pre + _Z
        if gate not in weights:
            raise MTPError(f"{pre}: linear attention without its gate (attn_gate)")
        qkv, z = weights.pop(key), weights.pop(gate)
        hidden = qkv.shape[-1]
        q, k, v = mx.split(qkv, [nk * dk, 2 * nk * dk])
        parts = [t.reshape(nk, -1, hidden) for t in (q, k, v, z)]
        fused = mx.concatenate(parts, axis=1).reshape(-1, hidden)
        weights[pre + "linear_attn.in_proj_qkvz.weight"] = fused
    return weights
