"""DeepSeek-V4-Flash GGUF files (llama.cpp arch ``deepseek4``) with their MTP layer.

What llama.cpp's converter writes (``conversion/deepseek.py``,
``DeepseekV4Model``, at llama.cpp 0c1e57098bba43ac29e6e3b677cdceebdd22334f,
vendored by llama-cpp-python 0.3.36; tensor names from its
``gguf-py/gguf/constants.py``, the loader's expectations from
``src/models/deepseek4.cpp``), undone here back to DeepSeek's own checkpoint
names and shapes (``embed``, ``layers.{i}.attn.wq_a``, ``mtp.0.e_proj`` ...),
so that a GGUF takes the checkpoint's convert path (mlx-vlm's sanitize, the
family's MTP split and precision):

- the model file never holds the MTP layer (``filter_tensors`` skips
  ``mtp.*`` unless ``--mtp``); ``--mtp`` writes it alone into
  ``mtp-{name}.gguf`` (llama.cpp's downloader takes the ``mtp-`` sibling of
  a model file): ``blk.{N}`` (``block_count`` N + 1,
  ``nextn_predict_layers`` 1), a trunk-shaped block plus
  ``nextn.{eh_proj, enorm, hnorm, shared_head_norm}``, the head's own
  ``hc_head_*`` as the root ``output_hc_*`` and copies of the trunk's
  embedding, final norm and ``head``;
- ``eh_proj`` is ``torch.cat((e_proj, h_proj), dim=1)`` (the input axis:
  llama.cpp concatenates ``enorm(embed)`` first), forced to Q8_0;
- routed experts are stacked per layer (``ffn_{gate,down,up}_exps`` from
  ``w1``/``w2``/``w3``) and repacked, losslessly, from the checkpoint's FP4
  to MXFP4; FP8 matrices are dequantized and written Q8_0, the rest at the
  checkpoint's BF16/F32; ``tid2eid`` as I32; a hash layer's unused
  ``ffn.gate.bias`` is dropped; every other tensor keeps its checkpoint
  shape (``wo_a`` 2-D), the suffix-less ones (``hc_*``, ``attn_sink``,
  ``ape``) gaining ``.weight``.

Quantized tensors are read as floats (Q8_0 and MXFP4 hold exact float32
values); a quantized file's widths then come back through
``precision.nearest``. Not recorded in the file, so left at the config's
defaults (as the published config sets them): ``topk_method`` and the HISA
indexer block sizes.
"""

import re
from pathlib import Path
from typing import Any, Dict, List, Optional

import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType, quants

from mlx_mtp.errors import MTPError

from .quants import FLOATS, read_tensor
from .source import Source

ARCHS = {"deepseek4": "deepseek_v4"}
ROOT = {
    "token_embd.weight": "embed.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "head.weight",
    "output_hc_fn.weight": "hc_head_fn",
    "output_hc_base.weight": "hc_head_base",
    "output_hc_scale.weight": "hc_head_scale",
}
# a block's GGUF name -> the checkpoint's name in its layer
BLOCK = {
    "attn_norm.weight": "attn_norm.weight",
    "ffn_norm.weight": "ffn_norm.weight",
    "attn_sinks.weight": "attn.attn_sink",
    "attn_q_a.weight": "attn.wq_a.weight",
    "attn_q_b.weight": "attn.wq_b.weight",
    "attn_q_a_norm.weight": "attn.q_norm.weight",
    "attn_kv.weight": "attn.wkv.weight",
    "attn_kv_a_norm.weight": "attn.kv_norm.weight",
    "attn_output_a.weight": "attn.wo_a.weight",
    "attn_output_b.weight": "attn.wo_b.weight",
    "attn_compressor_ape.weight": "attn.compressor.ape",
    "attn_compressor_kv.weight": "attn.compressor.wkv.weight",
    "attn_compressor_gate.weight": "attn.compressor.wgate.weight",
    "attn_compressor_norm.weight": "attn.compressor.norm.weight",
    "indexer.attn_q_b.weight": "attn.indexer.wq_b.weight",
    "indexer.proj.weight": "attn.indexer.weights_proj.weight",
    "indexer_compressor_ape.weight": "attn.indexer.compressor.ape",
    "indexer_compressor_kv.weight": "attn.indexer.compressor.wkv.weight",
    "indexer_compressor_gate.weight": "attn.indexer.compressor.wgate.weight",
    "indexer_compressor_norm.weight": "attn.indexer.compressor.norm.weight",
    "ffn_gate_inp.weight": "ffn.gate.weight",
    "exp_probs_b.bias": "ffn.gate.bias",
    "exp_probs_b_vl.bias": "ffn.gate.bias_vl",
    "ffn_gate_tid2eid.weight": "ffn.gate.tid2eid",
    "ffn_gate_shexp.weight": "ffn.shared_experts.w1.weight",
    "ffn_down_shexp.weight": "ffn.shared_experts.w2.weight",
    "ffn_up_shexp.weight": "ffn.shared_experts.w3.weight",
}
for _site in ("attn", "ffn"):
    for _part in ("fn", "base", "scale"):
        BLOCK[f"hc_{_site}_{_part}.weight"] = f"hc_{_site}_{_part}"
EXPERTS = {"ffn_gate_exps.weight": "w1", "ffn_down_exps.weight": "w2"}
EXPERTS["ffn_up_exps.weight"] = "w3"
# the MTP layer's own (its final norm is the checkpoint's ``mtp.0.norm``)
NEXTN = {
    "nextn.enorm.weight": "enorm.weight",
    "nextn.hnorm.weight": "hnorm.weight",
    "nextn.shared_head_norm.weight": "norm.weight",
}
EH_PROJ = "nextn.eh_proj.weight"  # e_proj | h_proj along the input axis
# llama.cpp's downloader pairs a model file with the ``mtp-`` file beside it
MTP_PREFIX = "mtp-"
GATING = {1: "softmax", 2: "sigmoid", 4: "sqrtsoftplus"}  # ExpertGatingFuncType
_NEEDED = object()


def _f32(value) -> float:
    """A float32 metadata value as the config wrote it (1e-06, not 9.99e-07)."""
    return float(str(np.float32(value)))


def _keys(meta, where: str):
    def key(name: str, default=_NEEDED):
        value = meta.arch_key(name)
        if value is not None:
            return value
        if default is _NEEDED:
            raise MTPError(f"a deepseek4 GGUF without {meta.arch}.{name} ({where})")
        return default

    return key


def build_config(meta, names: List[str], n_mtp: int = 0) -> Dict[str, Any]:
    """The checkpoint's ``config.json`` from the model file's metadata."""
    key = _keys(meta, "the model file")
    n = int(key("block_count")) - int(key("nextn_predict_layers", 0) or 0)
    config: Dict[str, Any] = {
        "model_type": ARCHS[meta.arch],
        "architectures": ["DeepseekV4ForCausalLM"],
        "vocab_size": int(
            key("vocab_size", None) or len(meta.get("tokenizer.ggml.tokens") or [])
        ),
        "hidden_size": int(key("embedding_length")),
        "num_hidden_layers": n,
        "num_attention_heads": int(key("attention.head_count")),
        "num_key_value_heads": int(key("attention.head_count_kv", 1)),
        "head_dim": int(key("attention.key_length")),
        "qk_rope_head_dim": int(key("rope.dimension_count")),
        "q_lora_rank": int(key("attention.q_lora_rank")),
        "o_groups": int(key("attention.output_group_count")),
        "o_lora_rank": int(key("attention.output_lora_rank")),
        "n_routed_experts": int(key("expert_count")),
        "n_shared_experts": int(key("expert_shared_count")),
        "num_experts_per_tok": int(key("expert_used_count")),
        "moe_intermediate_size": int(key("expert_feed_forward_length")),
        "routed_scaling_factor": _f32(key("expert_weights_scale")),
        "norm_topk_prob": bool(key("expert_weights_norm")),
        "num_hash_layers": int(key("hash_layer_count")),
        "compress_ratios": [int(r) for r in key("attention.compress_ratios")],
        "compress_rope_theta": _f32(key("attention.compress_rope_freq_base")),
        "hc_mult": int(key("hyper_connection.count")),
        "hc_sinkhorn_iters": int(key("hyper_connection.sinkhorn_iterations")),
        "hc_eps": _f32(key("hyper_connection.epsilon")),
        "sliding_window": int(key("attention.sliding_window")),
        "index_n_heads": int(key("attention.indexer.head_count")),
        "index_head_dim": int(key("attention.indexer.key_length")),
        "index_topk": int(key("attention.indexer.top_k")),
        "num_nextn_predict_layers": n_mtp,
        "rms_norm_eps": _f32(key("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(key("context_length")),
        "tie_word_embeddings": "output.weight" not in set(names),
        "torch_dtype": "float16",
    }
    if len(config["compress_ratios"]) < n:
        raise MTPError(
            f"a deepseek4 GGUF with {len(config['compress_ratios'])} compress "
            f"ratios for {n} layers"
        )
    clamp = key("swiglu_clamp_exp")
    config["swiglu_limit"] = _f32(clamp[0] if isinstance(clamp, list) else clamp)
    # written only where the checkpoint's config has them
    for name, gguf_key in (
        ("intermediate_size", "feed_forward_length"),
        ("n_group", "expert_group_count"),
        ("topk_group", "expert_group_used_count"),
    ):
        value = key(gguf_key, None)
        if value is not None:
            config[name] = int(value)
    theta = key("rope.freq_base", None)
    if theta is not None:
        config["rope_theta"] = _f32(theta)
    gating = key("expert_gating_func", None)
    if gating is not None:
        if int(gating) not in GATING:
            raise MTPError(f"a deepseek4 GGUF with expert gating {gating}")
        config["scoring_func"] = GATING[int(gating)]
    scaling = key("rope.scaling.type", None)
    if scaling == "yarn":
        rope = {"type": "yarn", "factor": _f32(key("rope.scaling.factor"))}
        original = key("rope.scaling.original_context_length")
        rope["original_max_position_embeddings"] = int(original)
        for name, gguf_key in (
            ("beta_fast", "rope.scaling.yarn_beta_fast"),
            ("beta_slow", "rope.scaling.yarn_beta_slow"),
            ("extrapolation_factor", "rope.scaling.yarn_ext_factor"),
            ("attention_factor", "rope.scaling.yarn_attn_factor"),
        ):
            value = key(gguf_key, None)
            if value is not None:
                rope[name] = _f32(value)
        config["rope_scaling"] = rope
    elif scaling not in (None, "none"):
        raise MTPError(f"a deepseek4 GGUF with {scaling!r} rope scaling (yarn expected)")
    for name, gguf_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id")):
        value = meta.get(f"tokenizer.ggml.{gguf_key}")
        if value is not None:
            config[name] = int(value)
    return config


def _value(t) -> mx.array:
    """A tensor's value: floats whatever its GGUF type, I32 as int32."""
    if t.tensor_type == GGMLQuantizationType.I32:
        return mx.array(np.ascontiguousarray(t.data).view(np.int32))
    if t.tensor_type in FLOATS:
        return read_tensor(t.name, t.data, t.tensor_type)[t.name]
    try:  # float32 products of the blocks' scales and codes: exact for Q8_0, MXFP4
        values = quants.dequantize(np.asarray(t.data), t.tensor_type)
    except (NotImplementedError, ValueError, KeyError) as e:
        raise MTPError(
            f"{t.name}: unsupported quantization type {t.tensor_type.name} ({e})"
        ) from None
    return mx.array(values.astype(np.float32))


def saved_name(name: str) -> str:
    """A trunk tensor's checkpoint name -> the name mlx-vlm's sanitize gives it
    (what ``precision.nearest`` is keyed by)."""
    if name == "embed.weight":
        return "model.embed_tokens.weight"
    if name == "head.weight":
        return "lm_head.weight"
    m = re.fullmatch(r"layers\.(\d+)\.ffn\.experts\.\d+\.(w[123])\.weight", name)
    proj = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
    if m:
        return f"model.layers.{m.group(1)}.ffn.switch_mlp.{proj[m.group(2)]}.weight"
    for w, p in proj.items():
        name = name.replace(f".shared_experts.{w}.", f".shared_experts.{p}.")
    return "model." + name if name.startswith("layers.") else name


def _block(t, rest: str, layer: str) -> Dict[str, mx.array]:
    if rest in BLOCK:
        return {layer + BLOCK[rest]: _value(t)}
    if rest in EXPERTS:
        w = _value(t)
        if w.ndim != 3:
            raise MTPError(f"tensor {t.name} is {w.shape}, not [experts, rows, cols]")
        w_name = EXPERTS[rest]
        return {
            f"{layer}ffn.experts.{e}.{w_name}.weight": w[e] for e in range(w.shape[0])
        }
    raise MTPError(f"tensor {t.name} has no counterpart in deepseek_v4")


def _trunk(reader, config: Dict[str, Any], bar=None, types=None):
    """The checkpoint's trunk tensors of every tensor of the model file."""
    n = config["num_hidden_layers"]
    out: Dict[str, mx.array] = {}
    if bar is not None:
        total = sum(t.n_bytes for t in reader.tensors)
        task = bar.add_task("GGUF", total=total, done=0, count=len(reader.tensors))
    for i, t in enumerate(reader.tensors):
        if bar is not None:
            bar.update(task, advance=t.n_bytes, done=i + 1)
        if t.name in ROOT:
            names = {ROOT[t.name]: _value(t)}
        else:
            parts = t.name.split(".", 2)
            if len(parts) != 3 or parts[0] != "blk" or not parts[1].isdigit():
                raise MTPError(f"tensor {t.name} has no counterpart in deepseek_v4")
            if int(parts[1]) >= n:
                raise MTPError(
                    f"tensor {t.name}: block {parts[1]} of a model file of {n} "
                    "(llama.cpp writes the MTP layer only into its mtp-*.gguf)"
                )
            names = _block(t, parts[2], f"layers.{parts[1]}.")
        out.update(names)
        if types is not None:
            types.update({saved_name(k): t.tensor_type.name for k in names})
    if bar is not None:
        bar.remove_task(task)
    return out


def _mtp(reader, config: Dict[str, Any], bar=None) -> Dict[str, mx.array]:
    """The checkpoint's ``mtp.0.*`` of llama.cpp's ``--mtp`` file; its copies of
    the trunk's embedding, final norm and ``head`` are checked, not taken."""
    n, hidden = config["num_hidden_layers"], config["hidden_size"]
    prefix = "mtp.0."
    out: Dict[str, mx.array] = {}
    seen = set()
    for t in reader.tensors:
        if t.name.startswith("output_hc_"):
            out[prefix + ROOT[t.name]] = _value(t)
            continue
        if t.name in ROOT:
            continue  # the trunk's, repeated
        parts = t.name.split(".", 2)
        if len(parts) != 3 or parts[0] != "blk" or parts[1] != str(n):
            raise MTPError(
                f"tensor {t.name} of the MTP GGUF is not its layer blk.{n} "
                "(llama.cpp's --mtp file of this model)"
            )
        rest = parts[2]
        seen.add(rest)
        if rest == EH_PROJ:
            w = _value(t)
            if w.shape != (hidden, 2 * hidden):
                raise MTPError(
                    f"tensor {t.name} is {tuple(w.shape)}, not "
                    f"[{hidden}, {2 * hidden}] (e_proj and h_proj side by side)"
                )
            out[prefix + "e_proj.weight"] = w[:, :hidden]
            out[prefix + "h_proj.weight"] = w[:, hidden:]
        elif rest in NEXTN:
            out[prefix + NEXTN[rest]] = _value(t)
        else:
            out.update(_block(t, rest, prefix))
    missing = [k for k in (EH_PROJ, *NEXTN) if k not in seen]
    if missing:
        raise MTPError(f"the MTP GGUF has no blk.{n}.{missing[0]}")
    return out


def _check_pair(meta, mtp_meta, reader, mtp_reader) -> int:
    """The number of MTP layers of ``mtp_meta``'s file, checked to be this
    model's ``--mtp`` file."""
    if mtp_meta.arch != meta.arch:
        raise MTPError(f"the MTP GGUF is {mtp_meta.arch!r}, the model {meta.arch!r}")
    n_mtp = int(mtp_meta.arch_key("nextn_predict_layers", 0) or 0)
    if not n_mtp:
        raise MTPError(
            "the MTP GGUF holds no MTP layer (no deepseek4.nextn_predict_layers: "
            "give llama.cpp's mtp-*.gguf, written with convert_hf_to_gguf.py --mtp)"
        )
    if n_mtp != 1:
        raise MTPError(f"a deepseek4 MTP GGUF of {n_mtp} layers (llama.cpp writes 1)")
    trunk_n = int(meta.arch_key("block_count")) - int(
        meta.arch_key("nextn_predict_layers", 0) or 0
    )
    if int(mtp_meta.arch_key("block_count")) - n_mtp != trunk_n:
        raise MTPError(
            f"the MTP GGUF's layer follows {mtp_meta.arch_key('block_count') - n_mtp} "
            f"layers, this model has {trunk_n} (llama.cpp's --mtp file of the same "
            "checkpoint)"
        )
    for k in (
        "embedding_length", "attention.head_count", "hyper_connection.count",
        "expert_count", "vocab_size",
    ):  # fmt: skip
        if meta.arch_key(k) != mtp_meta.arch_key(k):
            raise MTPError(
                f"the MTP GGUF's {k} is {mtp_meta.arch_key(k)}, the model's "
                f"{meta.arch_key(k)}: not the same checkpoint"
            )
    shapes = {t.name: t.shape for t in reader.tensors}
    for t in mtp_reader.tensors:
        if t.name in shapes and t.name in ROOT and shapes[t.name] != t.shape:
            raise MTPError(
                f"the MTP GGUF's {t.name} is {list(t.shape)}, the model's "
                f"{list(shapes[t.name])}: not the same checkpoint"
            )
    return n_mtp


def is_mtp_file(path: Path) -> bool:
    return MTP_PREFIX in path.name


def mtp_sibling(path: Path) -> Optional[Path]:
    """llama.cpp's ``mtp-`` file beside ``path``: ``mtp-{name}``, else the only
    ``mtp-*.gguf`` there."""
    path = Path(path)
    exact = path.with_name(MTP_PREFIX + path.name)
    if exact.is_file():
        return exact
    found = sorted(path.parent.glob(f"*{MTP_PREFIX}*.gguf"))
    return found[0] if len(found) == 1 else None


def read(path, reader, meta, mtp_reader=None, bar=None, tokenizer=None) -> Source:
    """A deepseek4 model GGUF and llama.cpp's separate ``mtp-*.gguf``."""
    names = [t.name for t in reader.tensors]
    if int(meta.arch_key("nextn_predict_layers", 0) or 0):
        raise MTPError(
            f"{path}: a deepseek4 GGUF holding only the MTP layer (llama.cpp's "
            "--mtp file): give the model file, and this one with --mtp-gguf"
        )
    if mtp_reader is None:
        raise MTPError(
            f"{path}: a deepseek4 GGUF has no MTP layer of its own (llama.cpp "
            "writes it into a separate mtp-*.gguf, convert_hf_to_gguf.py --mtp): "
            "give it with --mtp-gguf FILE, or put it beside the model file"
        )
    mtp_meta = type(meta)(mtp_reader)  # gguf_source's Metadata (it imports us)
    n_mtp = _check_pair(meta, mtp_meta, reader, mtp_reader)
    config = build_config(meta, names, n_mtp)
    types: Dict[str, str] = {}
    weights = _trunk(reader, config, bar=bar, types=types)
    weights.update(_mtp(mtp_reader, config, bar=bar))
    return Source(path, config, weights, tokenizer, gguf_types=types)
