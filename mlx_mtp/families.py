"""The MTP families, found as mlx-lm finds its models: no list to keep.

A family is a module of ``mlx_mtp.heads`` that declares ``MODEL_TYPES``, a
dict literal from each ``model_type`` it serves to the released models of
that type, and ``RELEASED_LAYERS`` where those checkpoints have more than one
MTP layer (each then drafts its own depth). Adding a family is adding its
module. The declarations are read from the modules' source with ``ast``,
so that listing the families (``mlx-mtp info``) imports no MLX.
"""

import ast
import sys
from functools import lru_cache
from pathlib import Path
from typing import Any, Dict, List, NamedTuple, Optional, Tuple


class Declared(NamedTuple):
    module: str
    model_types: Dict[str, str]  # model_type -> the released models
    layers: int


# Families whose checkpoints carry MTP layers that mlx-mtp cannot use yet, and why
NOT_YET: Dict[str, str] = {}


def declared() -> Tuple[Declared, ...]:
    """Every family module's declaration, in module name order."""
    return _scan(tuple(_search_path()))


def module_for(model_type: str) -> Optional[str]:
    """The name of the family module serving ``model_type``, if one does."""
    return next((d.module for d in declared() if model_type in d.model_types), None)


def model_types() -> List[str]:
    """Every ``model_type`` some family serves."""
    return [t for d in declared() for t in d.model_types]


def families() -> List[Dict[str, Any]]:
    """Every family with an MTP head: model_type, models, MTP layers, per depth."""
    return [
        {
            "model_type": model_type,
            "models": models,
            "mtp_layers": d.layers,
            "layer_per_depth": d.layers > 1,
        }
        for d in declared()
        for model_type, models in d.model_types.items()
    ]


def _search_path() -> List[str]:
    # mlx_mtp.heads's own path once it is imported (a test may add a folder)
    heads = sys.modules.get(f"{__package__}.heads")
    if heads is not None:
        return list(heads.__path__)
    return [str(Path(__file__).resolve().parent / "heads")]


@lru_cache(maxsize=4)
def _scan(path: Tuple[str, ...]) -> Tuple[Declared, ...]:
    found, owner = [], {}
    files = [f for folder in path for f in Path(folder).glob("*.py")]
    for file in sorted(files, key=lambda f: f.stem):
        d = _declaration(file)
        if d is None:
            continue
        for model_type in d.model_types:
            if model_type in owner:
                raise ValueError(
                    f"{model_type} is declared by {owner[model_type]} and {file}"
                )
            owner[model_type] = file
        found.append(d)
    return tuple(found)


def _declaration(file: Path) -> Optional[Declared]:
    """``file``'s ``MODEL_TYPES`` and ``RELEASED_LAYERS``; None if it declares none."""
    values = {}
    for node in ast.parse(file.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            name = getattr(node.targets[0], "id", None)
            if name in ("MODEL_TYPES", "RELEASED_LAYERS"):
                try:
                    values[name] = ast.literal_eval(node.value)
                except ValueError:
                    raise ValueError(f"{file}: {name} must be a literal") from None
    if "MODEL_TYPES" not in values:
        return None
    return Declared(file.stem, values["MODEL_TYPES"], values.get("RELEASED_LAYERS", 1))
