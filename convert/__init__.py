"""Conversion of Hugging Face folders and GGUF files into MLX folders with MTP heads.

Imported on first use (see ``mlx_mtp/__init__.py``): the command line reads
the defaults in ``precision`` without loading mlx-lm.
"""

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "HEAD_FILE": "pipeline",
    "Precision": "precision",
    "add_mtp": "mtp_only",
    "convert": "pipeline",
    "convert_gguf": "pipeline",
    "convert_source": "pipeline",
}
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:  # what __getattr__ returns
    from .mtp_only import add_mtp  # noqa: F401
    from .pipeline import HEAD_FILE, convert, convert_gguf, convert_source  # noqa: F401
    from .precision import Precision  # noqa: F401


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value
