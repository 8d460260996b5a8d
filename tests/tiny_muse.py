"""Tiny random Muse Glimmer targets and assistants in the published layouts.

A target is a folder as Meta publishes ``muse_glimmer``: the language
model's config under ``text_config`` (``model_type: muse_glimmer_text``,
explicit ``layer_types``), its tensors under ``model.language_model.*`` and
``lm_head.weight``; mlx-lm's ``muse_glimmer`` loads it. ``agreeable=True``
sets its post-attention and post-feed-forward norms (centered: ``1 + w``) to
0.1, so the trunk is close to a bigram model, and embeds ``MASK`` to zero.

An assistant is a folder as ``meta-models/Muse-Glimmer-30B-assistant`` lays
it out: ``architectures: ["MuseGlimmerAssistantModel"]``, ``model_type:
muse_glimmer_assistant``, ``dflash_config`` (``block_size``,
``mask_token_id``, ``target_layer_ids``), every layer
``sliding_attention``, no ``vocab_size`` nor ``num_target_layers``, and
``model.safetensors`` with ``encoder.fc``, ``encoder.output_norm_enc``,
``layers.{i}.*`` and ``norm`` (no embedding, no head). ``agreeable=True``
wires it to copy the block's first token into every masked slot (queries
zero, so attention is even; the context's values zero; identity values and
outputs; no MLP).
"""

import json
from pathlib import Path
from typing import Optional, Sequence

import mlx.core as mx
import numpy as np
import tiny
from mlx.utils import tree_flatten

MASK = tiny.VOCAB - 2  # a token no test prompt holds
HIDDEN = 64


def target_config(layers: int = 8, window: int = 6) -> dict:
    types = (["sliding_attention"] * 3 + ["full_attention"]) * (layers // 4)
    types += ["sliding_attention"] * (layers - len(types))
    text = dict(
        model_type="muse_glimmer_text",
        vocab_size=tiny.VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=96,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        post_norm_eps=1e-8,
        sliding_window=window,
        max_position_embeddings=4096,
        rope_parameters={"rope_theta": 500000.0, "rope_type": "default"},
        layer_types=types,
        qk_scale_factor=3.87,
        output_multiplier=0.196,
        final_logit_softcapping=20.0,
        tie_word_embeddings=False,
        eos_token_id=tiny.VOCAB - 1,
    )
    return dict(
        architectures=["MuseGlimmerForConditionalGeneration"],
        model_type="muse_glimmer",
        text_config=text,
        torch_dtype="float32",
    )


def build_target(path: Path, layers: int = 8, window: int = 6, seed: int = 0,
                 agreeable: bool = True) -> Path:  # fmt: skip
    from mlx_lm.utils import _get_classes

    config = target_config(layers, window)
    mx.random.seed(seed)
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    weights = {}
    for k, v in tree_flatten(model.parameters()):
        if k.endswith("norm.weight"):
            v = 0.1 * mx.random.normal(v.shape)  # centered: 1 + w
            if k == "model.norm.weight":  # the final norm is a plain one
                v = 1.0 + v
            elif agreeable and ".post_" in k:
                v = mx.full(v.shape, -0.9)
        if k == "model.embed_tokens.weight":
            v = np.array(v)
            v[MASK] = 0.0
            v = mx.array(v)
        name = "model.language_model." + k[len("model."):] if k.startswith("model.") else k
        weights[name] = v
    return tiny.save_folder(Path(path), config, weights)


def assistant_config(layer_ids: Sequence[int], layers: int = 2, block_size: int = 8,
                     window: int = 5, kv_heads: int = 2,
                     layer_types: Optional[Sequence[str]] = None,
                     **extra) -> dict:  # fmt: skip
    config = {
        "architectures": ["MuseGlimmerAssistantModel"],
        "model_type": "muse_glimmer_assistant",
        "hidden_size": HIDDEN,
        "intermediate_size": 96,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": kv_heads,
        "head_dim": 16,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 4096,
        "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"},
        "attention_bias": False,
        "hidden_act": "silu",
        "layer_types": list(layer_types or ["sliding_attention"] * layers),
        "sliding_window": window,
        "use_sliding_window": True,
        "dflash_config": {
            "block_size": block_size,
            "mask_token_id": MASK,
            "target_layer_ids": list(layer_ids),
        },
        "dtype": "float32",
    }
    config.update(extra)
    return config


def assistant_weights(config: dict, agreeable: bool = False, seed: int = 0) -> dict:
    """Random weights under the checkpoint's names (numpy, float32)."""
    rng = np.random.default_rng(seed)
    d, hd = config["hidden_size"], config["head_dim"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    taps, inter = len(config["dflash_config"]["target_layer_ids"]), config["intermediate_size"]

    def mat(rows, cols, scale=1.0):
        return (rng.normal(size=(rows, cols)) * scale / np.sqrt(cols)).astype(np.float32)

    def norm(n, scale=1.0, spread=0.1):
        return (scale * (1.0 + spread * rng.normal(size=n))).astype(np.float32)

    w = {
        "encoder.fc.weight": mat(d, taps * d),
        "encoder.output_norm_enc.weight": norm(d, 0.0 if agreeable else 1.0),
        "norm.weight": norm(d, spread=0.0 if agreeable else 0.1),
    }
    for i in range(config["num_hidden_layers"]):
        p = f"layers.{i}."
        w[p + "input_layernorm.weight"] = norm(d, spread=0.0 if agreeable else 0.1)
        w[p + "post_attention_layernorm.weight"] = norm(d)
        w[p + "self_attn.q_proj.weight"] = mat(heads * hd, d)
        w[p + "self_attn.k_proj.weight"] = mat(kv * hd, d)
        w[p + "self_attn.q_norm.weight"] = norm(hd, 0.0 if agreeable else 1.0)
        w[p + "self_attn.k_norm.weight"] = norm(hd)
        if agreeable:
            w[p + "self_attn.v_proj.weight"] = np.eye(kv * hd, d, dtype=np.float32)
            w[p + "self_attn.o_proj.weight"] = np.eye(d, heads * hd, dtype=np.float32)
        else:
            w[p + "self_attn.v_proj.weight"] = mat(kv * hd, d)
            w[p + "self_attn.o_proj.weight"] = mat(d, heads * hd)
        w[p + "mlp.gate_proj.weight"] = mat(inter, d)
        w[p + "mlp.up_proj.weight"] = mat(inter, d)
        w[p + "mlp.down_proj.weight"] = mat(d, inter, 0.0 if agreeable else 1.0)
    return w


def save_assistant(path: Path, config: dict, weights: dict) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    arrays = {k: mx.array(v) for k, v in weights.items()}
    mx.save_safetensors(str(path / "model.safetensors"), arrays, {"format": "pt"})
    return path


def build_assistant(path: Path, layer_ids, agreeable=False, seed=0, **kw) -> Path:
    config = assistant_config(layer_ids, kv_heads=4 if agreeable else 2, **kw)
    return save_assistant(path, config, assistant_weights(config, agreeable, seed))


def vlm_reference(target: Path, assistant: Path):
    """mlx-vlm 0.7.10's Muse Glimmer language model and assistant on the same
    folders: ``(language_model, drafter)``, the drafter bound to it."""
    from mlx_vlm.models.muse_glimmer.language import LanguageModel, TextConfig
    from mlx_vlm.speculative.drafters.muse_glimmer_assistant import (
        ModelConfig,
        MuseGlimmerAssistantDraftModel,
    )

    config = json.loads((Path(target) / "config.json").read_text())
    text = config["text_config"]
    lm = LanguageModel(TextConfig.from_dict(text))
    weights = mx.load(str(Path(target) / "model.safetensors"))
    prefix = "model.language_model."
    lm.load_weights(
        [("model." + k[len(prefix):] if k.startswith(prefix) else k, v)
         for k, v in weights.items()]
    )  # fmt: skip
    own = json.loads((Path(assistant) / "config.json").read_text())
    # the published config names neither; mlx-vlm's defaults are the 30B's
    own = {**own, "vocab_size": text["vocab_size"],
           "num_target_layers": text["num_hidden_layers"]}  # fmt: skip
    drafter = MuseGlimmerAssistantDraftModel(ModelConfig.from_dict(own))
    drafter.load_weights(list(mx.load(str(Path(assistant) / "model.safetensors")).items()))
    return lm, drafter.bind(lm)
