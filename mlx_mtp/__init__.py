"""mlx-mtp: multi-token-prediction speculative decoding on MLX.

The API below is imported on first use: ``import mlx_mtp`` alone loads
neither MLX nor mlx-lm, which keeps ``mlx-mtp --help`` fast.
"""

import importlib
import sys
import types
from pathlib import Path
from typing import TYPE_CHECKING

from .defaults import VERSION as __version__  # noqa: F401

# A source checkout keeps cli/, convert/ and metal/ beside this folder; they
# install as mlx_mtp.cli, mlx_mtp.convert and mlx_mtp.metal. When the checkout's
# own mlx_mtp/ is the one imported (a script or `python -m` run from its root,
# which puts the root first on sys.path), it finds them there, instead of
# failing on a missing mlx_mtp.cli or mixing with an installed copy.
_CHECKOUT = Path(__file__).resolve().parent.parent
if (_CHECKOUT / "pyproject.toml").is_file() and (
    _CHECKOUT / "cli" / "app.py"
).is_file():
    __path__.append(str(_CHECKOUT))

_EXPORTS = {
    "BatchResponse": "batch",
    "ChatSession": "chat",
    "DEFAULT_DRAFT_MAX": "defaults",
    "DraftRound": "stats",
    "GenerationResponse": "generate",
    "MTPCache": "cache",
    "StreamCache": "cache",
    "MTPError": "errors",
    "MTPModel": "loader",
    "MTPStats": "stats",
    "SamplingConfig": "sampling",
    "batch_generate": "batch",
    "cache_prompt": "prompt_file",
    "default_model_path": "convert.default_model",
    "draft_logits": "generate",
    "generate": "generate",
    "load": "convert.default_model",
    "load_model": "loader",
    "mtp_logits": "generate",
    "speculative_generate_step": "speculative",
    "stream_generate": "generate",
}
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:  # what __getattr__ returns
    from .batch import BatchResponse, batch_generate  # noqa: F401
    from .cache import MTPCache, StreamCache  # noqa: F401
    from .prompt_file import cache_prompt  # noqa: F401
    from .chat import ChatSession  # noqa: F401
    from .convert.default_model import default_model_path, load  # noqa: F401
    from .defaults import DEFAULT_DRAFT_MAX  # noqa: F401
    from .errors import MTPError  # noqa: F401
    from .generate import (  # noqa: F401
        GenerationResponse,
        draft_logits,
        generate,
        mtp_logits,
        stream_generate,
    )
    from .loader import MTPModel, load_model  # noqa: F401
    from .sampling import SamplingConfig  # noqa: F401
    from .speculative import speculative_generate_step  # noqa: F401
    from .stats import DraftRound, MTPStats  # noqa: F401


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value


class _Package(types.ModuleType):
    def __setattr__(self, name, value):
        # Importing the submodule ``mlx_mtp.generate`` sets it as an attribute
        # of the package; the function ``mlx_mtp.generate`` keeps the name.
        if name in _EXPORTS and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
