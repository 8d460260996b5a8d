"""``mlx-mtp info``: architecture, layers, MTP layers and precision per part of a model."""

import json
from pathlib import Path

import typer

from .app import OUTPUT, app


def info_lines(info) -> list:
    from mlx_mtp.convert.describe import format_precision, format_size

    return [
        ("path", f"{info.path} ({info.format})"),
        ("architecture", info.architecture),
        ("layers", str(info.layers)),
        ("MTP layers", _mtp_layers(info)),
        ("trunk", f"{format_precision(info.trunk_precision)} ({format_size(info.trunk_bytes)})"),
        ("MTP", f"{format_precision(info.mtp_precision)} ({format_size(info.mtp_bytes)})"
         if info.mtp_layers else "none"),
        ("size on disk", format_size(info.size_bytes)),
    ]


def _mtp_layers(info) -> str:
    if not info.mtp_layers:
        return "none"
    if info.trained_head:
        return f"{info.mtp_layers} (a head trained by train-head: mtp_config.json)"
    return str(info.mtp_layers)


@app.command()
def info(
    path: Path = typer.Argument(..., help="GGUF file, Hugging Face folder or MLX folder."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object.", rich_help_panel=OUTPUT),
):
    """Show a model's architecture, layers, MTP layers, precision per part and size."""
    from mlx_mtp.convert.describe import describe

    described = describe(path)
    if as_json:
        print(json.dumps(described.to_dict()))
        return
    for key, value in info_lines(described):
        print(f"{key:<13} {value}")
