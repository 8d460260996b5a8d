"""The typer app, and how user errors reach the terminal: one line, exit 1."""

import sys

import typer

from mlx_mtp.errors import MTPError

app = typer.Typer(
    name="mlx-mtp",
    help="Multi-token-prediction speculative decoding on MLX.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)

# help panels shared by the commands
MODEL = "Model"
SAMPLING = "Sampling"
SPECULATIVE = "Speculative"
OUTPUT = "Output"


@app.callback()
def _root():
    """Multi-token-prediction speculative decoding on MLX."""


def fail(message: str) -> "typer.Exit":
    print(f"error: {message}", file=sys.stderr)
    return typer.Exit(1)


def run_app(args=None) -> int:
    try:
        # without standalone mode click hands typer.Exit's code back as a value
        code = app(args=args, standalone_mode=False)
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
        if type(e).__name__ == "Abort":
            return 130
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return code if isinstance(code, int) else 0
