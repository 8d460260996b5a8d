"""The typer app, which commands it loads, and how user errors reach the terminal.

A user error is one line on stderr and exit status 1. Only the command that
runs is imported (several import mlx-lm, which takes seconds): the command
list of ``mlx-mtp --help`` comes from ``COMMANDS``.
"""

import importlib
import sys
from importlib import metadata
from typing import List, Optional

import typer
from typer.core import TyperCommand, TyperGroup

from mlx_mtp.errors import MTPError
from mlx_mtp.sampling_params import SAMPLING, SPECULATIVE, SamplingError  # noqa: F401

# name: (module in this package, one-line help = the first line of its docstring)
COMMANDS = {
    "generate": ("generate", "Generate text with MTP speculative decoding."),
    "chat": (
        "chat",
        "Chat with a model in the terminal, with MTP speculative decoding.",
    ),
    "cache-prompt": (
        "cache_prompt",
        "Read a prompt once (trunk, MTP head, drafters) and write its cache to a file.",
    ),
    "bench": (
        "bench",
        "Benchmark mlx-lm's generation, mlx-mtp without and with MTP, side by side.",
    ),
    "serve": (
        "serve",
        "Serve a model over an OpenAI-compatible API, with MTP, many requests at once.",
    ),
    "tune": (
        "tune",
        "Measure what drafting costs and gains for a model on this machine, and store it.",
    ),
    "convert": (
        "convert",
        "Convert a GGUF file or Hugging Face model to an MLX folder with its MTP head.",
    ),
    "info": (
        "info",
        "Show a model's architecture, layers, MTP layers, precision per part and size.",
    ),
    "train-head": (
        "train_head",
        "Train a DeepSeek-style MTP head for a model, its trunk frozen.",
    ),
}

# help panels shared by the commands
MODEL = "Model"
OUTPUT = "Output"


def _tidy_help(params) -> None:
    """A flag shows no type; an argument shows as its upper-case name."""
    for p in params:
        if p is None or p.metavar is not None:
            continue
        if p.param_type_name == "argument":
            p.metavar = p.name.upper()
        elif getattr(p, "is_flag", False):
            p.metavar = ""


class Group(TyperGroup):
    def get_params(self, ctx):
        params = super().get_params(ctx)
        _tidy_help(params)
        return params


class Command(TyperCommand):
    """Help that shows flags as flags and arguments as ``SRC [OUT]``."""

    def get_params(self, ctx):
        params = super().get_params(ctx)
        _tidy_help(params)
        return params

    def collect_usage_pieces(self, ctx) -> List[str]:
        pieces = [self.options_metavar] if self.options_metavar else []
        for p in self.get_params(ctx):
            if p.param_type_name == "argument":
                pieces.append(p.metavar if p.required else f"[{p.metavar}]")
        return pieces


class App(typer.Typer):
    def command(self, *args, **kwargs):
        kwargs.setdefault("cls", Command)
        return super().command(*args, **kwargs)


def version_line() -> str:
    def version(dist: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "not installed"

    from mlx_mtp import __version__

    return f"mlx-mtp {__version__} (mlx {version('mlx')}, mlx-lm {version('mlx-lm')})"


def _print_version(value: bool) -> None:
    if value:
        print(version_line())
        raise typer.Exit()


def _new_app() -> App:
    new = App(
        name="mlx-mtp",
        cls=Group,
        help="Multi-token-prediction speculative decoding on MLX.",
        no_args_is_help=True,
        pretty_exceptions_enable=False,
        add_completion=False,
    )

    @new.callback()
    def _root(
        version: bool = typer.Option(
            False,
            "--version",
            callback=_print_version,
            is_eager=True,
            help="Print the versions of mlx-mtp, MLX and mlx-lm, then exit.",
        ),
    ):
        """Multi-token-prediction speculative decoding on MLX."""

    return new


app = _new_app()
_loaded: set = set()


def load_commands(names=None) -> None:
    """Import the modules of the commands ``names`` (all by default)."""
    for name in COMMANDS if names is None else names:
        module = COMMANDS[name][0]
        if module not in _loaded:
            importlib.import_module(f"{__package__}.{module}")
            _loaded.add(module)


def _app_for(args: List[str]) -> typer.Typer:
    """``app`` with the command that ``args`` name, or a list of all commands."""
    name = next((a for a in args if not a.startswith("-")), None)
    if name in COMMANDS:
        load_commands([name])
        return app
    if len(_loaded) == len(COMMANDS):
        return app
    listing = _new_app()
    for command, (_, short) in COMMANDS.items():
        listing.command(command, help=short)(lambda: None)
    return listing


def fail(message: str) -> "typer.Exit":
    print(f"error: {message}", file=sys.stderr)
    return typer.Exit(1)


def run_app(args: Optional[List[str]] = None) -> int:
    args = sys.argv[1:] if args is None else [str(a) for a in args]
    try:
        # without standalone mode click hands typer.Exit's code back as a value
        code = _app_for(args)(args=args, standalone_mode=False)
    except SamplingError as e:  # found with the model (a logit bias's id): by flag
        print(f"error: {e.named(e.param.flag or e.param.name)}", file=sys.stderr)
        return 1
    except MTPError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except typer.Exit as e:
        return e.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # click usage errors and anything unexpected
        if hasattr(e, "show") and hasattr(e, "exit_code"):  # click's own errors
            e.show()
            return e.exit_code
        if type(e).__name__ == "Abort":  # click's word for Ctrl-C
            print("interrupted", file=sys.stderr)
            return 130
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return code if isinstance(code, int) else 0
