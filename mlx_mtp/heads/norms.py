"""Head norms stored in the wrong convention, judged against the trunk's own norms.

An RMSNorm scales by ``w`` (plain) or by ``1 + w`` (zero-centred: Qwen3-Next/3.5,
Step-3.5, Gemma). A converter that writes one where the head reads the other
shifts every scale by one: a Qwen3.6 head once shipped with plain weights in
a zero-centred slot drafted with 0% acceptance (97% after the fix). Real norm
scales sit near the trunk's, so a head norm whose scale is about one away
from them, and right when read the other way, is in the wrong convention.
``convert`` fixes it; loading refuses it, naming the tensor.
"""

from typing import Any, Dict, List, Tuple

import mlx.core as mx
import mlx.nn as nn

from ..errors import MTPError

# how far (in mean scale) a zero-centred head norm must sit from the trunk's to
# be suspect, and how close (relative to the trunk's scale) its other reading
GAP = 0.5
CLOSER = 0.25


def _zero_centred(module: nn.Module) -> bool:
    return type(module).__name__ == "ZeroCentredRMSNorm"


def _norms(module: nn.Module):
    for path, m in module.named_modules():
        w = m.get("weight") if isinstance(m, nn.Module) else None
        if (
            "norm" in type(m).__name__.lower()
            and isinstance(w, mx.array)
            and w.ndim == 1
            and mx.issubdtype(w.dtype, mx.floating)
        ):
            yield path, m


def _scale(m: nn.Module) -> float:
    """The mean factor the norm multiplies by."""
    return float(mx.mean(m.weight.astype(mx.float32))) + (
        1.0 if _zero_centred(m) else 0.0
    )


def trunk_scale(trunk: nn.Module, width: int = 0) -> float:
    """The trunk's typical norm scale, over its norms ``width`` wide if it has any.

    mlx-lm stores trunk norms as the factor itself (its sanitize adds the 1).
    """
    norms = [m for _, m in _norms(trunk)]
    same = [m for m in norms if m.weight.shape[0] == width]
    scales = sorted(_scale(m) for m in same or norms)
    return scales[len(scales) // 2] if scales else 1.0


def misplaced(
    head: Any, prefixes: List[str], trunk: nn.Module
) -> List[Tuple[str, nn.Module, float]]:
    """(checkpoint name, norm, shift to apply) for every head norm in the wrong convention.

    ``prefixes[j]`` is where layer ``j``'s tensors live in the checkpoint.
    """
    seen, out = set(), []
    for j, prefix in enumerate(prefixes):
        for path, m in _norms(head.layer(j)):
            if id(m) in seen:  # modules the layers share
                continue
            seen.add(id(m))
            target = trunk_scale(trunk, m.weight.shape[0])
            shift = _misplaced_by(_scale(m), target, _zero_centred(m))
            if shift:
                name = prefix + path.removeprefix("block.") + ".weight"
                out.append((name, m, shift))
    return out


def _misplaced_by(scale: float, target: float, zero_centred: bool) -> float:
    """The shift that puts the norm back in its convention, or 0 when it is in it.

    A zero-centred norm read as ``1 + w`` from the factor ``1 + w`` sits about
    one above the trunk (or one below when the 1 was taken twice); right, it
    sits near it. A plain norm stored zero-centred scales by about 0. Trained
    norms stray from the trunk's, so only a shift that lands within a quarter
    of the trunk's own scale counts.
    """
    tolerance = CLOSER * abs(target)
    if zero_centred:
        shift = -1.0 if scale > target else 1.0
        far = abs(scale - target) > GAP
        return shift if far and abs(scale + shift - target) < tolerance else 0.0
    near_zero = abs(scale) < tolerance
    return 1.0 if near_zero and abs(scale + 1 - target) < tolerance else 0.0


def describe(name: str, m: nn.Module, trunk: nn.Module) -> str:
    kind = "zero-centred (1 + w)" if _zero_centred(m) else "plain (w)"
    target = trunk_scale(trunk, m.weight.shape[0])
    return (
        f"{name}: the head reads it as {kind} but it is stored the other way "
        f"(mean scale {_scale(m):.2f}, the trunk's norms {target:.2f})"
    )


def check(head: Any, prefixes: List[str], trunk: nn.Module) -> None:
    """Refuse a head with a norm in the wrong convention (one line, naming it)."""
    wrong = misplaced(head, prefixes, trunk)
    if wrong:
        name, m, _ = wrong[0]
        raise MTPError(
            describe(name, m, trunk) + "; convert it again (mlx-mtp convert fixes it)"
        )


def fix(head: Any, prefixes: List[str], trunk: nn.Module) -> List[str]:
    """Shift every misplaced head norm into its convention; one line per tensor fixed."""
    notes = []
    for name, m, shift in misplaced(head, prefixes, trunk):
        notes.append(describe(name, m, trunk) + ": fixed")
        m.weight = m.weight + shift
    return notes


def layer_prefixes(family: Any, config: Dict[str, Any], head: Any) -> List[str]:
    return [family.prefix(config, j) for j in range(head.num_layers)]
