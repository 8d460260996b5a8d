"""Precision policy: what the trunk and the MTP block are stored at.

The trunk is quantized as the user asks (like ``mlx_lm.convert``). The MTP
block is kept at higher precision because a quantized head loses acceptance
(vLLM PR #38650 keeps Qwen's ``mtp.fc`` unquantized): with a quantized trunk
it is stored at 8 bits by default, or as floats with ``mtp_bits=16``; with a
float trunk it stays float. Tensors that arrive already quantized (GGUF
Q4_0/Q4_1/Q8_0) keep their grid unless ``dequantize`` asks for floats.

A quantized GGUF converted with no precision asked for (``nearest``) keeps
its size: every other quantized tensor (K-quants, Q5_*, IQ*...) is
quantized again at the nearest MLX width that loses none of its bits, in
groups of 32 (GGUF's block), and its float tensors (norms) stay floats.
"""

from collections import Counter
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map_with_path

from mlx_mtp.errors import MTPError

DTYPES = ("float16", "bfloat16", "float32")
MTP_BITS = (8, 16)
DEFAULT_Q_BITS = 4
DEFAULT_Q_GROUP_SIZE = 64
DEFAULT_MTP_BITS = 8


@dataclass
class Precision:
    quantize: bool = False
    q_bits: int = DEFAULT_Q_BITS
    q_group_size: int = DEFAULT_Q_GROUP_SIZE
    dtype: Optional[str] = None  # None: keep the source's float dtype
    mtp_bits: int = DEFAULT_MTP_BITS
    dequantize: bool = False
    # GGUF's own precision: weight name -> MLX bits (None: float); see nearest_bits
    nearest: Optional[Dict[str, Optional[int]]] = None

    def check(self) -> None:
        if self.quantize and self.dequantize:
            raise MTPError("choose either quantize or dequantize, not both")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise MTPError(
                f"dtype must be one of {', '.join(DTYPES)}, not {self.dtype}"
            )
        if self.mtp_bits not in MTP_BITS:
            raise MTPError(f"MTP bits must be 8 or 16, not {self.mtp_bits}")
        if self.q_bits not in (2, 3, 4, 5, 6, 8):
            raise MTPError(
                f"quantization bits must be 2, 3, 4, 5, 6 or 8, not {self.q_bits}"
            )
        if self.q_group_size not in (32, 64, 128):
            raise MTPError(f"group size must be 32, 64 or 128, not {self.q_group_size}")


def is_quantized(module: nn.Module) -> bool:
    return (
        hasattr(module, "bits") and hasattr(module, "group_size") and "scales" in module
    )


def quantized_modules(model: nn.Module) -> Dict[str, Dict[str, Any]]:
    """Module path -> its quantization parameters, for every quantized module."""
    return {
        path: {
            "group_size": m.group_size,
            "bits": m.bits,
            "mode": getattr(m, "mode", "affine"),
        }
        for path, m in model.named_modules()
        if is_quantized(m)
    }


def cast(model: nn.Module, dtype: Optional[str]) -> None:
    if dtype is None:
        return
    target = getattr(mx, dtype)
    predicate = getattr(model, "cast_predicate", lambda _: True)

    def to(path, v):
        if predicate(path) and mx.issubdtype(v.dtype, mx.floating):
            return v.astype(target)
        return v

    model.update(tree_map_with_path(to, model.parameters()))


def quantize(model: nn.Module, group_size: int, bits: int, own=None) -> None:
    """Quantize every float module whose input width the group size divides.

    ``own``: the model's ``quant_predicate`` (path, module -> False, True or
    the module's own parameters), which mlx-vlm's converter follows (0.7.10,
    ``quant_utils.quantize_model``): Qwen3.5 MoE's router gates at 8 bits.
    A module whose width the default group or its own does not divide stays
    a float there too.
    """

    def predicate(path, module):
        if not hasattr(module, "to_quantized"):
            return False
        width = module.weight.shape[-1]
        if width % group_size:
            return False
        asked = True if own is None else own(path, module)
        if isinstance(asked, dict):
            if width % asked.get("group_size", group_size):
                return False
            return {"group_size": group_size, "bits": bits, **asked}
        return bool(asked)

    nn.quantize(model, group_size, bits, class_predicate=predicate)


def dequantize(model: nn.Module) -> None:
    from mlx_lm.utils import dequantize_model

    dequantize_model(model)


def apply_trunk(model: nn.Module, p: Precision, as_vlm: bool = False) -> None:
    """``as_vlm``: the text model of a vision checkpoint, quantized as
    mlx-vlm's converter quantizes it (``quantize``'s ``own``)."""
    if p.dequantize:
        dequantize(model)
    cast(model, p.dtype)
    if p.quantize:
        own = getattr(model, "quant_predicate", None) if as_vlm else None
        quantize(model, p.q_group_size, p.q_bits, own)
    elif p.nearest:
        quantize_nearest(model, p.nearest)


GGUF_FLOATS = ("F64", "F32", "F16", "BF16")
NEAREST_GROUP = 32  # the block of every GGUF type (K-quants: their sub-blocks)


def nearest_bits(gguf_type: str) -> Optional[int]:
    """MLX bits that hold a GGUF type's values without losing bits (None: a float).

    4-bit and narrower linear grids (Q4_0, Q4_1, Q4_K, Q3_K, Q2_K, the ternary
    TQ types) fit 4-bit affine groups of 32; Q5_*, Q6_K (16-value sub-blocks
    with their own scales), Q8_* and the non-linear IQ and MXFP4 grids keep
    their values only at 8 bits.
    """
    if gguf_type in GGUF_FLOATS:
        return None
    if gguf_type.startswith(("Q2_", "Q3_", "Q4_", "TQ")):
        return 4
    return 8


def quantize_nearest(model: nn.Module, bits: Dict[str, Optional[int]]) -> None:
    """Quantize each float module at its GGUF tensor's ``bits`` (``nearest``).

    A module under a name the GGUF did not use (renamed by the model's
    ``sanitize``) takes the file's most common width.
    """
    widths = [b for b in bits.values() if b]
    if not widths:
        return
    common = Counter(widths).most_common(1)[0][0]

    def predicate(path, module):
        if (
            not hasattr(module, "to_quantized")
            or module.weight.shape[-1] % NEAREST_GROUP
        ):
            return False
        b = bits.get(f"{path}.weight", common)
        if b is None:
            return False
        return {"group_size": NEAREST_GROUP, "bits": b, "mode": "affine"}

    nn.quantize(model, class_predicate=predicate)


def describe_nearest(types: Dict[str, str], full_dtype: str) -> Optional[str]:
    """One line saying what a quantized GGUF is written as, or None (all floats)."""
    counts = Counter(
        t
        for k, t in types.items()
        if nearest_bits(t) is not None and not k.endswith((".scales", ".biases"))
    )
    if not counts:
        return None
    names = [t for t, _ in counts.most_common()]
    main = nearest_bits(names[0])
    line = f"GGUF weights are {', '.join(names)}: writing {main}-bit MLX"
    line += f" (group {NEAREST_GROUP})"
    others = [t for t in names if nearest_bits(t) != main]
    for b in sorted({nearest_bits(t) for t in others}):
        line += f", {b}-bit for {', '.join(t for t in others if nearest_bits(t) == b)}"
    return f"{line}; --dtype {full_dtype} keeps full precision"


def apply_head(head: nn.Module, p: Precision, trunk_group: Optional[int]) -> None:
    """``trunk_group``: the trunk's group size when it is quantized, else None."""
    if p.dequantize or p.mtp_bits == 16:
        dequantize(head)
    cast(head, p.dtype)
    if trunk_group is not None and p.mtp_bits == 8 and not p.dequantize:
        quantize(head, trunk_group, 8)


def dominant(modules: Dict[str, Dict[str, Any]]) -> Optional[Tuple[int, int]]:
    """The most common (group_size, bits) among quantized modules."""
    if not modules:
        return None
    counts = Counter((q["group_size"], q["bits"]) for q in modules.values())
    return counts.most_common(1)[0][0]


def quantization_config(
    trunk: Dict[str, Dict[str, Any]], head: Dict[str, Dict[str, Any]]
) -> Optional[Dict[str, Any]]:
    """mlx-lm's ``config["quantization"]``: a default, plus every module that differs.

    Head modules are always listed under their checkpoint paths, which is
    where ``load_head_weights`` looks for them.
    """
    common = dominant(trunk) or dominant(head)
    if common is None:
        return None
    group_size, bits = common
    out: Dict[str, Any] = {"group_size": group_size, "bits": bits, "mode": "affine"}
    for path, q in trunk.items():
        if (q["group_size"], q["bits"]) != common or q["mode"] != "affine":
            out[path] = dict(q)
    out.update({path: dict(q) for path, q in head.items()})
    return out
