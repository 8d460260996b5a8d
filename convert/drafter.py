"""Drafter checkpoints (``mlx_mtp.drafters``: DFlash, ...) -> MLX folders.

A drafter converts on its own, without its target: its kind's module builds
it from its config (``make_model(config)``, parameters under the checkpoint's
names), its floats are cast (``dtype``) or its linear layers quantized
(``-q``, ``q_bits``: 4 or 8; norms and other tensors stay float), and the
folder keeps its config, with ``quantization`` for the loader. The same
module loads it later for a target (``--draft``).
"""

import importlib
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.utils import save_config

from mlx_mtp.drafters import read_drafter_config
from mlx_mtp.errors import MTPError, first_line

from .output import atomic_folder, check_target, writing
from .precision import Precision, cast, quantize

DRAFTER_BITS = (4, 8)


def convert_drafter(src: Path, out: Path, precision: Precision, force: bool) -> Path:
    """Write the drafter folder ``src`` to ``out`` at ``precision``."""
    src, out = Path(src), Path(out)
    if precision.dequantize:
        raise MTPError("--dequantize: a drafter is converted from its float weights")
    if precision.quantize and precision.q_bits not in DRAFTER_BITS:
        raise MTPError(f"a drafter quantizes to 4 or 8 bits, not {precision.q_bits}")
    check_target(out, force)
    config, kind = read_drafter_config(src)
    module = importlib.import_module(f"mlx_mtp.drafters.{kind}")
    try:
        model = module.make_model(config)
        weights = module.read_weights(src)
        module.with_weights(model, weights, config)
    except (ValueError, KeyError) as e:
        raise MTPError(
            f"{src}: not a drafter this kind reads ({first_line(e)})"
        ) from None
    if precision.quantize and "quantization" in config:
        raise MTPError(f"{src}: already quantized; convert the original folder")
    config = dict(config)
    cast(model, precision.dtype)
    if precision.dtype:
        config["torch_dtype"] = config["dtype"] = precision.dtype
    if precision.quantize:
        quantize(model, precision.q_group_size, precision.q_bits)
        config["quantization"] = {
            "group_size": precision.q_group_size,
            "bits": precision.q_bits,
            "mode": "affine",
        }
    tensors = dict(tree_flatten(model.parameters()))
    mx.eval(list(tensors.values()))
    with atomic_folder(out, force) as tmp:
        with writing(out):
            mx.save_safetensors(
                str(tmp / "model.safetensors"), tensors, metadata={"format": "mlx"}
            )
            save_config(config, tmp / "config.json")
    return out
