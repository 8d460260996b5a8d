"""What a model file holds: architecture, layers, MTP layers, vision tower,
precision per part, size.

Reads headers only (safetensors headers, GGUF metadata): no tensor is loaded.
"""

import importlib
import json
import struct
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from mlx_mtp import vision
from mlx_mtp.config import read_head_config
from mlx_mtp.drafters import read_drafter_config
from mlx_mtp.errors import MTPError, first_line
from mlx_mtp.heads import family_for, layers_present
from mlx_mtp.loader import HEAD_FILE_GLOB, read_config, trained_head_family
from mlx_mtp.weights import check_safetensors

from .gguf_dsv4 import ARCHS as DSV4
from .gguf_glm5 import ARCHS as GLM5
from .gguf_hybrid import ARCHS as HYBRID
from .gguf_nemotron import ARCHS as NEMOTRON
from .gguf_source import ARCHS, REFUSED, Metadata, open_gguf
from .pipeline import is_gguf


@dataclass
class ModelInfo:
    path: str
    format: str  # "GGUF", "Hugging Face folder" or "MLX folder"
    architecture: str
    layers: int
    mtp_layers: int  # MTP layers whose tensors are present
    trunk_precision: Dict[str, int] = field(default_factory=dict)  # label -> tensors
    mtp_precision: Dict[str, int] = field(default_factory=dict)
    trunk_bytes: int = 0
    mtp_bytes: int = 0
    size_bytes: int = 0
    trained_head: bool = False  # the head came from train-head (mtp_config.json)
    # a drafter checkpoint's kind and shape (its weights count as the trunk's)
    drafter: Dict[str, Any] = field(default_factory=dict)
    # a vision checkpoint's tower (its tensors are not the trunk's)
    vision_precision: Dict[str, int] = field(default_factory=dict)
    vision_bytes: int = 0

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)


def _header(path: Path) -> Tuple[Dict[str, Any], Dict[str, str]]:
    """A safetensors file's tensor entries and metadata, from its header alone."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
    except (OSError, struct.error, ValueError) as e:
        raise MTPError(f"{path}: not a valid safetensors file ({e})") from None
    meta = header.pop("__metadata__", None) or {}
    return header, meta


_SAFETENSORS_DTYPES = {
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "U32": "uint32",
    "I32": "int32",
    "I64": "int64",
}


def _folder_precision(
    entries: Dict[str, Dict[str, Any]], quant: Dict[str, Any]
) -> Counter:
    """Labels like ``4-bit/g64`` per quantized module and dtypes per float tensor."""
    counts: Counter = Counter()
    for name, e in entries.items():
        if name.endswith((".scales", ".biases")):
            continue
        module = name.rsplit(".", 1)[0]
        scales = entries.get(f"{module}.scales")
        if name.endswith(".weight") and scales is not None:
            q = quant.get(module) if isinstance(quant.get(module), dict) else quant
            group = q.get("group_size", 64)
            in_dims = scales["shape"][-1] * group
            bits = e["shape"][-1] * 32 // in_dims
            counts[f"{bits}-bit/g{group}"] += 1
        else:
            counts[_SAFETENSORS_DTYPES.get(e["dtype"], e["dtype"].lower())] += 1
    return counts


def _nbytes(e: Dict[str, Any]) -> int:
    start, end = e["data_offsets"]
    return end - start


def _mtp_layer_count(config: Dict[str, Any], family, names: List[str]) -> int:
    return 0 if family is None else layers_present(family, config, names)


def describe_folder(path: Path) -> ModelInfo:
    config = read_config(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise MTPError(f"{path}: no *.safetensors weights")
    # a head trained by train-head names its family beside it: the model's
    # own model_type (llama, ...) may have none
    trained = trained_head_family(read_head_config(path), path)
    family = trained or family_for(config)
    head_files = set(path.glob(HEAD_FILE_GLOB))
    entries: Dict[str, Dict[str, Any]] = {}
    mtp = set()
    is_mlx = "quantization" in config
    for f in files:
        check_safetensors(f)  # what loading checks: a truncated file is named
        header, meta = _header(f)
        entries.update(header)
        if f in head_files:  # every tensor of mtp*.safetensors is the head's
            mtp.update(header)
        is_mlx = is_mlx or meta.get("format") == "mlx"
    if family is not None:
        mtp.update(k for k in entries if family.is_mtp_key(k, config))
    tower = set()
    if "vision_config" in config:
        tower = {k for k in entries if k not in mtp and vision.is_tower_key(k)}
    trunk = {k: v for k, v in entries.items() if k not in mtp and k not in tower}
    head = {k: v for k, v in entries.items() if k in mtp}
    seen = {k: entries[k] for k in tower}
    quant = config.get("quantization") or {}
    return ModelInfo(
        path=str(path),
        format="MLX folder" if is_mlx else "Hugging Face folder",
        architecture=config["model_type"],
        layers=_trunk_layers(config.get("text_config", config)),
        mtp_layers=_mtp_layer_count(config, family, list(head)),
        trunk_precision=dict(_folder_precision(trunk, quant)),
        mtp_precision=dict(_folder_precision(head, quant)),
        trunk_bytes=sum(_nbytes(e) for e in trunk.values()),
        mtp_bytes=sum(_nbytes(e) for e in head.values()),
        size_bytes=sum(f.stat().st_size for f in path.iterdir() if f.is_file()),
        trained_head=trained is not None,
        vision_precision=dict(_folder_precision(seen, quant)),
        vision_bytes=sum(_nbytes(e) for e in seen.values()),
    )


def describe_gguf(path: Path) -> ModelInfo:
    reader = open_gguf(path)
    meta = Metadata(reader)
    blocks = int(meta.arch_key("block_count", 0) or 0)
    n_mtp = int(meta.arch_key("nextn_predict_layers", 0) or 0)
    first_mtp = blocks - n_mtp
    trunk, head = Counter(), Counter()
    trunk_bytes = mtp_bytes = 0
    present = set()
    for t in reader.tensors:
        parts = t.name.split(".")
        layer = int(parts[1]) if parts[0] == "blk" and parts[1].isdigit() else -1
        if n_mtp and layer >= first_mtp:
            head[t.tensor_type.name] += 1
            mtp_bytes += int(t.n_bytes)
            present.add(layer)
        else:
            trunk[t.tensor_type.name] += 1
            trunk_bytes += int(t.n_bytes)
    arch = meta.arch or "?"
    archs = {**ARCHS, **HYBRID, **NEMOTRON, **GLM5, **DSV4}
    if arch in archs:
        named = f"{arch} ({archs[arch]})"
    elif arch in REFUSED:  # the family; convert says why it does not convert
        named = f"{arch} ({REFUSED[arch][0]}; not convertible from GGUF)"
    else:
        named = f"{arch} (not supported)"
    return ModelInfo(
        path=str(path),
        format="GGUF",
        architecture=named,
        layers=first_mtp,
        mtp_layers=len(present),
        trunk_precision=dict(trunk),
        mtp_precision=dict(head),
        trunk_bytes=trunk_bytes,
        mtp_bytes=mtp_bytes,
        size_bytes=path.stat().st_size,
    )


def describe_drafter(path: Path, config: Dict[str, Any], kind: str) -> ModelInfo:
    """A drafter folder: its kind (``mlx_mtp.drafters``), what it reads of its
    target, and its weights' precision."""
    module = importlib.import_module(f"mlx_mtp.drafters.{kind}")
    try:
        shape = module.summary(config)
    except (ValueError, KeyError) as e:
        raise MTPError(f"{path}: a drafter config it cannot read ({first_line(e)})")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise MTPError(f"{path}: no *.safetensors weights")
    entries: Dict[str, Dict[str, Any]] = {}
    for f in files:
        check_safetensors(f)
        entries.update(_header(f)[0])
    names = [n for n in config.get("architectures") or [] if n in module.KINDS]
    name = names[0] if names else config.get("model_type", kind)
    return ModelInfo(
        path=str(path),
        format="drafter folder",
        architecture=f"{name} ({module.KINDS.get(name, kind)})",
        layers=int(config.get("num_hidden_layers", 0)),
        mtp_layers=0,
        trunk_precision=dict(
            _folder_precision(entries, config.get("quantization") or {})
        ),
        trunk_bytes=sum(_nbytes(e) for e in entries.values()),
        size_bytes=sum(f.stat().st_size for f in path.iterdir() if f.is_file()),
        drafter={"kind": kind, **shape},
    )


def describe(path) -> ModelInfo:
    """``ModelInfo`` for a GGUF file, a Hugging Face folder, an MLX folder or
    a drafter folder."""
    path = Path(path)
    if not path.exists():
        raise MTPError(f"{path}: no such file or folder")
    if path.is_dir():
        config, kind = read_drafter_config(path)
        if kind is not None:
            return describe_drafter(path, config, kind)
        return describe_folder(path)
    if not is_gguf(path):
        raise MTPError(f"{path}: not a GGUF file or a model folder")
    return describe_gguf(path)


def format_precision(counts: Dict[str, int]) -> str:
    if not counts:
        return "none"
    return ", ".join(
        f"{label} x{n}" for label, n in sorted(counts.items(), key=lambda x: -x[1])
    )


def format_size(n: Optional[int]) -> str:
    size = float(n or 0)
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{size:.1f} GB"


def _trunk_layers(config: Dict[str, Any]) -> int:
    # LongCat-Flash(-Ngram) counts its two-attention layers as ``num_layers``
    return int(config.get("num_hidden_layers", config.get("num_layers", 0)))
