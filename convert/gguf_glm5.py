"""GLM-5.3-Flash GGUF files (llama.cpp arch ``glm5-next``) with their MTP layer.

What llama.cpp's converter writes (``conversion/glm.py``, ``Glm5NextModel``,
at llama.cpp 0c1e57098bba43ac29e6e3b677cdceebdd22334f; the tensor names are
its ``gguf-py/gguf/tensor_mapping.py``'s, checked against a file that
converter wrote from a tiny checkpoint), undone here back to the Hugging Face
checkpoint's names and shapes, so that a GGUF takes the same convert path as
the checkpoint (mlx-vlm's sanitize, the family's MTP split):

- the MTP layers are blocks ``blk.{N+j}`` (``block_count`` counts them,
  ``glm5-next.nextn_predict_layers`` says how many), each a DSA block with
  ``nextn.{eh_proj, enorm, hnorm, shared_head_norm}``; ``--no-mtp`` leaves
  them out, ``--mtp`` writes them alone with the embedding, final norm and
  output (``mtp-*.gguf``, read with ``--mtp-gguf``);
- the layer kinds sit only in ``attention.head_count_kv``: 0 on a
  delta-attention (KDA) layer, 1 on a DSA layer (MLA run as MQA);
- MLA's ``kv_b_proj`` is split into ``attn_k_b`` (per head, transposed) and
  ``attn_v_b``; routed experts are stacked (``ffn_*_exps``); ``A_log`` is
  stored as ``ssm_a = -exp(A_log)``, ``dt_bias`` as ``ssm_dt.bias``, each
  KDA conv as ``[1, C, 1, K]``; the hyper-connection and indexer-pool
  parameters get a ``.weight`` suffix; a tied ``lm_head`` is dropped;
- norms are plain RMSNorm scales (no ``+1``), every value otherwise as the
  checkpoint holds it.

What the metadata does not record is left at the config's defaults, as the
checkpoints set them: sigmoid ``noaux_tc`` routing, a compressed indexer pool,
NoPE attention (the converter asserts ``qk_rope_head_dim`` 0).

Quantized tensors are read as floats: mlx-vlm's sanitize fuses the
checkpoint's projections, which only floats survive; the quantized file's
widths then come back through ``precision.nearest`` (a second rounding).
"""

from typing import Any, Dict, List, Optional

import mlx.core as mx
import numpy as np

from mlx_mtp.errors import MTPError

from .gguf_hybrid import dense_tensor
from .quants import read_tensor
from .source import Source

ARCHS = {"glm5-next": "glm5_next"}
LM = "model.language_model."
ROOT = {
    "token_embd.weight": f"{LM}embed_tokens.weight",
    "output_norm.weight": f"{LM}norm.weight",
    "output.weight": "lm_head.weight",
}
# a block's GGUF name -> the checkpoint's name in its layer
BLOCK = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    # delta attention (Kimi-style KDA)
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "ssm_conv1d_q.weight": "self_attn.q_conv1d.weight",
    "ssm_conv1d_k.weight": "self_attn.k_conv1d.weight",
    "ssm_conv1d_v.weight": "self_attn.v_conv1d.weight",
    "ssm_f_a.weight": "self_attn.f_a_proj.weight",
    "ssm_f_b.weight": "self_attn.f_b_proj.weight",
    "ssm_g_a.weight": "self_attn.g_a_proj.weight",
    "ssm_g_b.weight": "self_attn.g_b_proj.weight",
    "ssm_beta.weight": "self_attn.b_proj.weight",
    "ssm_a": "self_attn.A_log",
    "ssm_dt.bias": "self_attn.dt_bias",
    "ssm_norm.weight": "self_attn.o_norm.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    # DSA: MLA and its indexer
    "attn_q_a.weight": "self_attn.q_a_proj.weight",
    "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn_q_b.weight": "self_attn.q_b_proj.weight",
    "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "indexer.attn_q_b.weight": "self_attn.indexer.wq_b.weight",
    "indexer.attn_k.weight": "self_attn.indexer.wk.weight",
    "indexer.k_norm.weight": "self_attn.indexer.k_norm.weight",
    "indexer.k_norm.bias": "self_attn.indexer.k_norm.bias",
    "indexer.proj.weight": "self_attn.indexer.weights_proj.weight",
    "indexer_compressor_ape.weight": "self_attn.indexer.index_kpool_compress_ape",
    "indexer_compressor_gate.weight": "self_attn.indexer.index_kpool_compress_gate",
    # MLPs
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
    "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight",
    # the MTP layer's own
    "nextn.eh_proj.weight": "eh_proj.weight",
    "nextn.enorm.weight": "enorm.weight",
    "nextn.hnorm.weight": "hnorm.weight",
    "nextn.shared_head_norm.weight": "shared_head.norm.weight",
    "nextn.embed_tokens.weight": "embed_tokens.weight",
    "nextn.shared_head_head.weight": "shared_head.head.weight",
}
for _site in ("attn", "ffn"):
    for _part in ("fn", "base", "scale"):
        BLOCK[f"hc_{_site}_{_part}.weight"] = f"hc_{_site}_{_part}"
EXPERTS = {f"ffn_{p}_exps.weight": f"{p}_proj" for p in ("gate", "up", "down")}
SPLIT_KV_B = ("attn_k_b.weight", "attn_v_b.weight")  # joined back into kv_b_proj


def _f32(value) -> float:
    """A float32 metadata value as the config wrote it (1e-06, not 9.99e-07)."""
    return float(str(np.float32(value)))


_NEEDED = object()


def _keys(meta):
    """``meta.arch_key`` where a key without a default must be there."""

    def key(name: str, default=_NEEDED):
        value = meta.arch_key(name)
        if value is not None:
            return value
        if default is _NEEDED:
            raise MTPError(f"a glm5-next GGUF without {meta.arch}.{name}")
        return default

    return key


def build_config(meta, names: List[str], n_mtp: Optional[int] = None) -> Dict[str, Any]:
    key = _keys(meta)
    if n_mtp is None:
        n_mtp = int(key("nextn_predict_layers", 0) or 0)
    blocks = int(key("block_count"))
    n = blocks - int(key("nextn_predict_layers", 0) or 0)
    kinds = key("attention.head_count_kv", None)
    if not isinstance(kinds, list) or len(kinds) < n:
        raise MTPError(
            "a glm5-next GGUF without its per-layer attention.head_count_kv "
            "(0: delta attention, 1: DSA)"
        )
    present = set(names)
    heads = int(key("attention.head_count"))
    rope = int(key("rope.dimension_count", 0) or 0)
    if rope:
        raise MTPError(f"glm5-next with {rope} rope dimensions (its MLA is NoPE)")
    indexer = key("attention.indexer.types", None)
    if indexer is None:  # a DSA layer without indexer tensors shares one
        indexer = [f"blk.{i}.indexer.proj.weight" in present for i in range(n)]
    lower = key("kda.gate_lower_bound", None)
    linear = {
        "num_heads": heads,
        "head_dim": int(key("kda.head_dim")),
        "short_conv_kernel_size": int(key("ssm.conv_kernel")),
    }
    if lower is not None:
        linear["gate_lower_bound"] = _f32(lower)
    text: Dict[str, Any] = {
        "model_type": "glm5_next_text",
        "hidden_size": int(key("embedding_length")),
        "intermediate_size": int(key("feed_forward_length")),
        "moe_intermediate_size": int(key("expert_feed_forward_length")),
        "num_hidden_layers": n,
        "num_nextn_predict_layers": n_mtp,
        "layer_types": [
            "linear_attention" if k == 0 else "deepseek_sparse_attention"
            for k in kinds[:n]
        ],
        "mlp_layer_types": [
            "sparse" if f"blk.{i}.ffn_gate_exps.weight" in present else "dense"
            for i in range(n)
        ],
        "indexer_types": ["full" if t else "shared" for t in indexer[:n]],
        "first_k_dense_replace": int(key("leading_dense_block_count", 0)),
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "n_routed_experts": int(key("expert_count")),
        "num_experts_per_tok": int(key("expert_used_count")),
        "n_shared_experts": int(key("expert_shared_count", 1)),
        "routed_scaling_factor": _f32(key("expert_weights_scale", 1.0)),
        "norm_topk_prob": bool(key("expert_weights_norm", True)),
        "n_group": int(key("expert_group_count", 1) or 1),
        "topk_group": int(key("expert_group_used_count", 1) or 1),
        "q_lora_rank": int(key("attention.q_lora_rank")),
        "kv_lora_rank": int(key("attention.kv_lora_rank")),
        "qk_rope_head_dim": 0,
        "qk_nope_head_dim": int(key("attention.key_length_mla")),
        "v_head_dim": int(key("attention.value_length_mla")),
        "mla_use_nope": True,
        "index_n_heads": int(key("attention.indexer.head_count")),
        "index_head_dim": int(key("attention.indexer.key_length")),
        "index_topk": int(key("attention.indexer.top_k")),
        "index_kpool": int(key("attention.indexer.kpool")),
        "index_kpool_always_select_tail": bool(
            key("attention.indexer.kpool_select_tail", True)
        ),
        "linear_attn_config": linear,
        "linear_num_heads": heads,
        "linear_head_dim": linear["head_dim"],
        "linear_conv_kernel_dim": linear["short_conv_kernel_size"],
        "hc_mult": int(key("hyper_connection.count")),
        "hc_sinkhorn_iters": int(key("hyper_connection.sinkhorn_iterations")),
        "hc_eps": _f32(key("hyper_connection.epsilon", 1e-6)),
        "rms_norm_eps": _f32(key("attention.layer_norm_rms_epsilon")),
        "vocab_size": int(
            key("vocab_size", None) or len(meta.get("tokenizer.ggml.tokens") or [])
        ),
        "max_position_embeddings": int(key("context_length")),
        "tie_word_embeddings": "output.weight" not in present,
    }
    if lower is not None:
        text["linear_lower_bound"] = linear["gate_lower_bound"]
    gating = key("expert_gating_func", None)  # written where the config names one
    if gating is not None:
        text["scoring_func"] = "sigmoid" if gating == 2 else "softmax"
    clamp = key("swiglu_clamp_exp", None)
    if clamp:
        text["swiglu_limit"] = _f32(clamp[0])
    config: Dict[str, Any] = {
        "model_type": ARCHS[meta.arch],
        "architectures": ["Glm5NextForConditionalGeneration"],
        "text_config": text,
        "tie_word_embeddings": text["tie_word_embeddings"],
        "torch_dtype": "float16",
    }
    for name, gguf_key in (
        ("bos_token_id", "bos_token_id"),
        ("eos_token_id", "eos_token_id"),
        ("pad_token_id", "padding_token_id"),  # (else mlx-vlm's, out of range)
    ):
        value = meta.get(f"tokenizer.ggml.{gguf_key}")
        text[name] = None if value is None else int(value)
        if name != "pad_token_id" and value is not None:
            config[name] = text[name]
    return config


def _value(t) -> mx.array:
    """A tensor's float values, whatever its GGUF type."""
    got = read_tensor(t.name, t.data, t.tensor_type)
    return dense_tensor(got, t.name) if len(got) > 1 else next(iter(got.values()))


def _is_mtp(name: str, n: int) -> bool:
    parts = name.split(".")
    return parts[0] == "blk" and parts[1].isdigit() and int(parts[1]) >= n


def _tensors(reader, config: Dict[str, Any], mtp_only=False, bar=None, types=None):
    """The checkpoint's tensors of every GGUF tensor (``mtp_only``: of the
    MTP layers' alone)."""
    text = config["text_config"]
    heads, nope = text["num_attention_heads"], text["qk_nope_head_dim"]
    out: Dict[str, mx.array] = {}
    kv_b: Dict[str, Dict[str, mx.array]] = {}
    if bar is not None:
        total = sum(t.n_bytes for t in reader.tensors)
        task = bar.add_task("GGUF", total=total, done=0, count=len(reader.tensors))
    for i, t in enumerate(reader.tensors):
        if bar is not None:
            bar.update(task, advance=t.n_bytes, done=i + 1)
        if mtp_only and not _is_mtp(t.name, text["num_hidden_layers"]):
            continue
        if t.name in ROOT:
            names = {ROOT[t.name]: _value(t)}
        else:
            parts = t.name.split(".", 2)
            if len(parts) != 3 or parts[0] != "blk" or not parts[1].isdigit():
                raise MTPError(f"tensor {t.name} has no counterpart in glm5_next")
            layer, rest = f"{LM}layers.{parts[1]}.", parts[2]
            if rest in SPLIT_KV_B:
                kv_b.setdefault(layer, {})[rest] = _value(t)
                continue
            if rest in EXPERTS:
                w = _value(t)
                names = {
                    f"{layer}mlp.experts.{e}.{EXPERTS[rest]}.weight": w[e]
                    for e in range(w.shape[0])
                }
            elif rest in BLOCK:
                names = {layer + BLOCK[rest]: _fix(rest, _value(t))}
            else:
                raise MTPError(f"tensor {t.name} has no counterpart in glm5_next")
        out.update(names)
        if types is not None:
            # keyed as the language model's modules (``precision.nearest``)
            types.update(
                {k.replace(LM, "model.", 1): t.tensor_type.name for k in names}
            )
    if bar is not None:
        bar.remove_task(task)
    for layer, parts in kv_b.items():
        if set(parts) != set(SPLIT_KV_B):
            raise MTPError(f"{layer}: attn_k_b without attn_v_b (or the reverse)")
        k_b, v_b = parts["attn_k_b.weight"], parts["attn_v_b.weight"]
        if k_b.shape[0] != heads or k_b.shape[-1] != nope:
            raise MTPError(f"{layer}: attn_k_b is {k_b.shape}, not [heads, rank, nope]")
        joined = mx.concatenate([k_b.swapaxes(1, 2), v_b], axis=1)
        out[f"{layer}self_attn.kv_b_proj.weight"] = joined.reshape(
            -1, joined.shape[-1]
        )
    return out


def _fix(rest: str, w: mx.array) -> mx.array:
    if rest == "ssm_a":  # -exp(A_log), one value per head
        return mx.log(-w.astype(mx.float32)).astype(w.dtype)
    if rest.startswith("ssm_conv1d_"):  # [1, C, 1, K] -> the checkpoint's [C, 1, K]
        return w.reshape(w.shape[1], 1, w.shape[-1])
    return w


def read(path, reader, meta, mtp_reader=None, bar=None, tokenizer=None) -> Source:
    """A glm5-next GGUF (and optionally llama.cpp's separate ``mtp-*.gguf``)."""
    names = [t.name for t in reader.tensors]
    n_mtp = None
    if mtp_reader is not None:
        mtp_meta = type(meta)(mtp_reader)  # gguf_source's Metadata (it imports us)
        if mtp_meta.arch != meta.arch:
            raise MTPError(
                f"the MTP GGUF is {mtp_meta.arch!r}, the model {meta.arch!r}"
            )
        n_mtp = int(mtp_meta.arch_key("nextn_predict_layers", 0) or 0)
        trunk_n = int(meta.arch_key("block_count")) - int(
            meta.arch_key("nextn_predict_layers", 0) or 0
        )
        if not n_mtp:
            raise MTPError(
                "the MTP GGUF holds no MTP layer (no glm5-next.nextn_predict_layers)"
            )
        if int(mtp_meta.arch_key("block_count")) - n_mtp != trunk_n:
            raise MTPError(
                "the MTP GGUF's layers do not follow this model's "
                f"{trunk_n} (llama.cpp's --mtp file of the same checkpoint)"
            )
    config = build_config(meta, names, n_mtp)
    types: Dict[str, str] = {}
    weights = _tensors(reader, config, bar=bar, types=types)
    if mtp_reader is not None:
        # its embedding, final norm and output repeat the model's: its MTP
        # layers alone are taken
        weights.update(_tensors(mtp_reader, config, mtp_only=True, bar=bar))
    return Source(path, config, weights, tokenizer, gguf_types=types)
