"""The ``mlx-mtp`` command line: a thin typer layer over the Python API.

Each command lives in its own module and registers itself on ``app``; a run
imports only the command it runs (see ``app.py``). ``mlx_mtp.cli.app`` is
the typer app with every command loaded.
"""

import sys

from . import app as _app

__all__ = ["app", "main", "run_app"]
globals().pop("app")  # the submodule: ``app`` is the typer app (``__getattr__``)

run_app = _app.run_app


def __getattr__(name: str):
    if name == "app":
        _app.load_commands()
        return _app.app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def main() -> None:
    sys.exit(run_app())
