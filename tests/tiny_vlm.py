"""Tiny random Qwen3.5 and Qwen3.6-MoE vision-language checkpoints in the
published layout.

The text model and its ``mtp.*`` head are ``tiny_hybrid``'s Qwen3.5 (tensors
under ``model.language_model``); the vision tower is mlx-vlm 0.7.10's own
class at random init, written under ``model.visual``; the config nests
``text_config`` and ``vision_config`` and names the image tokens, and the
folder holds a byte-level tokenizer with Qwen's vision tokens and a
``preprocessor_config.json``, so mlx-vlm's loader and processor read it
offline. Patches are 8 pixels and 2 x 2 of them merge into one token: a
32 x 32 image is 4 tokens, 32 x 48 is 6.
"""

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import tiny
import tiny_hybrid
from mlx.utils import tree_flatten

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
SPECIALS = tiny.SPECIALS + VISION_TOKENS
VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = (
    256 + SPECIALS.index(t) for t in VISION_TOKENS
)

VISION = dict(
    model_type="qwen3_5",
    depth=2,
    hidden_size=32,
    intermediate_size=64,
    out_hidden_size=tiny_hybrid._TEXT["hidden_size"],
    num_heads=2,
    patch_size=8,
    spatial_patch_size=8,
    spatial_merge_size=2,
    temporal_patch_size=2,
    in_channels=3,
    num_position_embeddings=16,
    deepstack_visual_indexes=[],
)
PREPROCESSOR = dict(
    patch_size=8,
    temporal_patch_size=2,
    merge_size=2,
    min_pixels=16 * 16,
    max_pixels=64 * 64,
    image_mean=[0.5, 0.5, 0.5],
    image_std=[0.5, 0.5, 0.5],
)


ARCHITECTURES = {
    "qwen3_5": "Qwen3_5ForConditionalGeneration",
    "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",  # Qwen3.6-35B-A3B's
}


def config(seed_config: dict) -> dict:
    """The text model's config with the vision tower's and the image tokens."""
    model_type = seed_config["model_type"]
    text = dict(seed_config["text_config"])
    # every dimension rotates (16 = 8 frequencies), so that the multimodal
    # rope's three sections (time, height, width) all have frequencies
    quarter = text["head_dim"] // 4
    text["rope_parameters"] = {
        **text["rope_parameters"],
        "partial_rotary_factor": 1.0,
        "mrope_section": [quarter, quarter // 2, quarter // 2],
        "type": "default",
    }
    return {
        **seed_config,
        "text_config": text,
        "vision_config": {**VISION, "model_type": model_type},
        "image_token_id": IMAGE_PAD,
        "video_token_id": VIDEO_PAD,
        "vision_start_token_id": VISION_START,
        "vision_end_token_id": VISION_END,
        "vocab_size": tiny.VOCAB,
        "architectures": [ARCHITECTURES[model_type]],
    }


def vision_weights(seed: int = 0):
    """mlx-vlm's Qwen3.5 vision tower at random init, named ``model.visual.*``."""
    from mlx_vlm.models.qwen3_5 import VisionConfig, VisionModel

    mx.random.seed(seed + 1000)
    tower = VisionModel(VisionConfig.from_dict(VISION))
    params = dict(tree_flatten(tower.parameters()))
    return {f"model.visual.{k}": v for k, v in params.items()}


def write_tokenizer(path: Path) -> None:
    fast = tiny.byte_tokenizer(SPECIALS, pad_token="<|endoftext|>")
    fast.chat_template = tiny.CHAT_TEMPLATE
    fast.save_pretrained(str(path))


def build_folder(
    path: Path,
    seed: int = 0,
    agreeable: bool = True,
    model_type: str = "qwen3_5",
    **overrides,
) -> Path:
    """A Qwen3.5 VLM folder (``model_type`` "qwen3_5_moe": Qwen3.6's MoE, its
    experts fused as published, float32 since MLX's CPU MoE kernel takes no
    other): language model, vision tower, ``mtp.*`` head, tokenizer and
    image processor config. ``overrides`` change the text config (wider
    heads: ``head_dim=32``, which quantized keys need)."""
    seed_config, trunk_w, mtp_w = tiny_hybrid.build_weights(
        model_type, seed, agreeable, **overrides
    )
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    weights = {**trunk_w, **vision_weights(seed), **mtp_w}
    mx.save_safetensors(str(path / "model.safetensors"), weights, {"format": "pt"})
    (path / "config.json").write_text(json.dumps(config(seed_config), indent=2))
    (path / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    write_tokenizer(path)
    return path


def mlx_vlm_greedy(theirs, processor, prompt, n: int) -> list:
    """mlx-vlm's own plain greedy tokens (``generate_step``, no drafter) for
    ``prompt`` (a ``Prompt`` mlx-mtp's processor made) on ``theirs`` (the
    model ``mlx_vlm.load`` loads), to an end token."""
    from mlx_vlm.generate import generate_step

    kwargs, pixels = {}, None
    if prompt.segments:
        pixels = mx.concatenate(
            [mx.array(s.data["pixel_values"]) for s in prompt.segments]
        )
        grids = [s.data["grid_thw"] for s in prompt.segments]
        kwargs["image_grid_thw"] = mx.array(grids)
    eos = set(processor.eos_token_ids)
    out = []
    steps = generate_step(mx.array([prompt.tokens]), theirs, pixels, None,
                          max_tokens=n, temperature=0.0, **kwargs)  # fmt: skip
    for t, _ in steps:
        out.append(int(t))
        if int(t) in eos:
            break
    return out


def write_image(path: Path, seed: int, size=(32, 32)) -> Path:
    """A random RGB PNG of ``size`` (width, height)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, size=(size[1], size[0], 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)
    return Path(path)
