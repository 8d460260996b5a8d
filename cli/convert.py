"""``mlx-mtp convert``: GGUF or Hugging Face -> MLX folder, MTP head kept precise."""

import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import typer
from mlx_mtp.convert.precision import (
    DEFAULT_MTP_BITS,
    DEFAULT_Q_BITS,
    DEFAULT_Q_GROUP_SIZE,
    DTYPES,
)

from .app import MODEL, OUTPUT, app, fail

QUANT = "Quantization"


@app.command()
def convert(
    src: str = typer.Argument(
        ...,
        help="Hugging Face folder, Hub repo id, GGUF file (or a folder of "
        "llama.cpp's GGUF files), or a drafter folder (DFlash).",
    ),
    out: Optional[Path] = typer.Argument(
        None, help="MLX folder to write (not with --mtp-only)."
    ),
    mtp_gguf: Optional[Path] = typer.Option(
        None,
        "--mtp-gguf",
        help="A separate GGUF holding the MTP layer (llama.cpp's mtp-*.gguf; "
        "found beside a deepseek4 model file when not given).",
        rich_help_panel=MODEL,
    ),
    mtp_only: bool = typer.Option(
        False,
        "--mtp-only",
        help="Write only the MTP head of SRC into the MLX folder given by --into.",
        rich_help_panel=MODEL,
    ),
    into: Optional[Path] = typer.Option(
        None,
        "--into",
        help="Existing MLX folder that receives the head (with --mtp-only).",
        rich_help_panel=MODEL,
    ),
    quantize: bool = typer.Option(
        False,
        "--quantize",
        "-q",
        help="Quantize the trunk (a drafter: its linear layers, at 4 or 8 bits). "
        "A quantized GGUF stays quantized without it, at its own widths.",
        rich_help_panel=QUANT,
    ),
    q_bits: int = typer.Option(
        DEFAULT_Q_BITS,
        "--q-bits",
        help="Bits per weight of the quantized trunk.",
        rich_help_panel=QUANT,
    ),
    q_group_size: int = typer.Option(
        DEFAULT_Q_GROUP_SIZE,
        "--q-group-size",
        help="Group size of the quantized trunk.",
        rich_help_panel=QUANT,
    ),
    dtype: Optional[str] = typer.Option(
        None,
        "--dtype",
        metavar="|".join(DTYPES),
        show_default="the source's; GGUF: float16, float32 where MLX has no GPU",
        help="Float type of the float weights (a GGUF without -q: every weight).",
        rich_help_panel=QUANT,
    ),
    mtp_bits: int = typer.Option(
        DEFAULT_MTP_BITS,
        "--mtp-bits",
        help="MTP block precision when the trunk is quantized: 8 (8-bit) or 16 "
        "(unquantized).",
        rich_help_panel=QUANT,
    ),
    dequantize: bool = typer.Option(
        False,
        "--dequantize",
        help="Store every weight unquantized.",
        rich_help_panel=QUANT,
    ),
    force: bool = typer.Option(
        False,
        "--force",
        help="Replace OUT when it holds a model or is empty (with --mtp-only: the "
        "head in --into).",
        rich_help_panel=OUTPUT,
    ),
):
    """Convert a GGUF file or Hugging Face model to an MLX folder with its MTP head."""
    from mlx_mtp.convert import add_mtp
    from mlx_mtp.convert import convert as convert_model

    start = time.perf_counter()
    if mtp_only:
        if into is None or out is not None:
            raise fail("--mtp-only takes SRC and --into MLX_FOLDER, no OUT")
        if quantize or dequantize or mtp_gguf is not None:
            raise fail(
                "--mtp-only keeps the trunk as it is: no -q, --dequantize or --mtp-gguf"
            )
        with said_if_interrupted(into):
            written = add_mtp(src, into, mtp_bits=mtp_bits, dtype=dtype, force=force)
        print(
            f"wrote {written} in {time.perf_counter() - start:.1f} s", file=sys.stderr
        )
        _summary(into)
        return
    if out is None:
        raise fail("missing OUT: the MLX folder to write")
    if into is not None:
        raise fail("--into goes with --mtp-only")
    if dtype is not None and not quantize and _is_gguf_file(src):
        dequantize = True  # an explicit dtype asks for full precision in it
    with said_if_interrupted(out):
        written = convert_model(
            src,
            out,
            quantize=quantize,
            q_bits=q_bits,
            q_group_size=q_group_size,
            dtype=dtype,
            mtp_bits=mtp_bits,
            dequantize=dequantize,
            mtp_gguf=mtp_gguf,
            force=force,
            progress=sys.stderr.isatty(),
            notify=lambda line: print(line, file=sys.stderr),
        )
    print(f"wrote {written} in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    _summary(written)


@contextmanager
def said_if_interrupted(target: Path):
    """Ctrl-C: one line saying the target is untouched, exit status 130.

    The folder is built aside and renamed into place (the files of --mtp-only
    are written aside and renamed in together): an interrupted run leaves
    what was there before.
    """
    existed = target.exists()
    try:
        yield
    except KeyboardInterrupt:
        kept = "is as it was" if existed else "was not written"
        print(f"interrupted: {target} {kept}", file=sys.stderr)
        raise typer.Exit(130) from None


def _is_gguf_file(src: str) -> bool:
    """A GGUF file, or a folder of llama.cpp's GGUF files (no config.json)."""
    from mlx_mtp.convert.pipeline import is_gguf

    path = Path(src)
    if path.is_dir():
        return not (path / "config.json").exists() and any(path.glob("*.gguf"))
    return path.is_file() and is_gguf(path)


def _summary(path: Path) -> None:
    from mlx_mtp.convert.describe import describe, format_precision, format_size

    info = describe(path)
    if info.drafter:
        print(
            f"{info.architecture}: {info.layers} layers, weights "
            f"{format_precision(info.trunk_precision)}; "
            f"{format_size(info.size_bytes)} on disk",
            file=sys.stderr,
        )
        return
    mtp = format_precision(info.mtp_precision) if info.mtp_layers else "none"
    tower = ""
    if info.vision_precision:
        tower = f"; vision tower {format_precision(info.vision_precision)}"
    print(
        f"{info.architecture}: {info.layers} layers, "
        f"trunk {format_precision(info.trunk_precision)}; MTP layers "
        f"{info.mtp_layers} ({mtp}){tower}; {format_size(info.size_bytes)} on disk",
        file=sys.stderr,
    )
