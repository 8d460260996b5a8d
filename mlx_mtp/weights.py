"""Reading weight files: safetensors checked by name before they are read.

Below both the loader and the drafters, which read checkpoints alike.
"""

import json
from pathlib import Path
from typing import Dict

import mlx.core as mx

from .errors import MTPError, first_line


def check_safetensors(path: Path) -> None:
    """Read only the header: a truncated or corrupt file fails here, by name."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if n <= 0 or 8 + n > size:
                raise ValueError("header runs past the end of the file")
            header = json.loads(f.read(n))
        end = max(
            (v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"),
            default=0,
        )
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise MTPError(
            f"{path}: not a valid safetensors file ({first_line(e)})"
        ) from None
    if 8 + n + end > size:
        raise MTPError(
            f"{path}: truncated ({size} bytes, the header promises {8 + n + end})"
        )


def read_safetensors(files) -> Dict[str, mx.array]:
    weights = {}
    for f in sorted(files):
        check_safetensors(Path(f))
        try:
            weights.update(mx.load(str(f)))
        except Exception as e:  # mx.load raises bare RuntimeError/ValueError
            raise MTPError(f"{f}: cannot read safetensors ({first_line(e)})") from None
    return weights
