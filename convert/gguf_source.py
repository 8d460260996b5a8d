"""GGUF file -> ``Source``: HF-style config, mlx-lm tensor names, tokenizer files.

Tensor names are mapped generally: the target mlx-lm model is built (lazily,
nothing is allocated) for the config the metadata describes, and every one of
its parameter names is put through the ``gguf`` package's own
``TensorNameMap``, which knows the llama.cpp name of each Hugging Face name.
Inverting that gives the mlx-lm name of every GGUF tensor. The MTP ("NextN")
layer is layer ``N = num_hidden_layers`` (``blk.N.nextn.*`` plus an ordinary
block), so building the model with ``N + n_mtp`` layers names it too.

Two llama.cpp conversions are undone: the Q/K row permutation of llama-style
rope, and the +1 added to zero-centred (Gemma) norms.
"""

import json
from pathlib import Path
from typing import Any, Dict, List, Optional

import mlx.core as mx

from mlx_mtp.errors import MTPError
from mlx_mtp.heads import family_for
from mlx_mtp.target import find_backbone

from . import gguf_dsv4, gguf_glm5, gguf_hybrid, gguf_nemotron, gguf_step35
from .gguf_file import GGUFFile
from .model import model_classes
from .quants import read_tensor
from .source import Source

# llama.cpp architecture -> Hugging Face model_type
ARCHS = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma3": "gemma3_text",
    "glm4moe": "glm4_moe",
    "deepseek2": "deepseek_v3",  # deepseek_v2 when its gating is softmax
    "glm-dsa": "glm_moe_dsa",  # GLM-5: deepseek2's MLA plus the DSA indexer
    "step35": "step3p5",  # see gguf_step35
}
# llama.cpp architectures refused: arch -> (family, why) (llama.cpp
# 0c1e57098bba43ac29e6e3b677cdceebdd22334f, conversion/qwen4exp.py)
REFUSED = {
    "qwen4exp": (
        "qwen4_exp (Qwen3.8-Flash-Next)",
        "llama.cpp's converter drops its MTP layer (Qwen4ExpTextModel, no_mtp), "
        "so the GGUF has no head to keep",
    ),
}
# mlx-lm's MLA parameter names -> the HF-style names llama.cpp's tables know
# (llama.cpp splits kv_b_proj exactly as mlx-lm's sanitize does: k_b transposed)
MLX_ALIASES = {
    ".self_attn.embed_q.": ".self_attn.k_b_proj.",
    ".self_attn.unembed_out.": ".self_attn.v_b_proj.",
}
PERMUTED_QK = {"llama"}  # LlamaModel.permute in llama.cpp's convert_hf_to_gguf.py
# llama.cpp stores zero-centred norms with the +1 added (Qwen3-Next/3.5 files:
# see gguf_hybrid)
NORM_PLUS_ONE = {"gemma3"}

# GGUF metadata key (after "{arch}.") -> config key
CONFIG_KEYS = {
    "context_length": "max_position_embeddings",
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "attention.key_length": "head_dim",
    "attention.sliding_window": "sliding_window",
    "rope.freq_base": "rope_theta",
    "vocab_size": "vocab_size",
    "expert_count": "n_routed_experts",
    "expert_used_count": "num_experts_per_tok",
    "expert_shared_count": "n_shared_experts",
    "expert_feed_forward_length": "moe_intermediate_size",
    "leading_dense_block_count": "first_k_dense_replace",
    "expert_weights_scale": "routed_scaling_factor",
    "expert_weights_norm": "norm_topk_prob",
    "expert_group_count": "n_group",
    "expert_group_used_count": "topk_group",
    "nextn_predict_layers": "num_nextn_predict_layers",
}


class Metadata:
    def __init__(self, gguf: GGUFFile):
        self.fields = gguf.fields
        self.arch = self.get("general.architecture")

    def get(self, key: str, default=None):
        return self.fields.get(key, default)

    def arch_key(self, key: str, default=None):
        return self.get(f"{self.arch}.{key}", default)


def open_gguf(path: Path) -> GGUFFile:
    return GGUFFile(path)


def build_config(meta: Metadata, tensor_names: List[str]) -> Dict[str, Any]:
    if meta.arch in REFUSED:
        family, why = REFUSED[meta.arch]
        raise MTPError(
            f"GGUF architecture {meta.arch!r} is {family}: {why}; convert the "
            "Hugging Face checkpoint instead"
        )
    if meta.arch in gguf_glm5.ARCHS:
        return gguf_glm5.build_config(meta, tensor_names)
    if meta.arch in gguf_dsv4.ARCHS:
        return gguf_dsv4.build_config(meta, tensor_names)
    if meta.arch in gguf_hybrid.ARCHS:
        return gguf_hybrid.build_config(meta, tensor_names)
    if meta.arch == "step35":
        return gguf_step35.build_config(meta, tensor_names)
    if meta.arch in gguf_nemotron.ARCHS:
        return gguf_nemotron.build_config(meta, tensor_names)
    if meta.arch == "glm-dsa":
        _own_indexers(meta)
    if meta.arch not in ARCHS:
        supported = ", ".join(
            [
                *ARCHS, *gguf_hybrid.ARCHS, *gguf_nemotron.ARCHS,
                *gguf_glm5.ARCHS, *gguf_dsv4.ARCHS,
            ]  # fmt: skip
        )
        raise MTPError(
            f"unsupported GGUF architecture {meta.arch!r} (supported: {supported})"
        )
    config: Dict[str, Any] = {"model_type": ARCHS[meta.arch]}
    for key, name in CONFIG_KEYS.items():
        value = meta.arch_key(key)
        if value is not None:
            config[name] = value
    n_mtp = int(config.get("num_nextn_predict_layers", 0))
    config["num_hidden_layers"] = int(meta.arch_key("block_count")) - n_mtp
    tokens = meta.get("tokenizer.ggml.tokens")
    if "vocab_size" not in config and tokens is not None:
        config["vocab_size"] = len(tokens)
    config["tie_word_embeddings"] = "output.weight" not in tensor_names
    names = set(tensor_names)
    config["attention_bias"] = "blk.0.attn_q.bias" in names
    config["use_qk_norm"] = "blk.0.attn_q_norm.weight" in names
    rope_dims = meta.arch_key("rope.dimension_count")
    head_dim = (
        config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    )
    config.setdefault("head_dim", head_dim)
    if rope_dims:
        config["partial_rotary_factor"] = rope_dims / head_dim
    scaling = meta.arch_key("rope.scaling.type")
    if scaling and scaling != "none":
        config["rope_scaling"] = {
            "type": scaling,
            "factor": meta.arch_key("rope.scaling.factor", 1.0),
        }
        original = meta.arch_key("rope.scaling.original_context_length")
        if original:
            config["rope_scaling"]["original_max_position_embeddings"] = original
    if meta.arch == "gemma3":
        config["query_pre_attn_scalar"] = head_dim
        config["rope_local_base_freq"] = meta.arch_key("rope.freq_base_swa", 10000.0)
        pattern = meta.arch_key("attention.sliding_window_pattern", 6)
        if isinstance(pattern, list):  # one flag per layer, the global layers False
            pattern = pattern.index(False) + 1 if False in pattern else len(pattern)
        config["sliding_window_pattern"] = int(pattern)
    if meta.arch in ("deepseek2", "glm-dsa"):
        _mla_config(meta, config)
    if meta.arch == "glm-dsa":
        _dsa_config(meta, config)
    if "n_routed_experts" in config:
        gating = meta.arch_key("expert_gating_func", 2)
        config["scoring_func"] = "sigmoid" if gating == 2 else "softmax"
        if any(n.endswith("exp_probs_b.bias") for n in names):
            config["topk_method"] = "noaux_tc"
        config.setdefault("n_group", 1)
        config.setdefault("topk_group", 1)
        config.setdefault("rope_scaling", None)
    for key, name in (
        ("bos_token_id", "bos_token_id"),
        ("eos_token_id", "eos_token_id"),
    ):
        value = meta.get(f"tokenizer.ggml.{key}")
        if value is not None:
            config[name] = int(value)
    config["torch_dtype"] = "float16"
    return config


def _own_indexers(meta: Metadata) -> None:
    """A glm-dsa file whose config lists ``indexer_types`` carries them as
    ``attention.indexer.types`` (True: the layer's own indexer; llama.cpp
    ``GlmMoeDsaModel.set_gguf_parameters``); a layer that shares one is
    refused."""
    kinds = meta.arch_key("attention.indexer.types")
    if isinstance(kinds, list) and not all(kinds):
        shared = [i for i, own in enumerate(kinds) if not own]
        raise MTPError(
            f"a glm-dsa GGUF whose layers {shared[:4]}{'...' if len(shared) > 4 else ''} "
            "share another layer's indexer (attention.indexer.types): mlx-lm "
            "0.32's glm_moe_dsa gives every layer its own, so it cannot run it"
        )


def _dsa_config(meta: Metadata, config: Dict[str, Any]) -> None:
    """GLM-5 (llama.cpp ``conversion/glm.py``, ``GlmMoeDsaModel``: DeepSeek-V2's
    conversion plus the indexer's head count, key length and top-k)."""
    config.update(
        model_type="glm_moe_dsa",  # sigmoid routing, whatever _mla_config guessed
        index_n_heads=meta.arch_key("attention.indexer.head_count"),
        index_head_dim=meta.arch_key("attention.indexer.key_length"),
        index_topk=meta.arch_key("attention.indexer.top_k"),
        moe_layer_freq=1,
        rope_parameters={"rope_type": "default", "rope_theta": config["rope_theta"]},
    )
    if config.get("rope_scaling"):
        config["rope_parameters"].update(config.pop("rope_scaling"))
        config["rope_parameters"]["rope_type"] = config["rope_parameters"].pop("type")


def _mla_config(meta: Metadata, config: Dict[str, Any]) -> None:
    """DeepSeek-V2/V3 attention. llama.cpp runs MLA as MQA: ``head_count_kv`` 1 and
    ``key_length`` the latent width; the per-head sizes sit in ``*_mla`` keys
    (older files: in ``key_length``/``value_length`` themselves)."""
    rope = int(meta.arch_key("rope.dimension_count"))
    key = meta.arch_key(
        "attention.key_length_mla", meta.arch_key("attention.key_length")
    )
    value = meta.arch_key(
        "attention.value_length_mla", meta.arch_key("attention.value_length")
    )
    config.update(
        num_key_value_heads=config["num_attention_heads"],
        qk_rope_head_dim=rope,
        qk_nope_head_dim=int(key) - rope,
        v_head_dim=int(value),
        kv_lora_rank=meta.arch_key("attention.kv_lora_rank"),
        q_lora_rank=meta.arch_key("attention.q_lora_rank"),
    )
    for k in ("head_dim", "partial_rotary_factor", "use_qk_norm"):
        config.pop(k, None)
    if meta.arch_key("expert_gating_func", 1) != 2:  # softmax routing: DeepSeek-V2
        config["model_type"] = "deepseek_v2"
    if (config.get("rope_scaling") or {}).get("type") == "yarn":
        # llama.cpp stores 0.1 * mscale_all_dim; V2/V3 set mscale to the same
        mscale = float(meta.arch_key("rope.scaling.yarn_log_multiplier", 0.1)) / 0.1
        config["rope_scaling"].update(mscale=mscale, mscale_all_dim=mscale)


def _name_variants(name: str):
    """(base, suffix) pairs under which ``TensorNameMap`` may know an mlx-lm name."""
    aliased = name.replace(".switch_mlp.", ".experts.")
    for mlx_name, hf_name in MLX_ALIASES.items():
        aliased = aliased.replace(mlx_name, hf_name)
    for hf in dict.fromkeys([name, aliased]):
        base, _, last = hf.rpartition(".")
        if "_" in last:  # e.g. gate.e_score_correction_bias -> exp_probs_b.bias
            stem, _, tail = last.rpartition("_")
            yield f"{base}.{stem}", "." + tail
        yield base, "." + last


def _candidate_names(config: Dict[str, Any]) -> List[str]:
    """mlx-lm parameter names of the trunk and of the MTP layers the config declares."""
    from mlx.utils import tree_flatten

    n_mtp = int(config.get("num_nextn_predict_layers", 0))
    wide = dict(config, num_hidden_layers=config["num_hidden_layers"] + n_mtp)
    model_class, args_class = model_classes(wide)
    model = model_class(args_class.from_dict(wide))  # lazy: nothing is computed
    names = [k for k, _ in tree_flatten(model.parameters())]
    family = family_for(config)
    if family is not None and n_mtp:
        backbone = find_backbone(model)
        args = getattr(model, "args", None)
        for j in range(n_mtp):
            prefix = family.prefix(config, j)
            everything = {
                f"{prefix}embed_tokens.weight": 0,
                f"{prefix}shared_head.head.weight": 0,
                f"{prefix}shared_head.output.weight": 0,  # Step-3.5's name
            }
            head = family.build(args, config, backbone, everything)
            layer = head.layer(min(j, head.num_layers - 1))
            own = [
                k
                for k, _ in tree_flatten(layer.parameters())
                if not k.startswith("block.")
            ]
            names += [prefix + k for k in own]
    return names


def name_map(arch: str, config: Dict[str, Any]) -> Dict[str, str]:
    """GGUF tensor name -> mlx-lm parameter name."""
    import gguf

    arch_enum = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)
    if arch in gguf_hybrid.ARCHS:
        return _hybrid_name_map(arch, arch_enum, config)
    if arch in gguf_nemotron.ARCHS:
        n_mtp = config.get("num_nextn_predict_layers", 0)
        tmap = gguf.TensorNameMap(arch_enum, config["num_hidden_layers"] + n_mtp)
        trunk = _candidate_names(dict(config, num_nextn_predict_layers=0))
        return gguf_nemotron.name_map(config, tmap, trunk, _name_variants)
    n_blocks = config["num_hidden_layers"] + int(
        config.get("num_nextn_predict_layers", 0)
    )
    tmap = gguf.TensorNameMap(arch_enum, n_blocks)
    nextn = _nextn_names(n_blocks)
    if arch == "step35":
        names = _candidate_names(config)
        return gguf_step35.name_map(config, tmap, nextn, names, _name_variants)
    out = {}
    for name in _candidate_names(config):
        for base, suffix in _name_variants(name):
            found = tmap.get_name(base) or nextn.get(base)
            if found is not None:
                out.setdefault(found + suffix, name)
                break
        if name.endswith(".self_attn.embed_q.weight"):  # older files: kv_b unsplit
            kv_b = name.replace("embed_q", "kv_b_proj")
            found = tmap.get_name(kv_b[: -len(".weight")])
            if found is not None:
                out.setdefault(found + ".weight", kv_b)
    return out


def _hybrid_name_map(arch: str, arch_enum, config: Dict[str, Any]) -> Dict[str, str]:
    import gguf
    from mlx.utils import tree_flatten

    model_class, args_class = model_classes(config)
    model = model_class(args_class.from_dict(config))  # lazy: nothing is computed
    names = [k for k, _ in tree_flatten(model.parameters())]
    cfg = gguf_hybrid.text(config)
    n_blocks = cfg["num_hidden_layers"] + int(
        cfg.get("mtp_num_hidden_layers", cfg.get("num_nextn_predict_layers", 0))
    )
    tmap = gguf.TensorNameMap(arch_enum, n_blocks)
    return gguf_hybrid.name_map(arch, config, tmap, names, _name_variants)


def _nextn_names(n_blocks: int) -> Dict[str, str]:
    """HF name -> GGUF name of the NextN (MTP) tensors, from gguf's own tables.

    They are listed only for the architectures llama.cpp runs MTP on; a
    checkpoint of another one that carries them uses the same names.
    """
    import gguf

    out = {}
    for kind, patterns in gguf.TensorNameMap.block_mappings_cfg.items():
        if not kind.name.startswith("NEXTN_"):
            continue
        for bid in range(n_blocks):
            for pattern in patterns:
                out[pattern.format(bid=bid)] = gguf.TENSOR_NAMES[kind].format(bid=bid)
    return out


def _unpermute(w: mx.array, n_head: int) -> mx.array:
    """Undo llama.cpp's ``permute``: rows per head go back from interleaved to halves."""
    shape = w.shape
    return (
        w.reshape(n_head, shape[0] // n_head // 2, 2, *shape[1:])
        .swapaxes(1, 2)
        .reshape(shape)
    )


def _fix(arch: str, config: Dict[str, Any], name: str, tensors: Dict[str, mx.array]):
    if arch in gguf_hybrid.ARCHS:
        return gguf_hybrid.fix(arch, config, name, tensors)
    if arch == "step35":
        return gguf_step35.fix(config, name, tensors)
    if arch in gguf_nemotron.ARCHS:
        return gguf_nemotron.fix(config, name, tensors)
    if arch in PERMUTED_QK:
        heads = None
        if name.endswith("self_attn.q_proj.weight"):
            heads = config["num_attention_heads"]
        elif name.endswith("self_attn.k_proj.weight"):
            heads = config.get("num_key_value_heads") or config["num_attention_heads"]
        if heads is not None:  # rows only: packed weights, scales and biases alike
            tensors = {k: _unpermute(v, heads) for k, v in tensors.items()}
    if (
        arch in NORM_PLUS_ONE
        and name.endswith("norm.weight")
        and "linear_attn" not in name
    ):
        tensors = {k: v - 1 for k, v in tensors.items()}
    return tensors


def _read_tensors(reader, arch, config, names, bar=None, types=None):
    """mlx-lm-named arrays of every tensor; ``bar`` (rich) advances by tensor and bytes.

    ``types`` (a dict) receives each array's GGUF type name.
    """
    weights: Dict[str, mx.array] = {}
    if bar is not None:
        total = sum(t.n_bytes for t in reader.tensors)
        task = bar.add_task("GGUF", total=total, done=0, count=len(reader.tensors))
    for i, t in enumerate(reader.tensors):
        target = names.get(t.name)
        if target is None:
            model_type = config["model_type"]
            raise MTPError(
                f"tensor {t.name} has no counterpart in mlx-lm's {model_type}"
            )
        got = _fix(arch, config, target, read_tensor(target, t.data, t.tensor_type))
        weights.update(got)
        if types is not None:
            types.update(dict.fromkeys(got, t.tensor_type.name))
        if bar is not None:
            bar.update(task, advance=t.n_bytes, done=i + 1)
    if bar is not None:
        bar.remove_task(task)
    return weights


def read_gguf(path: Path, mtp_gguf: Optional[Path] = None, bar=None) -> Source:
    """Read a GGUF file (and optionally a separate MTP GGUF of the same model)."""
    reader = open_gguf(path)
    meta = Metadata(reader)
    names_in_file = [t.name for t in reader.tensors]
    if any(n == "rope_freqs.weight" for n in names_in_file):
        raise MTPError(
            f"{path}: llama3-style rope scaling (rope_freqs) is not supported"
        )
    config = build_config(meta, names_in_file)
    if meta.get("tokenizer.ggml.tokens") is None:
        raise MTPError(f"{path}: no tokenizer in its metadata (tokenizer.ggml.tokens)")
    if meta.arch in gguf_dsv4.ARCHS and mtp_gguf is None:
        mtp_gguf = gguf_dsv4.mtp_sibling(path)  # as llama.cpp's downloader pairs them
    mtp_reader = None
    if mtp_gguf is not None:
        mtp_reader = open_gguf(mtp_gguf)
    if meta.arch in gguf_dsv4.ARCHS:  # read under the checkpoint's own names
        writer = gguf_tokenizer_writer(path, reader.fields)
        return gguf_dsv4.read(path, reader, meta, mtp_reader, bar, writer)
    if meta.arch in gguf_glm5.ARCHS:  # read under the checkpoint's own names
        writer = gguf_tokenizer_writer(path, reader.fields)
        return gguf_glm5.read(path, reader, meta, mtp_reader, bar, writer)
    if mtp_reader is not None:
        mtp_meta = Metadata(mtp_reader)
        n = int(mtp_meta.arch_key("nextn_predict_layers") or 1)
        if "text_config" in config:  # Qwen3.5's key
            config["text_config"]["mtp_num_hidden_layers"] = n
        else:
            config["num_nextn_predict_layers"] = n
    names = name_map(meta.arch, config)
    types: Dict[str, str] = {}
    weights = _read_tensors(reader, meta.arch, config, names, bar, types)
    if mtp_reader is not None:
        weights.update(_read_tensors(mtp_reader, meta.arch, config, names, bar, types))
    weights = gguf_hybrid.finish(meta.arch, config, weights)
    writer = gguf_tokenizer_writer(path, reader.fields)
    return Source(path, config, weights, writer, gguf_types=types)


# GGUF special-token ids -> the tokenizer_config names transformers uses
_SPECIAL_TOKENS = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unknown_token_id",
    "pad_token": "padding_token_id",
}


def _gguf_tokenizer_builders():
    """transformers' GGUF tokenizer tables and builder, where its version keeps them.

    transformers 5.18 moved them from ``integrations.ggml`` (5.7-5.17, the
    versions mlx-lm 0.32 also accepts) to ``integrations.gguf``.
    """
    try:
        from transformers.integrations.gguf import gguf_tokenizer_mapping as m
    except ImportError:
        from transformers.integrations import ggml as m
    return m.GGUF_TOKENIZER_MAPPING, m.convert_gguf_tokenizer


def gguf_tokenizer_writer(path: Path, fields: Dict[str, Any]):
    """Write tokenizer files built from the GGUF's tokenizer metadata.

    transformers' own GGUF reader imports torch, so the metadata comes from our
    reader and only transformers' tokenizer builders are used.
    """

    def write(out: Path) -> None:
        from transformers import PreTrainedTokenizerFast

        GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer = _gguf_tokenizer_builders()
        grouped = {
            group: {
                name: fields[f"tokenizer.{key}"]
                for key, name in renames.items()
                if f"tokenizer.{key}" in fields
            }
            for group, renames in GGUF_TOKENIZER_MAPPING.items()
        }
        tokens, config = grouped["tokenizer"], grouped["tokenizer_config"]
        if tokens.get("tokenizer_type") == "llama":
            config.setdefault("add_bos_token", True)  # as llama.cpp does
        for name, key in _SPECIAL_TOKENS.items():
            token_id = fields.get(f"tokenizer.ggml.{key}")
            config[name] = None if token_id is None else tokens["tokens"][token_id]
        try:
            backend, extra = convert_gguf_tokenizer(
                fields["general.architecture"], tokens
            )
            tok = PreTrainedTokenizerFast(tokenizer_object=backend, **config, **extra)
        except Exception as e:
            text = (str(e).strip() or type(e).__name__).splitlines()[0]
            raise MTPError(f"{path}: cannot build its tokenizer ({text})") from None
        tok.save_pretrained(str(out))
        _drop_loader_keys(out / "tokenizer_config.json")

    return write


def _drop_loader_keys(path: Path) -> None:
    """Keys transformers records about how it was loaded, not about the tokenizer."""
    config = json.loads(path.read_text())
    for key in ("is_local", "local_files_only", "name_or_path"):
        config.pop(key, None)
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
