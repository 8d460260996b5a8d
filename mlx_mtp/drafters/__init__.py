"""Drafter kinds, found by the configs of their checkpoints.

A drafter is a second model (``drafter.Drafter``). One that comes as a
checkpoint of its own (a folder with ``config.json`` and safetensors) is
recognised by its own config, never by the target's ``model_type``: a kind
is a module here that declares ``KINDS``, a dict literal from each
``architectures`` entry or ``model_type`` it recognises to what it is, and
provides ``load(folder, config, target) -> Drafter``, which builds the
drafter for the loaded ``target`` and raises ``ValueError`` naming what does
not fit (hidden size, vocabulary, the target's layers it reads). Adding a
kind is adding its module: ``load_drafter`` finds it (as ``mlx_mtp.families``
finds head families, from the modules' source, importing only the one
used). The model's own MTP head becomes a drafter in ``head.py``.
"""

import ast
import hashlib
import importlib
import json
import sys
from functools import lru_cache
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

from ..errors import MTPError, first_line


def kinds() -> Dict[str, str]:
    """Every name a drafter config is recognised by -> its kind's module."""
    return dict(_scan(tuple(_search_path())))


def kind_of(config: Dict[str, Any]) -> Optional[str]:
    """The module of the drafter kind ``config`` is a checkpoint of, if any."""
    known = kinds()
    names = config.get("architectures") or []
    if isinstance(names, str):
        names = [names]
    for name in list(names) + [config.get("model_type")]:
        if isinstance(name, str) and name in known:
            return known[name]
    return None


def read_drafter_config(folder: Path) -> Tuple[Dict[str, Any], Optional[str]]:
    """A folder's config and the drafter kind it is (None: not a drafter)."""
    try:
        config = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return {}, None
    if not isinstance(config, dict):
        return {}, None
    return config, kind_of(config)


def is_drafter(folder: Path) -> bool:
    """Whether ``folder`` holds a drafter checkpoint of a known kind."""
    return Path(folder).is_dir() and read_drafter_config(folder)[1] is not None


def load_drafter(folder, target):
    """The drafter in ``folder``, built for the loaded ``target`` (an
    ``MTPModel``); a one-line ``MTPError`` naming both folders when ``folder``
    is no drafter or does not fit the target."""
    folder = Path(folder)
    where = f"{folder} (for {target.path or 'the model'})"
    if not folder.exists():
        raise MTPError(f"--draft {folder}: no such file or folder")
    if not folder.is_dir() or not (folder / "config.json").is_file():
        raise MTPError(f"--draft {folder}: not a drafter folder (no config.json)")
    config, kind = read_drafter_config(folder)
    if kind is None:
        named = config.get("architectures") or config.get("model_type") or "?"
        raise MTPError(
            f"--draft {folder}: not a drafter checkpoint mlx-mtp knows ({named}; "
            f"known: {', '.join(sorted(kinds())) or 'none'})"
        )
    module = importlib.import_module(f"{__name__}.{kind}")
    try:
        drafter = module.load(folder, config, target)
    except MTPError:
        raise
    except (ValueError, KeyError) as e:
        raise MTPError(
            f"--draft {where}: does not fit the model ({first_line(e)})"
        ) from None
    drafter.checkpoint = checkpoint_digest(folder)
    return drafter


def checkpoint_digest(folder: Path) -> str:
    """A digest of a drafter folder's config and weight files (names and
    sizes): what its measured costs are stored under (``Drafter.key``)."""
    digest = hashlib.sha256((folder / "config.json").read_bytes())
    for f in sorted(folder.glob("*.safetensors")):
        digest.update(f"{f.name}:{f.stat().st_size}".encode())
    return digest.hexdigest()[:12]


def _search_path():
    module = sys.modules.get(__name__)
    return list(module.__path__) if module is not None else [str(Path(__file__).parent)]


@lru_cache(maxsize=4)
def _scan(path: Tuple[str, ...]) -> Tuple[Tuple[str, str], ...]:
    found = {}
    for file in sorted(f for folder in path for f in Path(folder).glob("*.py")):
        for node in ast.parse(file.read_text(encoding="utf-8")).body:
            if (
                isinstance(node, ast.Assign)
                and len(node.targets) == 1
                and getattr(node.targets[0], "id", None) == "KINDS"
            ):
                for name in ast.literal_eval(node.value):
                    if name in found:
                        raise ValueError(
                            f"{name} is declared by {found[name]} and {file.stem}"
                        )
                    found[name] = file.stem
    return tuple(found.items())
