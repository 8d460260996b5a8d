"""Tiny random models of plain architectures (no MTP head) and GGUF writers.

``build_plain`` writes a Hugging Face folder for llama, qwen2, qwen3 or
gemma3_text; for these families mlx-lm's parameter names are the checkpoint
names. ``write_gguf`` writes the same weights as llama.cpp's converter would:
llama.cpp tensor names (from the ``gguf`` package's ``TensorNameMap``), the
Q/K row permutation for llama, +1 on Gemma norms, the tokenizer and chat
template in the metadata.
"""

from pathlib import Path
from typing import Dict

import mlx.core as mx
import numpy as np
import tiny
from mlx.utils import tree_flatten

_PLAIN = dict(
    vocab_size=tiny.VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rms_norm_eps=1e-6,
    rope_theta=50000.0,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
    torch_dtype="float32",
    eos_token_id=tiny.VOCAB - 1,
)
PLAIN_CONFIGS: Dict[str, dict] = {
    "llama": dict(_PLAIN),
    "qwen2": dict(_PLAIN, tie_word_embeddings=True),
    "qwen3": dict(_PLAIN),
    "gemma3_text": dict(
        _PLAIN,
        query_pre_attn_scalar=16,
        sliding_window=512,
        sliding_window_pattern=2,
        rope_local_base_freq=10000.0,
    ),
}
GGUF_ARCH = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma3_text": "gemma3",
}


def plain_weights(model_type: str, seed: int = 0, **overrides):
    from mlx_lm.utils import _get_classes

    config = dict(PLAIN_CONFIGS[model_type], model_type=model_type, **overrides)
    mx.random.seed(seed)
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    weights = dict(tree_flatten(model.parameters()))
    for k in list(weights):
        if k.endswith(
            "norm.weight"
        ):  # non-trivial norms catch a missed +1 or permutation
            weights[k] = 1.0 + 0.1 * mx.random.normal(weights[k].shape)
        elif k.endswith("bias"):
            weights[k] = 0.1 * mx.random.normal(weights[k].shape)
    if model_type == "gemma3_text":  # zero-centred norms: x * (1 + w)
        weights = {
            k: v - 1.0 if k.endswith("norm.weight") else v for k, v in weights.items()
        }
        shape = (tiny.VOCAB, config["hidden_size"])
        weights.setdefault("lm_head.weight", mx.random.normal(shape) * 0.1)
    return config, weights


def build_plain(path: Path, model_type: str, seed: int = 0) -> Path:
    config, weights = plain_weights(model_type, seed)
    return tiny.save_folder(Path(path), config, weights)


# --- GGUF ---------------------------------------------------------------


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute``: each head's rows from halves to interleaved."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def gguf_tensors(
    arch: str, config: dict, weights: Dict[str, object]
) -> Dict[str, np.ndarray]:
    """mlx-lm / HF names -> llama.cpp names, with llama.cpp's own conversions applied.

    A value may be raw quantized blocks (numpy uint8, one row of blocks per row):
    the row permutation applies to those just the same.
    """
    import gguf
    from mlx_mtp.convert.gguf_source import _name_variants, _nextn_names

    arch_enum = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)
    n_blocks = config["num_hidden_layers"] + int(
        config.get("num_nextn_predict_layers", 0)
    )
    tmap = gguf.TensorNameMap(arch_enum, n_blocks)
    nextn = _nextn_names(n_blocks)
    out = {}
    for name, value in weights.items():
        raw = isinstance(value, np.ndarray)
        w = value if raw else np.array(value.astype(mx.float32))
        for base, suffix in _name_variants(name):
            found = tmap.get_name(base) or nextn.get(base)
            if found is not None:
                break
        else:
            raise KeyError(name)
        if arch == "llama" and name.endswith("q_proj.weight"):
            w = _permute(w, config["num_attention_heads"])
        elif arch == "llama" and name.endswith("k_proj.weight"):
            w = _permute(w, config["num_key_value_heads"])
        if arch == "gemma3" and name.endswith("norm.weight"):
            w = w + 1.0
        out[found + suffix] = w
    return out


def _tokenizer_metadata(writer, eos_id: int) -> None:
    from tokenizers import pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens = alphabet + list(tiny.SPECIALS)
    tokens += [f"<pad{i}>" for i in range(tiny.VOCAB - len(tokens))]
    types = [1] * len(alphabet) + [3] * (len(tokens) - len(alphabet))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    # no merges: transformers then derives them from the scores (there are none to find)
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_bos_token_id(tiny.special_id("<|im_start|>"))
    writer.add_eos_token_id(eos_id)
    writer.add_pad_token_id(tiny.special_id("<|endoftext|>"))
    writer.add_add_bos_token(False)
    writer.add_chat_template(tiny.CHAT_TEMPLATE)


def _mla_metadata(writer, config: dict) -> None:
    """llama.cpp's DeepSeek-V2/V3 keys: MLA run as MQA over the latent."""
    rope, nope = config["qk_rope_head_dim"], config["qk_nope_head_dim"]
    writer.add_head_count_kv(1)
    writer.add_q_lora_rank(config["q_lora_rank"])
    writer.add_kv_lora_rank(config["kv_lora_rank"])
    writer.add_key_length(config["kv_lora_rank"] + rope)
    writer.add_value_length(config["kv_lora_rank"])
    writer.add_key_length_mla(nope + rope)
    writer.add_value_length_mla(config["v_head_dim"])
    writer.add_rope_dimension_count(rope)


def write_gguf(
    path: Path,
    arch: str,
    config: dict,
    weights,
    qtype=None,
    raw_type=None,
    tokenizer=True,
):
    """Write ``weights`` as a GGUF file; matrices at ``qtype`` (a GGMLQuantizationType).

    Values given as numpy uint8 are raw blocks of type ``raw_type``, written as they
    are; ``raw_type`` may be a dict (mlx-lm name -> type) for a file of several types.
    """
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    n_mtp = int(config.get("num_nextn_predict_layers", 0))
    writer.add_block_count(config["num_hidden_layers"] + n_mtp)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    mla = arch in ("deepseek2", "glm-dsa")
    if not mla:
        writer.add_head_count_kv(config["num_key_value_heads"])
    if mla:
        _mla_metadata(writer, config)
    if arch == "glm-dsa":  # llama.cpp's GlmMoeDsaModel: the indexer's keys
        writer.add_indexer_head_count(config["index_n_heads"])
        writer.add_indexer_key_length(config["index_head_dim"])
        writer.add_indexer_top_k(config["index_topk"])
    if not mla:
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    rope = config.get("rope_parameters") or config
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_vocab_size(config["vocab_size"])
    if arch == "gemma3":
        writer.add_sliding_window(config["sliding_window"])
        writer.add_sliding_window_pattern(config["sliding_window_pattern"])
    if "n_routed_experts" in config:
        writer.add_expert_count(config["n_routed_experts"])
        writer.add_expert_used_count(config["num_experts_per_tok"])
        writer.add_expert_shared_count(config["n_shared_experts"])
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
        writer.add_leading_dense_block_count(config["first_k_dense_replace"])
        writer.add_expert_weights_scale(config["routed_scaling_factor"])
        writer.add_expert_weights_norm(config["norm_topk_prob"])
        writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        if not mla:  # its rope width is among the MLA keys
            rope = int(config["head_dim"] * config["partial_rotary_factor"])
            writer.add_rope_dimension_count(rope)
    if n_mtp:
        writer.add_nextn_predict_layers(n_mtp)
    if tokenizer:
        _tokenizer_metadata(writer, config["eos_token_id"])
    # gguf_tensors keeps the order of ``weights``
    sources = iter(weights)
    for name, w in gguf_tensors(arch, config, weights).items():
        source = next(sources)
        if w.dtype == np.uint8:
            kind = raw_type[source] if isinstance(raw_type, dict) else raw_type
            writer.add_tensor(name, w, raw_dtype=kind)
        elif (
            qtype is not None
            and w.ndim >= 2
            and w.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0] == 0
        ):
            raw = gguf.quants.quantize(w.astype(np.float32), qtype)
            writer.add_tensor(name, raw, raw_dtype=qtype)
        else:
            writer.add_tensor(name, w.astype(np.float32 if w.ndim < 2 else np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


def random_k_quant(rows: int, cols: int, qtype, seed: int = 0) -> np.ndarray:
    """Random valid blocks of a K-quant (``gguf`` can read but not write them).

    Every byte pattern is a valid block once its float16 super-scales are
    finite, so random bytes with small scales give a realistic tensor.
    """
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    scales = (rng.uniform(0.5, 1.0, size=(rows, cols // block, 2)) * 2e-3).astype(
        np.float16
    )
    if qtype.name == "Q6_K":  # its float16 scale sits at the end of the block
        raw[..., -2:] = scales[..., :1].view(np.uint8)
    else:  # Q2_K..Q5_K: d and dmin first
        raw[..., :4] = scales.view(np.uint8).reshape(rows, cols // block, 4)
    return raw.reshape(rows, -1)
