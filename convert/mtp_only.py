"""Add an MTP head to an MLX model the user already has (docs/design.md section 8).

Most MLX checkpoints carry no MTP tensors. The original checkpoint's head is
written as ``mtp.safetensors`` beside the existing ``model*.safetensors``, with
``config.json`` updated, after checking that trunk and head belong together.
From a Hub repo only the index and the shards holding MTP tensors are fetched.
"""

import json
from pathlib import Path
from typing import Any, Dict, Optional, Union

import mlx.core as mx

from mlx_mtp.config import HEAD_CONFIG_FILE
from mlx_mtp.errors import MTPError, first_line
from mlx_mtp.heads import family_for, gemma4_assistant
from mlx_mtp.loader import is_assistant, read_assistant, read_config
from mlx_mtp.weights import read_safetensors

from .gguf_source import read_gguf
from .hub import fetch_mtp_shards, is_repo_id
from .model import (
    build_heads,
    head_quantization,
    head_tensors,
    normalize_config,
    split_mtp,
    trunk_group_size,
)
from .output import atomic_write_files
from .pipeline import HEAD_FILE, is_gguf, write_config
from .precision import Precision, apply_head, quantization_config

PathLike = Union[str, Path]
# config keys that describe the MTP layers, copied from the head's source
MTP_CONFIG_KEYS = ("num_nextn_predict_layers", "mtp_num_hidden_layers")


def _mtp_from_folder(
    folder: Path, config: Dict[str, Any], is_mtp
) -> Dict[str, mx.array]:
    """MTP tensors of a HF folder, opening only the files the index says hold them."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        names = sorted({f for k, f in weight_map.items() if is_mtp(k, config)})
        files = [folder / n for n in names]
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise MTPError(f"{folder}: shard {missing[0]} is missing")
    else:
        files = sorted(folder.glob("*.safetensors"))
    weights = read_safetensors(files)
    return {k: v for k, v in weights.items() if is_mtp(k, config)}


def read_head_source(src: PathLike):
    """(config, MTP tensors) from a HF folder, a GGUF file or a Hub repo id."""
    path = Path(src)
    if path.is_file() and is_gguf(path):
        source = read_gguf(path)
        return source.config, split_mtp(
            normalize_config(source.config), source.weights
        )[1]
    if not path.exists():
        if not is_repo_id(str(src)):
            raise MTPError(f"{src}: no such file or folder")

        def is_mtp(key, config):
            if config.get("model_type") == gemma4_assistant.ASSISTANT_TYPE:
                return True  # a drafter checkpoint: all of it
            family = family_for(config)
            return family is not None and family.is_mtp_key(key, config)

        path = fetch_mtp_shards(str(src), is_mtp)
    if path.is_dir() and is_assistant(path):
        head_config, weights = read_assistant(path)
        return head_config["assistant"], weights
    config = read_config(path)
    family = family_for(config)
    if family is None:
        raise MTPError(f"{src}: {config['model_type']} has no MTP head family")
    return config, _mtp_from_folder(path, config, family.is_mtp_key)


def check_agreement(
    head_cfg: Dict[str, Any], trunk_cfg: Dict[str, Any], into: Path
) -> None:
    def get(cfg, key):
        return cfg.get(key, cfg.get("text_config", {}).get(key))

    if head_cfg["model_type"] != trunk_cfg["model_type"]:
        raise MTPError(
            f"{into} is a {trunk_cfg['model_type']} model, the head is {head_cfg['model_type']}"
        )
    for key in ("hidden_size", "vocab_size", "num_hidden_layers"):
        if get(head_cfg, key) != get(trunk_cfg, key):
            raise MTPError(
                f"the head does not fit {into}: {key} {get(head_cfg, key)} vs {get(trunk_cfg, key)}"
            )


def add_mtp(
    src: PathLike,
    into: PathLike,
    *,
    mtp_bits: int = 8,
    dtype: Optional[str] = None,
    force: bool = False,
) -> Path:
    """Write the MTP head of ``src`` into the existing MLX folder ``into``; returns its file."""
    from mlx_lm.utils import load_model as mlx_lm_load_model

    precision = Precision(dtype=dtype, mtp_bits=mtp_bits)
    precision.check()
    into = Path(into)
    trunk_cfg = read_config(into)
    target = into / HEAD_FILE
    if target.exists() and not force:
        raise MTPError(f"{target} exists (use --force to replace it)")
    head_cfg, mtp = read_head_source(src)
    if head_cfg.get("model_type") == gemma4_assistant.ASSISTANT_TYPE:
        return _add_assistant(head_cfg, mtp, into, trunk_cfg, precision)
    check_agreement(head_cfg, trunk_cfg, into)
    if not mtp:
        raise MTPError(f"{src}: no MTP tensors")
    config = dict(trunk_cfg)
    family = family_for(head_cfg)
    keys = MTP_CONFIG_KEYS + getattr(family, "HEAD_CONFIG_KEYS", ())
    config.update({k: head_cfg[k] for k in keys if k in head_cfg})
    text = head_cfg.get("text_config")  # Kimi-K3 counts its layers there
    if isinstance(text, dict) and isinstance(config.get("text_config"), dict):
        config["text_config"] = {
            **config["text_config"],
            **{k: text[k] for k in keys if k in text},
        }
    try:
        model, _ = mlx_lm_load_model(into, lazy=True)
    except Exception as e:
        raise MTPError(f"{into}: cannot load the model ({first_line(e)})") from None
    if precision.dtype is None:  # match the trunk's float dtype
        precision.dtype = _float_dtype(model)
    heads, leftover = build_heads(model, normalize_config(config), mtp)
    if not heads:
        raise MTPError(
            f"{src}: its MTP tensors do not form a head of {config['model_type']}"
        )
    group = trunk_group_size(model)
    tensors, quant = {}, {}
    for prefix, head in heads:
        apply_head(head, precision, group)
        tensors.update(head_tensors(prefix, head))
        quant.update(head_quantization(prefix, head))
    tensors.update(leftover)
    _merge_quantization(config, quant)
    mx.eval(list(tensors.values()))
    atomic_write_files(
        {
            target: lambda p: mx.save_safetensors(
                str(p), tensors, metadata={"format": "mlx"}
            ),
            into / "config.json": lambda p: write_config(config, p),
        }
    )
    return target


def _add_assistant(
    config: Dict[str, Any],
    tensors: Dict[str, mx.array],
    into: Path,
    trunk_cfg: Dict[str, Any],
    precision: Precision,
) -> Path:
    """A Gemma 4 assistant kept beside its target: ``mtp.safetensors`` (its
    tensors, unquantized) and ``mtp_config.json`` naming it, with its config."""
    model_type = trunk_cfg.get("model_type")
    if model_type not in gemma4_assistant.TARGET_TYPES:
        raise MTPError(
            f"{into} is a {model_type} model: a Gemma 4 assistant drafts for Gemma 4"
        )
    text = trunk_cfg.get("text_config") or {}
    width = trunk_cfg.get("hidden_size", text.get("hidden_size"))
    if config.get("backbone_hidden_size") != width:
        raise MTPError(
            f"the assistant does not fit {into}: it drafts for a "
            f"{config.get('backbone_hidden_size')}-wide Gemma 4, this one is {width}"
        )
    if precision.dtype is not None:
        dtype = getattr(mx, precision.dtype)
        tensors = {
            k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v
            for k, v in tensors.items()
        }
    head_config = {"family": "gemma4_assistant", "assistant": config}
    target = into / HEAD_FILE
    mx.eval(list(tensors.values()))
    atomic_write_files(
        {
            target: lambda p: mx.save_safetensors(
                str(p), tensors, metadata={"format": "mlx"}
            ),
            into / HEAD_CONFIG_FILE: lambda p: p.write_text(
                json.dumps(head_config, indent=2) + "\n"
            ),
        }
    )
    return target


def _float_dtype(model) -> Optional[str]:
    from mlx.utils import tree_flatten

    for name, v in tree_flatten(model.parameters()):
        if mx.issubdtype(v.dtype, mx.floating) and not name.endswith(
            (".scales", ".biases")
        ):
            return str(v.dtype).split(".")[-1]
    return None


def _merge_quantization(
    config: Dict[str, Any], head: Dict[str, Dict[str, Any]]
) -> None:
    """Head entries join the trunk's quantization, replacing those of an earlier head."""
    family = family_for(config)
    current = config.get("quantization")
    if current is None:
        merged = quantization_config({}, head)
    else:
        merged = {
            k: v
            for k, v in current.items()
            if not (isinstance(v, dict) and family.is_mtp_key(f"{k}.weight", config))
        }
        merged.update(head)
    if merged is not None:
        config["quantization"] = merged
