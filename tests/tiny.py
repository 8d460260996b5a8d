"""Tiny random models of the real families, saved in their real checkpoint layout.

A builder writes a Hugging Face-style folder (config.json, model.safetensors with
the MTP layer at index ``num_hidden_layers`` or under its family's prefix,
tokenizer files). Weights come from mlx-lm's own classes at random init and
are written back under the checkpoint's names (experts unstacked, MLA
``kv_b_proj`` re-joined), so loading exercises the real sanitize path.

``agreeable=True`` shrinks every block's output projections so the trunk is
close to a bigram model, and wires the head to read the token embedding: the
head then often (not always) agrees with the trunk, which exercises accepted
and rejected drafts alike.
"""

import json
from pathlib import Path
from typing import Dict, Optional

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

VOCAB = 288  # 256 byte tokens + specials, padded
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% endif %}"
)

_MOE = dict(
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_shared_experts=1,
    moe_intermediate_size=32,
    first_k_dense_replace=1,
    moe_layer_freq=1,
    n_group=1,
    topk_group=1,
    norm_topk_prob=True,
    routed_scaling_factor=1.5,
    topk_method="noaux_tc",
    scoring_func="sigmoid",
)
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
    torch_dtype="float32",
    eos_token_id=VOCAB - 1,  # a token the models never favour; tests pick their own stops
)
_MLA = dict(
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    attention_bias=False,
)

CONFIGS: Dict[str, dict] = {
    "deepseek_v3": {**_COMMON, **_MOE, **_MLA, "num_nextn_predict_layers": 1},
    "glm4_moe": {
        **_COMMON,
        **_MOE,
        "head_dim": 16,
        "use_qk_norm": True,
        "partial_rotary_factor": 0.5,
        "attention_bias": True,
        "rope_scaling": None,
        "num_nextn_predict_layers": 1,
    },
    "glm4_moe_lite": {
        **_COMMON,
        **_MOE,
        **_MLA,
        "num_key_value_heads": 4,
        "num_nextn_predict_layers": 1,
    },
    "mimo": {**_COMMON, "num_nextn_predict_layers": 1},
    # DeepSeek-V3.2 / GLM-5: MLA with the sparse-attention indexer; a top-k of 8
    # keys makes the indexer select (not just pass everything) past 8 tokens
    "deepseek_v32": {
        **_COMMON,
        **_MOE,
        **_MLA,
        "num_key_value_heads": 4,
        "index_head_dim": 16,
        "index_n_heads": 2,
        "index_topk": 8,
        "num_nextn_predict_layers": 1,
    },
    "glm_moe_dsa": {
        **_COMMON,
        **_MOE,
        **_MLA,
        "num_key_value_heads": 4,
        "index_head_dim": 16,
        "index_n_heads": 2,
        "index_topk": 8,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "num_nextn_predict_layers": 1,
    },
}
# The tensors the DeepSeek-style layer owns besides its decoder block.
_DEEPSEEK_OWN = ("enorm", "hnorm", "eh_proj", "embed_tokens", "shared_head")
_MIMO_OWN = ("token_layernorm", "hidden_layernorm", "input_proj", "final_layernorm")


def _unsanitize(params: Dict[str, mx.array], config: dict) -> Dict[str, mx.array]:
    """mlx-lm parameter names -> checkpoint names (inverse of the families' sanitize)."""
    out = {}
    for k, v in params.items():
        if ".mlp.switch_mlp." in k:
            pre, post = k.split(".mlp.switch_mlp.")
            for e in range(v.shape[0]):
                out[f"{pre}.mlp.experts.{e}.{post}"] = v[e]
        elif k.endswith("self_attn.embed_q.weight"):
            pre = k[: -len("embed_q.weight")]
            wv = params[pre + "unembed_out.weight"]
            kv_b = mx.concatenate([v.swapaxes(-1, -2), wv], axis=1)
            out[pre + "kv_b_proj.weight"] = kv_b.reshape(-1, kv_b.shape[-1])
        elif k.endswith("self_attn.unembed_out.weight"):
            continue
        else:
            out[k] = v
    return out


def _shrink_outputs(params: Dict[str, mx.array], factor: float) -> None:
    for k in list(params):
        if any(s in k for s in ("o_proj.weight", "down_proj.weight", "unembed_out")):
            params[k] = params[k] * factor


def build_weights(
    model_type: str, seed: int = 0, agreeable: bool = True, **overrides
):
    """Random weights for the trunk and MTP layer, with checkpoint names.

    ``overrides`` change the config (e.g. ``hidden_size`` for a bigger model).
    """
    from mlx_lm.utils import _get_classes

    config = dict(CONFIGS[model_type], model_type=model_type, **overrides)
    mx.random.seed(seed)
    model_class, args_class = _get_classes(config)
    args = args_class.from_dict(config)
    trunk = model_class(args)
    params = dict(tree_flatten(trunk.parameters()))
    backbone = trunk.model
    n = config["num_hidden_layers"]
    block_cls = type(backbone.layers[0])
    block = block_cls(args, n) if model_type != "mimo" else block_cls(args)
    block_params = dict(tree_flatten(block.parameters()))
    if agreeable:
        _shrink_outputs(params, 0.1)
        _shrink_outputs(block_params, 0.1)
    # Token embeddings with a larger norm than the residual noise.
    d = config["hidden_size"]
    params["model.embed_tokens.weight"] = mx.random.normal((config["vocab_size"], d))
    eye = mx.eye(d)
    if model_type == "mimo":
        prefix = "model.mtp_layers.0."
        own = {
            "token_layernorm.weight": mx.ones((d,)),
            "hidden_layernorm.weight": mx.ones((d,)),
            # hidden first, then the token embedding
            "input_proj.weight": mx.concatenate([0.3 * eye, eye], axis=1)
            if agreeable
            else mx.random.normal((d, 2 * d)) * d**-0.5,
            "final_layernorm.weight": mx.ones((d,)),
        }
    else:
        prefix = f"model.layers.{n}."
        own = {
            "enorm.weight": mx.ones((d,)),
            "hnorm.weight": mx.ones((d,)),
            # embedding first, then the hidden state
            "eh_proj.weight": mx.concatenate([eye, 0.3 * eye], axis=1)
            if agreeable
            else mx.random.normal((d, 2 * d)) * d**-0.5,
            "shared_head.norm.weight": mx.ones((d,)),
            "shared_head.head.weight": params["lm_head.weight"],
            "embed_tokens.weight": params["model.embed_tokens.weight"],
        }
    trunk_w = _unsanitize(params, config)
    mtp_w = {prefix + k: v for k, v in own.items()}
    mtp_w.update({prefix + k: v for k, v in _unsanitize(block_params, config).items()})
    return config, trunk_w, mtp_w


def byte_tokenizer(specials=SPECIALS, bos=None, **roles):
    """A byte-level tokenizer: the 256 bytes, then ``specials``; ``<|im_end|>``
    ends a turn, ``bos`` (one of ``specials``) starts every encoding, ``roles``
    name more special tokens (``pad_token=...``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    for s in specials:
        vocab[s] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(specials))
    if bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", special_tokens=[(bos, vocab[bos])]
        )
        roles["bos_token"] = bos
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", **roles
    )


def write_tokenizer(path: Path) -> None:
    fast = byte_tokenizer(pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))


def special_id(name: str) -> int:
    return 256 + SPECIALS.index(name)


def save_folder(
    path: Path,
    config: dict,
    trunk_w: Dict[str, mx.array],
    mtp_w: Optional[Dict[str, mx.array]] = None,
    tokenizer: bool = True,
) -> Path:
    """Write a Hugging Face-style folder; MTP tensors go into model.safetensors."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    weights = {**trunk_w, **(mtp_w or {})}
    mx.save_safetensors(str(path / "model.safetensors"), weights, {"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2))
    if tokenizer:
        write_tokenizer(path)
    return path


def build_folder(
    path: Path, model_type: str, seed: int = 0, agreeable: bool = True, **overrides
):
    """A folder with trunk + MTP layer, and ``<path>-trunk`` without MTP."""
    config, trunk_w, mtp_w = build_weights(model_type, seed, agreeable, **overrides)
    full = save_folder(Path(path), config, trunk_w, mtp_w)
    trunk_only = save_folder(Path(str(path) + "-trunk"), config, trunk_w)
    return full, trunk_only


def random_prompt(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, size=n).tolist()


def write_trained_head(folder: Path, config: dict, draft_vocab=None, seed: int = 0):
    """A DeepSeek-style head for a llama trunk, as ``train-head`` writes it.

    ``mtp.safetensors`` under ``model.layers.{N}.`` and ``mtp_config.json``
    naming the family; ``draft_vocab`` (token ids) adds a draft vocabulary.
    """
    from mlx_lm.models import llama

    mx.random.seed(seed)
    d = config["hidden_size"]
    block = llama.TransformerBlock(llama.ModelArgs.from_dict(config))
    weights = dict(tree_flatten(block.parameters()))
    weights.update(
        {
            "enorm.weight": mx.ones((d,)),
            "hnorm.weight": mx.ones((d,)),
            "eh_proj.weight": mx.random.normal((d, 2 * d)) * d**-0.5,
            "shared_head.norm.weight": mx.ones((d,)),
        }
    )
    if draft_vocab is not None:
        weights["draft_vocab"] = mx.array(list(draft_vocab), dtype=mx.int32)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    pre = f"model.layers.{config['num_hidden_layers']}."
    mx.save_safetensors(
        str(folder / "mtp.safetensors"), {pre + k: v for k, v in weights.items()}
    )
    (folder / "mtp_config.json").write_text(json.dumps({"family": "deepseek"}))
    return folder


# -- the MTP head's state in a cache (``StreamCache.drafts["mtp"]``) ---------------


def head_offset(cache) -> int:
    """Positions the head's first layer has processed."""
    from mlx_mtp.cache import cache_length

    return cache_length(cache.drafts["mtp"].caches)


def pending_hidden(cache):
    """The trunk's hidden states head layer 0 has not read yet."""
    return cache.drafts["mtp"].pending[0].hidden


def pending_tokens(cache):
    return cache.drafts["mtp"].pending[0].tokens


def head_follows(cache, layer_cache) -> bool:
    """Whether head layer 0 has read, or holds pending, every hidden state the
    trunk has made (``DraftState.follows``)."""
    state = cache.drafts["mtp"]
    return state.follows(layer_cache(state.caches, 0), cache.offset)
