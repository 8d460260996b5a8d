"""A tiny random Gemma 4 (mlx-lm's ``gemma4_text``) and a tiny random assistant
drafter for it, written as their Hugging Face folders.

The target has sliding and full attention layers, KV-shared layers and
per-layer inputs, as E2B/E4B; the assistant has one layer of each kind and
the centroid output head (``use_ordered_embeddings``).
"""

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import tiny
from mlx.utils import tree_flatten

WINDOW = 8
ROPE = {
    "full_attention": {
        "partial_rotary_factor": 0.25,
        "rope_theta": 1000000.0,
        "rope_type": "proportional",
    },
    "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
}
TARGET = dict(
    model_type="gemma4_text",
    vocab_size=tiny.VOCAB,
    vocab_size_per_layer_input=tiny.VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=6,
    num_kv_shared_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    global_head_dim=32,
    hidden_size_per_layer_input=8,
    sliding_window=WINDOW,
    layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
    rope_parameters=ROPE,
    final_logit_softcapping=30.0,
    tie_word_embeddings=True,
    rms_norm_eps=1e-6,
    torch_dtype="float32",
    eos_token_id=tiny.VOCAB - 1,
)
ASSISTANT = dict(
    model_type="gemma4_assistant",
    backbone_hidden_size=64,
    use_ordered_embeddings=True,
    num_centroids=8,  # 288 tokens: 8 clusters of 36
    centroid_intermediate_top_k=3,
    tie_word_embeddings=True,
    text_config=dict(
        model_type="gemma4_text",
        vocab_size=tiny.VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        global_head_dim=32,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters=ROPE,
        rms_norm_eps=1e-6,
    ),
)
# the assistant without the centroid head
PLAIN_ASSISTANT = dict(ASSISTANT, use_ordered_embeddings=False)


def _randomize(module: nn.Module, seed: int):
    mx.random.seed(seed)
    weights = dict(tree_flatten(module.parameters()))
    out = {}
    for k, v in weights.items():
        if k.endswith("norm.weight"):
            out[k] = 1.0 + 0.1 * mx.random.normal(v.shape)
        elif k.endswith("layer_scalar"):
            out[k] = mx.ones(v.shape)
        else:
            out[k] = 0.2 * mx.random.normal(v.shape)
    return out


def target_weights(seed: int = 0, config=TARGET):
    from mlx_lm.models import gemma4_text

    model = gemma4_text.Model(gemma4_text.ModelArgs.from_dict(config))
    return _randomize(model, seed)


def assistant_weights(seed: int = 1, config=ASSISTANT):
    """The assistant's checkpoint tensors (HF names)."""
    from mlx_mtp.heads.gemma4_assistant import Gemma4Assistant

    kv = {"sliding_attention": 4, "full_attention": 2}  # any valid map
    head = Gemma4Assistant(config, kv)
    weights = _randomize(head, seed)
    n, vocab = config["num_centroids"], config["text_config"]["vocab_size"]
    if config.get("use_ordered_embeddings"):
        assert vocab % n == 0
        weights["masked_embedding.token_ordering"] = mx.random.permutation(vocab)
    return weights


def build_target(path: Path, seed: int = 0, config=TARGET) -> Path:
    return tiny.save_folder(Path(path), dict(config), target_weights(seed, config))


def build_assistant(
    path: Path, seed: int = 1, config=ASSISTANT, agree_with=None, attention=None
):
    """The assistant's folder; ``agree_with`` (the target's weights) makes it
    draft the token it is given (``agreeable``); ``attention`` then lets its
    attention over the target's keys and values weigh in (``partly``)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    weights = assistant_weights(seed, config)
    if agree_with is not None:
        random = weights
        weights = agreeable(weights, agree_with, config)
        if attention is not None:
            weights = partly(weights, random, attention)
    if "masked_embedding.token_ordering" in weights:  # int64, as Google stores it
        order = weights["masked_embedding.token_ordering"]
        weights["masked_embedding.token_ordering"] = order.astype(mx.int64)
    mx.save_safetensors(str(path / "model.safetensors"), weights, {"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def agreeable(weights, target_w, config=ASSISTANT):
    """``weights`` changed so that the assistant drafts the token it is given
    (its layers add nothing, its output table is its input projection of the
    target's embedding): a target that repeats itself accepts its drafts."""
    d = config["text_config"]["hidden_size"]
    back = config["backbone_hidden_size"]
    out = dict(weights)
    mx.random.seed(7)
    proj = mx.random.normal((d, back)) / back**0.5
    out["pre_projection.weight"] = mx.concatenate([proj, mx.zeros((d, back))], axis=1)
    for k in out:
        if k.endswith(("o_proj.weight", "down_proj.weight")):
            out[k] = mx.zeros(out[k].shape)
        elif k.endswith("norm.weight") and k.startswith("model."):
            out[k] = mx.ones(out[k].shape)
    out["model.embed_tokens.weight"] = target_w["model.embed_tokens.weight"] @ proj.T
    return out


def partly(weights, random, scale: float):
    """An agreeable assistant's ``weights`` whose attention adds its random
    output again, weighed by ``scale`` (its post-attention norm): the drafts
    follow the target's keys and values, and only some are kept (2.0: about
    a third at a long context, most at a short one)."""
    out = dict(weights)
    for k in out:
        if k.endswith("o_proj.weight"):
            out[k] = random[k]
        elif k.endswith("post_attention_layernorm.weight"):
            out[k] = scale * mx.ones(out[k].shape)
    return out
