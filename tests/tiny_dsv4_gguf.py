"""The tiny DeepSeek-V4-Flash checkpoint (``tiny_dsv4``) as llama.cpp writes it
(arch ``deepseek4``): a model file and its separate ``mtp-`` file, spelled out
here from llama.cpp's ``conversion/deepseek.py`` (``DeepseekV4Model``,
0c1e57098bba43ac29e6e3b677cdceebdd22334f), not derived from the reader under
test: its ``set_gguf_parameters`` keys, its ``filter_tensors`` (``mtp.*`` only
with ``--mtp``, then as ``blk.{N}``: the head's ``hc_head_*`` as the root
``output_hc_*``, ``mtp.0.norm`` as ``nextn.shared_head_norm``, beside the
trunk's embedding, final norm and ``head``), ``generate_extra_tensors``
(experts stacked and repacked to MXFP4 from the checkpoint's FP4,
``e_proj``/``h_proj`` concatenated on the input axis into ``nextn.eh_proj``,
``tid2eid`` as I32), ``tensor_force_quant`` (``eh_proj`` always Q8_0) and the
names of ``gguf-py/gguf/constants.py``. ``test_convert_gguf_dsv4`` checks this
writer against llama.cpp's own converter where a checkout is at hand.

The values are made to lie on the grids the file holds them at (``on_grid``):
``e_proj``/``h_proj`` on Q8_0's (every deepseek4 file has them so), the
experts on MXFP4's where the file repacks them, so that a file gives the
checkpoint's tensors bit for bit.
"""

from pathlib import Path

import mlx.core as mx
import numpy as np
import tiny_dsv4

# the keys llama.cpp's converter reads that the tiny config lacks, and the
# shapes its MXFP4 repack needs (rows of 32: the experts' width); one
# compress ratio per block, the MTP layer's too, as the published config
# has (llama.cpp's loader wants block_count of them)
PUBLISHED = dict(
    compress_ratios=[0, 4, 128, 4, 0],
    moe_intermediate_size=32,
    hc_eps=1e-6,
    swiglu_limit=10.0,
    routed_scaling_factor=1.5,
    norm_topk_prob=True,
    scoring_func="sqrtsoftplus",
    rope_theta=10000.0,
)
ROOT = {
    "embed.weight": "token_embd.weight",
    "norm.weight": "output_norm.weight",
    "head.weight": "output.weight",
    "hc_head_fn": "output_hc_fn.weight",
    "hc_head_base": "output_hc_base.weight",
    "hc_head_scale": "output_hc_scale.weight",
}
LAYER = {
    "attn.attn_sink": "attn_sinks",
    "attn.wq_a.weight": "attn_q_a",
    "attn.wq_b.weight": "attn_q_b",
    "attn.q_norm.weight": "attn_q_a_norm",
    "attn.wkv.weight": "attn_kv",
    "attn.kv_norm.weight": "attn_kv_a_norm",
    "attn.wo_a.weight": "attn_output_a",
    "attn.wo_b.weight": "attn_output_b",
    "attn.compressor.ape": "attn_compressor_ape",
    "attn.compressor.wkv.weight": "attn_compressor_kv",
    "attn.compressor.wgate.weight": "attn_compressor_gate",
    "attn.compressor.norm.weight": "attn_compressor_norm",
    "attn.indexer.wq_b.weight": "indexer.attn_q_b",
    "attn.indexer.weights_proj.weight": "indexer.proj",
    "attn.indexer.compressor.ape": "indexer_compressor_ape",
    "attn.indexer.compressor.wkv.weight": "indexer_compressor_kv",
    "attn.indexer.compressor.wgate.weight": "indexer_compressor_gate",
    "attn.indexer.compressor.norm.weight": "indexer_compressor_norm",
    "attn_norm.weight": "attn_norm",
    "ffn_norm.weight": "ffn_norm",
    "ffn.gate.weight": "ffn_gate_inp",
    "ffn.shared_experts.w1.weight": "ffn_gate_shexp",
    "ffn.shared_experts.w2.weight": "ffn_down_shexp",
    "ffn.shared_experts.w3.weight": "ffn_up_shexp",
    "enorm.weight": "nextn.enorm",
    "hnorm.weight": "nextn.hnorm",
    "norm.weight": "nextn.shared_head_norm",  # the MTP layer's (mtp.0.norm)
}
for _site in ("attn", "ffn"):
    for _part in ("fn", "base", "scale"):
        LAYER[f"hc_{_site}_{_part}"] = f"hc_{_site}_{_part}"
SUFFIXED = {"ffn.gate.bias": "exp_probs_b.bias", "ffn.gate.tid2eid": "ffn_gate_tid2eid.weight"}
EXPERTS = {"w1": "ffn_gate_exps", "w2": "ffn_down_exps", "w3": "ffn_up_exps"}


def q8_grid(w: np.ndarray) -> np.ndarray:
    import gguf

    q = gguf.GGMLQuantizationType.Q8_0
    return gguf.quants.dequantize(gguf.quants.quantize(w.astype(np.float32), q), q)


def mxfp4_codes(w: mx.array):
    """DeepSeek's FP4 layout of ``w``: packed [rows, cols / 2] uint8 (element
    2i in the low nibble) and one E8M0 exponent per 32 values (MLX's mxfp4
    packing is the same, as mlx-vlm's sanitize reads it)."""
    wq, scales = mx.quantize(w, group_size=32, bits=4, mode="mxfp4")[:2]
    return np.array(wq).view(np.uint8), np.array(scales)


def mxfp4_grid(w: mx.array) -> mx.array:
    wq, scales = mx.quantize(w, group_size=32, bits=4, mode="mxfp4")[:2]
    return mx.dequantize(wq, scales, group_size=32, bits=4, mode="mxfp4", dtype=mx.float32)


def repack_mxfp4(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """llama.cpp's ``repack_mxfp4_blocks`` (conversion/base.py): per group of
    32, the scale byte then 16 bytes holding elements j and j + 16."""
    rows, half = packed.shape
    n = half * 2 // 32
    src = packed.reshape(rows, n, 16)
    vals = np.stack([src & 0x0F, src >> 4], axis=-1).reshape(rows, n, 32)
    qs = (vals[..., :16] | (vals[..., 16:] << 4)).astype(np.uint8)
    return np.concatenate([scale.reshape(rows, n, 1), qs], axis=-1).reshape(rows, n * 17)


def build(seed: int = 0, mxfp4: bool = False, **overrides):
    """(config, trunk, ``mtp.0.*``) of ``tiny_dsv4`` with the published keys,
    on the grids the file holds (see the module's docstring)."""
    config, trunk, mtp = tiny_dsv4.build_weights(seed, **{**PUBLISHED, **overrides})
    for k in ("mtp.0.e_proj.weight", "mtp.0.h_proj.weight"):
        mtp[k] = mx.array(q8_grid(np.array(mtp[k])))
    if mxfp4:
        for w in (trunk, mtp):
            for k in [k for k in w if ".ffn.experts." in k]:
                w[k] = mxfp4_grid(w[k])
    return config, trunk, mtp


def _layer(rest: str, blk: str, w: np.ndarray, out: dict, experts: dict) -> None:
    parts = rest.split(".")
    if parts[:2] == ["ffn", "experts"]:
        experts.setdefault(blk + EXPERTS[parts[3]], {})[int(parts[2])] = w
    elif rest in SUFFIXED:
        out[blk + SUFFIXED[rest]] = w
    else:
        out[f"{blk}{LAYER[rest]}.weight"] = w


def gguf_tensors(config: dict, trunk: dict, mtp: dict, part: str) -> dict:
    """GGUF name -> numpy value of the ``"model"`` file or the ``"mtp"`` one;
    stacked experts as ``("experts", [per-expert floats])``."""
    n = config["num_hidden_layers"]
    out, experts = {}, {}
    for name in ("embed.weight", "norm.weight", "head.weight"):
        out[ROOT[name]] = np.array(trunk[name])
    if part == "model":
        for p in ("fn", "base", "scale"):
            out[ROOT[f"hc_head_{p}"]] = np.array(trunk[f"hc_head_{p}"])
        for name, v in trunk.items():
            if name.startswith("layers."):
                _, i, rest = name.split(".", 2)
                if rest == "ffn.gate.bias" and int(i) < config["num_hash_layers"]:
                    continue  # hash-routed: unused, dropped
                _layer(rest, f"blk.{i}.", np.array(v), out, experts)
    else:
        blk = f"blk.{n}."
        for name, v in mtp.items():
            rest = name[len("mtp.0.") :]
            if rest.startswith("hc_head_"):
                out[ROOT[rest]] = np.array(v)
            elif rest not in ("e_proj.weight", "h_proj.weight"):
                _layer(rest, blk, np.array(v), out, experts)
        eh = np.concatenate(
            [np.array(mtp["mtp.0.e_proj.weight"]), np.array(mtp["mtp.0.h_proj.weight"])],
            axis=1,
        )
        out[blk + "nextn.eh_proj.weight"] = eh
    for name, by_expert in experts.items():
        out[name + ".weight"] = ("experts", [by_expert[e] for e in sorted(by_expert)])
    return out


def _metadata(writer, config: dict, blocks: int, n_mtp: int) -> None:
    a = "deepseek4."
    u32, f32 = writer.add_uint32, writer.add_float32
    u32(a + "block_count", blocks)
    u32(a + "context_length", config["max_position_embeddings"])
    u32(a + "embedding_length", config["hidden_size"])
    u32(a + "attention.head_count", config["num_attention_heads"])
    u32(a + "attention.head_count_kv", config["num_key_value_heads"])
    rope = config["rope_scaling"]
    writer.add_string(a + "rope.scaling.type", "yarn")
    f32(a + "rope.scaling.factor", rope["factor"])
    u32(a + "rope.scaling.original_context_length", rope["original_max_position_embeddings"])
    f32(a + "rope.scaling.yarn_beta_fast", rope["beta_fast"])
    f32(a + "rope.scaling.yarn_beta_slow", rope["beta_slow"])
    f32(a + "rope.freq_base", config["rope_theta"])
    f32(a + "attention.layer_norm_rms_epsilon", config["rms_norm_eps"])
    u32(a + "expert_count", config["n_routed_experts"])
    u32(a + "expert_used_count", config["num_experts_per_tok"])
    u32(a + "expert_gating_func", 4)  # sqrtsoftplus
    u32(a + "attention.key_length", config["head_dim"])
    u32(a + "attention.value_length", config["head_dim"])
    u32(a + "rope.dimension_count", config["qk_rope_head_dim"])
    u32(a + "attention.q_lora_rank", config["q_lora_rank"])
    u32(a + "attention.sliding_window", config["sliding_window"])
    u32(a + "expert_feed_forward_length", config["moe_intermediate_size"])
    u32(a + "expert_shared_count", config["n_shared_experts"])
    f32(a + "expert_weights_scale", config["routed_scaling_factor"])
    writer.add_bool(a + "expert_weights_norm", config["norm_topk_prob"])
    writer.add_array(a + "swiglu_clamp_exp", [float(config["swiglu_limit"])] * blocks)
    writer.add_array(a + "swiglu_clamp_shexp", [float(config["swiglu_limit"])] * blocks)
    u32(a + "attention.indexer.head_count", config["index_n_heads"])
    u32(a + "attention.indexer.key_length", config["index_head_dim"])
    u32(a + "attention.indexer.top_k", config["index_topk"])
    u32(a + "attention.output_group_count", config["o_groups"])
    u32(a + "attention.output_lora_rank", config["o_lora_rank"])
    writer.add_array(a + "attention.compress_ratios", list(config["compress_ratios"]))
    f32(a + "attention.compress_rope_freq_base", config["compress_rope_theta"])
    u32(a + "hyper_connection.count", config["hc_mult"])
    u32(a + "hyper_connection.sinkhorn_iterations", config["hc_sinkhorn_iters"])
    f32(a + "hyper_connection.epsilon", config["hc_eps"])
    u32(a + "hash_layer_count", config["num_hash_layers"])
    u32(a + "embedding_length_out", config["hidden_size"] * config["hc_mult"])
    if n_mtp:
        u32(a + "nextn_predict_layers", n_mtp)


# the tensors a quantized file keeps as floats (F32 in the checkpoint: the
# hyper-connection mixes, sinks, pooling offsets, norms, tid2eid)
_FLOAT = ("hc_", "attn_sinks", "_ape", "norm", "tid2eid", "exp_probs_b")


def storage(name: str, w, qtype, experts: str) -> str:
    """How the file holds GGUF tensor ``name``: "Q8_0" (``eh_proj``, forced),
    "MXFP4" (experts, ``experts="MXFP4"``), "Q" (a matrix at ``qtype``, as
    llama.cpp writes the checkpoint's FP8 ones) or "F32"."""
    if name.endswith("nextn.eh_proj.weight"):
        return "Q8_0"
    if isinstance(w, tuple):
        return experts
    if qtype is None or w.ndim < 2 or any(k in name for k in _FLOAT):
        return "F32"
    return "Q" if w.shape[-1] % 32 == 0 else "F32"


def write_gguf(
    path: Path, config: dict, trunk: dict, mtp: dict, part: str = "model",
    qtype=None, experts: str = "F32",
) -> Path:  # fmt: skip
    """``part``: ``"model"`` (llama.cpp's default conversion) or ``"mtp"``
    (``--mtp``); matrices at ``qtype`` (None: F32), experts F32 or MXFP4."""
    import gguf
    from tiny_plain import _tokenizer_metadata

    Q = gguf.GGMLQuantizationType
    n = config["num_hidden_layers"]
    n_mtp = 1 if part == "mtp" else 0
    writer = gguf.GGUFWriter(str(path), "deepseek4")
    _metadata(writer, config, n + n_mtp, n_mtp)
    _tokenizer_metadata(writer, config["eos_token_id"])
    for name, w in gguf_tensors(config, trunk, mtp, part).items():
        kind = storage(name, w, qtype, experts)
        if isinstance(w, tuple):  # stacked experts
            if kind == "MXFP4":
                blocks = [repack_mxfp4(*mxfp4_codes(mx.array(e))) for e in w[1]]
                writer.add_tensor(name, np.stack(blocks), raw_dtype=Q.MXFP4)
                continue
            w = np.stack(w[1])
        if name.endswith("tid2eid.weight"):
            writer.add_tensor(name, w.astype(np.int32))
        elif kind == "Q8_0" or kind == "Q":
            q = Q.Q8_0 if kind == "Q8_0" else qtype
            w = w.astype(np.float32)
            writer.add_tensor(name, gguf.quants.quantize(w, q), raw_dtype=q)
        else:
            writer.add_tensor(name, w.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


def held(weights: dict) -> dict:
    """The checkpoint's tensors (trunk and ``mtp.0.*``) with the values Q8_0
    files hold (the experts on the MXFP4 grid already, ``build(mxfp4=True)``;
    ``e_proj``/``h_proj`` on Q8_0's, as every file has them)."""
    import gguf

    out = {}
    for name, v in weights.items():
        g = {}
        rest = name[len("mtp.0.") :] if name.startswith("mtp.0.") else None
        if ".experts." in name or v.dtype == mx.int32:
            pass
        elif rest is not None and not rest.startswith(("hc_head_", "e_proj", "h_proj")):
            _layer(rest, "blk.0.", np.array(v), g, {})
        elif name.startswith("layers."):
            _, i, rest = name.split(".", 2)
            _layer(rest, f"blk.{i}.", np.array(v), g, {})
        elif name in ROOT and rest is None:
            g = {ROOT[name]: np.array(v)}
        kinds = [storage(k, w, gguf.GGMLQuantizationType.Q8_0, "MXFP4") for k, w in g.items()]
        out[name] = mx.array(q8_grid(np.array(v))) if kinds == ["Q"] else v
    return out
