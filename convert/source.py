"""What a converter reads: a config, tensors, and a way to write tokenizer files.

A ``Source`` is the same whatever the input format. Hugging Face folders give
tensors under their checkpoint names; GGUF files give them under mlx-lm's
parameter names (experts already stacked), possibly already quantized
(``X.weight`` packed with ``X.scales``/``X.biases``). Both pass through the
trunk's own ``sanitize``, which leaves mlx-lm names alone.
"""

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import mlx.core as mx

from mlx_mtp.errors import MTPError
from mlx_mtp.loader import read_config
from mlx_mtp.weights import read_safetensors

# Files a Hugging Face folder keeps its tokenizer, chat template and
# image processor in.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
    # a vision model's image processor (mlx-vlm's, transformers')
    "preprocessor_config.json",
    "processor_config.json",
    "video_preprocessor_config.json",
)


@dataclass
class Source:
    """A model to convert: HF-style config, tensors, tokenizer writer."""

    path: Path
    config: Dict[str, Any]
    weights: Dict[str, mx.array]
    write_tokenizer: Optional[Callable[[Path], None]] = None
    # GGUF: the llama.cpp type of each tensor (mlx-lm name -> "Q4_K", "F32"...)
    gguf_types: Dict[str, str] = field(default_factory=dict)


def weight_files(folder: Path) -> List[Path]:
    """The safetensors files of a folder: those its index names, else all ``*.safetensors``."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise MTPError(f"{index}: not a valid safetensors index ({e})") from None
        files = sorted({folder / name for name in weight_map.values()})
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise MTPError(
                f"{folder}: shard {missing[0]} named in the index is missing"
            )
        extra = sorted(folder.glob("mtp*.safetensors"))
        return files + [f for f in extra if f not in files]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise MTPError(f"{folder}: no *.safetensors weights")
    return files


def has_tokenizer(folder: Path) -> bool:
    return any((folder / n).exists() for n in ("tokenizer.json", "tokenizer.model"))


def copy_tokenizer(src: Path) -> Callable[[Path], None]:
    def write(out: Path) -> None:
        for name in TOKENIZER_FILES:
            if (src / name).exists():
                shutil.copy2(src / name, out / name)

    return write


def read_hf_folder(path: Path, need_tokenizer: bool = True) -> Source:
    """A Hugging Face (or MLX) model folder: config.json, safetensors, tokenizer files."""
    config = read_config(path)
    if need_tokenizer and not has_tokenizer(path):
        raise MTPError(f"{path}: no tokenizer (tokenizer.json or tokenizer.model)")
    files = weight_files(path)
    weights = read_safetensors(files)
    return Source(path, config, weights, copy_tokenizer(path))
