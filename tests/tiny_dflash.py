"""Tiny random (target, DFlash drafter) pairs in the published layout.

A target is a Qwen3 dense or a Qwen3.5 hybrid model (``tiny_plain``,
``tiny_hybrid``) whose ``MASK`` token embeds to zero. A drafter is a folder
as z-lab publishes it: ``config.json`` with ``architectures:
["DFlashDraftModel"]``, ``dflash_config`` (``mask_token_id``,
``target_layer_ids``; ``block_size`` at the top in the first layout, inside
``dflash_config`` with ``rope_parameters`` in the later one),
``num_target_layers``, and ``model.safetensors`` under the checkpoint's names
(``fc``, ``hidden_norm``, ``layers.{i}.*``, ``norm``; no embedding, no head).

``agreeable=True`` wires the drafter to copy the block's first token into every
masked slot (queries that attend evenly, a near-silent context, the mask
embedding zero, identity values and outputs): its drafts are the target's
near-bigram guess after ``y``, so draft 1 is often kept and later ones seldom.
"""

import json
from pathlib import Path
from typing import Optional, Sequence

import mlx.core as mx
import numpy as np
import tiny
import tiny_hybrid
import tiny_plain

MASK = tiny.VOCAB - 2  # a token no test prompt holds
HIDDEN = 64
ARCHITECTURES = {"dflash": "DFlashDraftModel", "dflash2": "DFlash2DraftModel"}
DFLASH2 = dict(
    conv_kernel_size=3, conv_group_size=16, selector_rank=8, selector_top_k=6
)


def build_target(
    path: Path, family: str = "qwen3", layers: int = 6, seed: int = 0, **overrides
):
    """A near-bigram target (block outputs shrunk) whose MASK embeds to 0
    (``overrides``: of a qwen3 target's config)."""
    path = Path(path)
    if family == "qwen3":
        config, weights = tiny_plain.plain_weights(
            "qwen3", seed, num_hidden_layers=layers, **overrides
        )
        tiny._shrink_outputs(weights, 0.1)
        key = "model.embed_tokens.weight"
    else:
        config, weights, _ = tiny_hybrid.build_weights(family, seed, agreeable=True)
        key = "model.language_model.embed_tokens.weight"
    embed = np.array(weights[key])
    embed[MASK] = 0.0
    weights[key] = mx.array(embed)
    return tiny.save_folder(path, config, weights)


def drafter_config(
    layer_ids: Sequence[int],
    num_target_layers: int,
    layout: str = "v1",
    layers: int = 2,
    block_size: int = 8,
    rope_theta: float = 1_000_000.0,
    kv_heads: int = 2,
    layer_types: Optional[Sequence[str]] = None,
    sliding_window: Optional[int] = None,
    kind: str = "dflash",
    **extra,
) -> dict:
    config = {
        "architectures": [ARCHITECTURES[kind]],
        "model_type": "qwen3",
        "hidden_size": HIDDEN,
        "intermediate_size": 96,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": kv_heads,
        "head_dim": 16,
        "rms_norm_eps": 1e-6,
        "vocab_size": tiny.VOCAB,
        "max_position_embeddings": 4096,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "num_target_layers": num_target_layers,
        "dflash_config": {"mask_token_id": MASK, "target_layer_ids": list(layer_ids)},
        "dtype": "float32",
    }
    if kind == "dflash2":  # its own keys, as z-lab's fixture holds them
        config["dflash_config"].update(DFLASH2)
    if layout == "v1":
        config.update(block_size=block_size, rope_theta=rope_theta)
    else:  # the later layout
        config["dflash_config"]["block_size"] = block_size
        config["rope_parameters"] = {"rope_type": "default", "rope_theta": rope_theta}
    if layer_types is not None:
        config["layer_types"] = list(layer_types)
    if sliding_window is not None:
        config.update(sliding_window=sliding_window, use_sliding_window=True)
    config.update(extra)
    return config


def drafter_weights(config: dict, agreeable: bool = False, seed: int = 0) -> dict:
    """Random weights under the checkpoint's names (numpy, float32)."""
    rng = np.random.default_rng(seed)
    d, hd = config["hidden_size"], config["head_dim"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    n_taps = len(config["dflash_config"]["target_layer_ids"])
    inter = config["intermediate_size"]

    def mat(rows, cols, scale=1.0):
        return (rng.normal(size=(rows, cols)) * scale / np.sqrt(cols)).astype(
            np.float32
        )

    def norm(n, spread=0.1):
        return (1.0 + spread * rng.normal(size=n)).astype(np.float32)

    w = {
        "fc.weight": mat(d, n_taps * d),
        "hidden_norm.weight": norm(d) * (1e-3 if agreeable else 1.0),
        "norm.weight": norm(d, 0.0 if agreeable else 0.1),
    }
    for i in range(config["num_hidden_layers"]):
        p = f"layers.{i}."
        w[p + "input_layernorm.weight"] = norm(d, 0.0 if agreeable else 0.1)
        w[p + "post_attention_layernorm.weight"] = norm(d)
        w[p + "self_attn.q_proj.weight"] = mat(heads * hd, d, 1e-3 if agreeable else 1)
        w[p + "self_attn.k_proj.weight"] = mat(kv * hd, d)
        w[p + "self_attn.q_norm.weight"] = norm(hd)
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
    own = config["dflash_config"]
    if "selector_rank" in own:  # DFlash 2: convolutions and the selector
        kernel, groups = own["conv_kernel_size"], d // own["conv_group_size"]
        for i in range(config["num_hidden_layers"]):
            for conv in ("attention_conv", "mlp_conv"):
                p = f"layers.{i}.{conv}."
                base = rng.normal(size=(2, kernel, d)).astype(np.float32) * 0.3
                base[:, 0] += 1.0  # about the identity, and more
                w[p + "base_kernel"] = base * (0 if agreeable else 1)
                if agreeable:
                    w[p + "base_kernel"][:, 0] = 1.0
                w[p + "kernel_projection.weight"] = mat(
                    2 * kernel * groups, d, 0.0 if agreeable else 0.3
                )
        rank, vocab = own["selector_rank"], config["vocab_size"]
        scale = 0.0 if agreeable else 1.0
        w["candidate_selector.predecessor_codebook"] = mat(vocab, rank, scale * 4)
        w["candidate_selector.successor_codebook"] = mat(vocab, rank, scale * 4)
        w["candidate_selector.hidden_projection.weight"] = mat(rank, d, scale * 4)
    return w


def save_drafter(path: Path, config: dict, weights: dict) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    arrays = {k: mx.array(v) for k, v in weights.items()}
    mx.save_safetensors(str(path / "model.safetensors"), arrays, {"format": "pt"})
    return path


def build_drafter(
    path: Path, layer_ids, num_target_layers, agreeable=False, seed=0, **kw
):
    config = drafter_config(
        layer_ids, num_target_layers, kv_heads=4 if agreeable else 2, **kw
    )
    return save_drafter(path, config, drafter_weights(config, agreeable, seed))
