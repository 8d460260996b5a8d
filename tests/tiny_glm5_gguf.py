"""The tiny GLM-5.3-Flash checkpoint (``tiny_glm5``) as llama.cpp writes it (arch
``glm5-next``), spelled out here from llama.cpp's ``conversion/glm.py``
(``Glm5NextModel``, 0c1e57098bba43ac29e6e3b677cdceebdd22334f), not derived from
the converter under test: its ``set_gguf_parameters`` keys, its
``modify_tensors`` transforms (experts stacked, ``kv_b_proj`` split into
``attn_k_b`` transposed and ``attn_v_b``, ``ssm_a = -exp(A_log)``, convs as
``[1, C, 1, K]``, ``dt_bias`` as ``ssm_dt.bias``, the hyper-connection and
pool parameters suffixed ``.weight``) and the names of
``gguf-py/gguf/tensor_mapping.py``. ``test_convert_gguf_glm5`` checks this
writer against llama.cpp's own converter where a checkout is at hand.

``mtp``: ``"with"`` (the default conversion), ``"none"`` (``--no-mtp``) or
``"only"`` (``--mtp``: the MTP layers, embedding, final norm and output).
"""

from pathlib import Path

import numpy as np
import tiny_glm5

# the keys llama.cpp's converter asserts or reads that the tiny config lacks
PUBLISHED = dict(
    linear_attn_config=dict(
        num_heads=2, head_dim=16, short_conv_kernel_size=4, gate_lower_bound=-5.0
    ),
    mla_use_nope=True,
    hc_eps=1e-6,
    norm_topk_prob=True,
    swiglu_limit=10.0,
)
LM = "model.language_model."
_NAMES = {
    "input_layernorm.weight": "attn_norm",
    "post_attention_layernorm.weight": "ffn_norm",
    "self_attn.q_proj.weight": "attn_q",
    "self_attn.k_proj.weight": "attn_k",
    "self_attn.v_proj.weight": "attn_v",
    "self_attn.o_proj.weight": "attn_output",
    "self_attn.q_conv1d.weight": "ssm_conv1d_q",
    "self_attn.k_conv1d.weight": "ssm_conv1d_k",
    "self_attn.v_conv1d.weight": "ssm_conv1d_v",
    "self_attn.f_a_proj.weight": "ssm_f_a",
    "self_attn.f_b_proj.weight": "ssm_f_b",
    "self_attn.g_a_proj.weight": "ssm_g_a",
    "self_attn.g_b_proj.weight": "ssm_g_b",
    "self_attn.b_proj.weight": "ssm_beta",
    "self_attn.o_norm.weight": "ssm_norm",
    "self_attn.q_a_proj.weight": "attn_q_a",
    "self_attn.q_a_layernorm.weight": "attn_q_a_norm",
    "self_attn.q_b_proj.weight": "attn_q_b",
    "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa",
    "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm",
    "self_attn.indexer.wq_b.weight": "indexer.attn_q_b",
    "self_attn.indexer.wk.weight": "indexer.attn_k",
    "self_attn.indexer.k_norm.weight": "indexer.k_norm",
    "self_attn.indexer.weights_proj.weight": "indexer.proj",
    "self_attn.indexer.index_kpool_compress_ape": "indexer_compressor_ape",
    "self_attn.indexer.index_kpool_compress_gate": "indexer_compressor_gate",
    "mlp.gate_proj.weight": "ffn_gate",
    "mlp.up_proj.weight": "ffn_up",
    "mlp.down_proj.weight": "ffn_down",
    "mlp.gate.weight": "ffn_gate_inp",
    "mlp.shared_experts.gate_proj.weight": "ffn_gate_shexp",
    "mlp.shared_experts.up_proj.weight": "ffn_up_shexp",
    "mlp.shared_experts.down_proj.weight": "ffn_down_shexp",
    "eh_proj.weight": "nextn.eh_proj",
    "enorm.weight": "nextn.enorm",
    "hnorm.weight": "nextn.hnorm",
    "shared_head.norm.weight": "nextn.shared_head_norm",
}
_SUFFIXED = {  # name -> the full GGUF name in the block
    "self_attn.indexer.k_norm.bias": "indexer.k_norm.bias",
    "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
    "self_attn.A_log": "ssm_a",
    "self_attn.dt_bias": "ssm_dt.bias",
}
# llama.cpp's tensor_force_quant (Glm5NextModel): these stay F32 in a
# quantized file; so do the routers (the base class's rule)
_EXACT = (
    "hc_attn_", "hc_ffn_", "indexer_compressor_", "ssm_a", "ssm_dt", "exp_probs_b"
)
_F32 = ("ffn_gate_inp", "indexer.proj")


def build(seed: int = 0, **overrides):
    """(config, trunk, MTP tensors) of ``tiny_glm5`` with the published keys."""
    return tiny_glm5.build_weights(seed, **{**PUBLISHED, **overrides})


def gguf_tensors(config: dict, weights: dict, mtp: str = "with") -> dict:
    """GGUF name -> numpy value, in llama.cpp's order of blocks."""
    text = config["text_config"]
    n, heads = text["num_hidden_layers"], text["num_attention_heads"]
    nope, v_dim = text["qk_nope_head_dim"], text["v_head_dim"]
    out, experts = {}, {}
    for name, value in weights.items():
        w = np.array(value)
        if name == "lm_head.weight":
            if not text.get("tie_word_embeddings"):
                out["output.weight"] = w
            continue
        rest = name[len(LM) :]
        if rest in ("embed_tokens.weight", "norm.weight"):
            out["token_embd.weight" if "embed" in rest else "output_norm.weight"] = w
            continue
        _, i, key = rest.split(".", 2)
        is_mtp = int(i) >= n
        if (mtp == "none" and is_mtp) or (mtp == "only" and not is_mtp):
            continue
        blk = f"blk.{i}."
        if key.startswith("mlp.experts."):
            _, _, e, proj, _ = key.split(".")
            experts.setdefault((i, proj), {})[int(e)] = w
            continue
        if key == "self_attn.kv_b_proj.weight":
            kv_b = w.reshape(heads, nope + v_dim, w.shape[-1])
            out[blk + "attn_k_b.weight"] = kv_b[:, :nope].transpose(0, 2, 1)
            out[blk + "attn_v_b.weight"] = kv_b[:, nope:]
        elif key.startswith(("hc_attn_", "hc_ffn_")):
            out[f"{blk}{key}.weight"] = w
        elif key == "self_attn.A_log":
            out[blk + "ssm_a"] = -np.exp(w.reshape(-1)[:heads])
        elif key.endswith("_conv1d.weight"):
            c, _, k = w.shape
            out[f"{blk}{_NAMES[key]}.weight"] = w.reshape(1, c, 1, k)
        elif key in _SUFFIXED:
            out[blk + _SUFFIXED[key]] = w
        else:
            out[f"{blk}{_NAMES[key]}.weight"] = w
    for (i, proj), by_expert in experts.items():
        stacked = np.stack([by_expert[e] for e in sorted(by_expert)])
        out[f"blk.{i}.ffn_{proj[: -len('_proj')]}_exps.weight"] = stacked
    return out


def storage(name: str, w: np.ndarray, qtype) -> str:
    """How llama.cpp's converter at ``--outtype`` ``qtype`` stores GGUF tensor
    ``name``: "Q" (at ``qtype``), "F16" (a matrix whose rows do not split
    into its blocks) or "F32" (vectors, convs, the exact ones, the routers)."""
    import gguf

    if (
        w.ndim < 2
        or any(k in name for k in _EXACT + _F32)
        or name.split(".")[-2].startswith("ssm_conv1d")
    ):
        return "F32"
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    return "Q" if w.shape[-1] % block == 0 else "F16"


def held(config: dict, weights: dict, qtype) -> dict:
    """The checkpoint's tensors with the values a file at ``qtype`` holds.

    In the tiny model every quantized GGUF tensor has the checkpoint's own
    rows (the same matrix, or experts stacked), so its rounding applies to
    the checkpoint's tensor as it is; F16 rounds each value, so it applies
    through any split or transpose (``attn_k_b``) too.
    """
    import gguf
    import mlx.core as mx

    stored = {
        name: storage(name, w, qtype)
        for name, w in gguf_tensors(config, weights).items()
    }
    out = {}
    for name, v in weights.items():
        if ".mlp.experts." in name:  # stacked with the layer's other experts
            parts = name.split(".")  # model.language_model.layers.{i}....{proj}.weight
            i, proj = parts[3], parts[-2]
            kinds = {stored[f"blk.{i}.ffn_{proj[: -len('_proj')]}_exps.weight"]}
        else:
            kinds = {stored[g] for g in gguf_tensors(config, {name: v})}
        w = np.array(v, np.float32)
        if kinds == {"Q"} and not name.endswith("kv_b_proj.weight"):
            w = gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype)
        elif kinds == {"F16"}:
            w = w.astype(np.float16).astype(np.float32)
        elif kinds != {"F32"}:
            raise ValueError(f"{name}: stored as {kinds}, not the tiny layout")
        out[name] = mx.array(w)
    return out


def _metadata(writer, config: dict, blocks: int, n_mtp: int) -> None:
    text = config["text_config"]
    lin = text["linear_attn_config"]
    a = "glm5-next."
    u32, f32 = writer.add_uint32, writer.add_float32
    u32(a + "block_count", blocks)
    u32(a + "context_length", text["max_position_embeddings"])
    u32(a + "embedding_length", text["hidden_size"])
    u32(a + "feed_forward_length", text["intermediate_size"])
    u32(a + "attention.head_count", text["num_attention_heads"])
    kinds = [0 if t == "linear_attention" else 1 for t in text["layer_types"]]
    writer.add_array(a + "attention.head_count_kv", kinds + [1] * n_mtp)
    f32(a + "attention.layer_norm_rms_epsilon", text["rms_norm_eps"])
    f32(a + "attention.layer_norm_epsilon", 1e-6)
    u32(a + "expert_count", text["n_routed_experts"])
    u32(a + "expert_used_count", text["num_experts_per_tok"])
    u32(a + "expert_group_count", text.get("n_group", 1))  # (transformers' default)
    u32(a + "expert_group_used_count", text.get("topk_group", 1))
    u32(a + "vocab_size", text["vocab_size"])
    if n_mtp:
        u32(a + "nextn_predict_layers", n_mtp)
    u32(a + "ssm.conv_kernel", lin["short_conv_kernel_size"])
    u32(a + "kda.head_dim", lin["head_dim"])
    f32(a + "kda.gate_lower_bound", lin["gate_lower_bound"])
    u32(a + "attention.q_lora_rank", text["q_lora_rank"])
    u32(a + "attention.kv_lora_rank", text["kv_lora_rank"])
    u32(a + "rope.dimension_count", 0)
    u32(a + "attention.key_length", text["kv_lora_rank"])
    u32(a + "attention.value_length", text["kv_lora_rank"])
    u32(a + "attention.key_length_mla", text["qk_nope_head_dim"])
    u32(a + "attention.value_length_mla", text["v_head_dim"])
    u32(a + "attention.indexer.head_count", text["index_n_heads"])
    u32(a + "attention.indexer.key_length", text["index_head_dim"])
    u32(a + "attention.indexer.top_k", text["index_topk"])
    u32(a + "attention.indexer.kpool", text["index_kpool"])
    writer.add_bool(a + "attention.indexer.kpool_select_tail", True)
    pattern = text["index_topk_pattern"]
    writer.add_array(a + "attention.indexer.types", [c == "F" for c in pattern])
    u32(a + "hyper_connection.count", text["hc_mult"])
    u32(a + "hyper_connection.sinkhorn_iterations", text["hc_sinkhorn_iters"])
    f32(a + "hyper_connection.epsilon", text["hc_eps"])
    u32(a + "leading_dense_block_count", text["first_k_dense_replace"])
    u32(a + "expert_feed_forward_length", text["moe_intermediate_size"])
    u32(a + "expert_shared_count", text["n_shared_experts"])
    f32(a + "expert_weights_scale", text["routed_scaling_factor"])
    writer.add_bool(a + "expert_weights_norm", text["norm_topk_prob"])
    writer.add_array(a + "swiglu_clamp_exp", [float(text["swiglu_limit"])] * blocks)
    writer.add_array(a + "swiglu_clamp_shexp", [float(text["swiglu_limit"])] * blocks)


def write_gguf(
    path: Path, config: dict, weights: dict, mtp: str = "with", qtype=None
) -> Path:
    """``weights`` (trunk and MTP, the checkpoint's names) as a GGUF file;
    matrices at ``qtype`` where llama.cpp would quantize them."""
    import gguf
    from tiny_plain import _tokenizer_metadata

    text = config["text_config"]
    n_mtp = 0 if mtp == "none" else text["num_nextn_predict_layers"]
    writer = gguf.GGUFWriter(str(path), "glm5-next")
    _metadata(writer, config, text["num_hidden_layers"] + n_mtp, n_mtp)
    _tokenizer_metadata(writer, text["eos_token_id"])
    for name, w in gguf_tensors(config, weights, mtp).items():
        w = w.astype(np.float32)
        kind = "F32" if qtype is None else storage(name, w, qtype)
        if kind == "Q":
            writer.add_tensor(name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, w.astype(np.float16) if kind == "F16" else w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)
