"""``mlx-mtp info``: architecture, layers, MTP layers and precision per part of a model."""

import json
from pathlib import Path
from typing import Optional

import typer

from mlx_mtp.convert.describe import describe, families, format_precision, format_size

from .app import OUTPUT, app


def info_lines(info) -> list:
    return [
        ("path", f"{info.path} ({info.format})"),
        ("architecture", info.architecture),
        ("layers", str(info.layers)),
        ("MTP layers", str(info.mtp_layers) if info.mtp_layers else "none"),
        ("trunk", f"{format_precision(info.trunk_precision)} ({format_size(info.trunk_bytes)})"),
        ("MTP", f"{format_precision(info.mtp_precision)} ({format_size(info.mtp_bytes)})"
         if info.mtp_layers else "none"),
        ("size on disk", format_size(info.size_bytes)),
    ]


@app.command()
def info(
    path: Optional[Path] = typer.Argument(
        None, help="GGUF file, Hugging Face folder or MLX folder (none: the MTP families)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object.", rich_help_panel=OUTPUT),
):
    """Show a model's architecture, layers, MTP layers, precision per part and size."""
    if path is None:
        rows = families()
        if as_json:
            print(json.dumps(rows))
            return
        for row in rows:
            depth = ", layer j drafts depth j + 1" if row["layer_per_depth"] else ""
            print(f"{row['model_type']:<15} {row['models']:<22} MTP layers: "
                  f"{row['mtp_layers']}{depth}")
        return
    described = describe(path)
    if as_json:
        print(json.dumps(described.to_dict()))
        return
    for key, value in info_lines(described):
        print(f"{key:<13} {value}")
