"""The ``mlx-mtp`` command line: a thin typer layer over the Python API.

Each command lives in its own module and registers itself on ``app``.
"""

import sys

from .app import app, run_app

# Importing a command module registers its command.
from . import generate as _generate  # noqa: E402,F401

for _name in ("info", "convert", "chat", "bench", "train_head", "serve"):
    try:
        __import__(f"{__name__}.{_name}")
    except ModuleNotFoundError as e:  # a command not built yet
        if e.name != f"{__name__}.{_name}":
            raise


__all__ = ["app", "main", "run_app"]


def main() -> None:
    sys.exit(run_app())
