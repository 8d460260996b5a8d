"""``mlx-mtp info``: architecture, layers, MTP layers and precision per part."""

import json
from pathlib import Path
from typing import Optional

import typer

from .app import OUTPUT, app


def info_lines(info) -> list:
    from mlx_mtp.convert.describe import format_precision, format_size

    if info.drafter:
        return _drafter_lines(info, format_precision, format_size)
    return [
        ("path", f"{info.path} ({info.format})"),
        ("architecture", info.architecture),
        ("layers", str(info.layers)),
        ("MTP layers", _mtp_layers(info)),
        (
            "trunk",
            f"{format_precision(info.trunk_precision)} "
            f"({format_size(info.trunk_bytes)})",
        ),
        (
            "MTP",
            f"{format_precision(info.mtp_precision)} ({format_size(info.mtp_bytes)})"
            if info.mtp_layers
            else "none",
        ),
        *_vision_line(info, format_precision, format_size),
        ("size on disk", format_size(info.size_bytes)),
    ]


def _vision_line(info, format_precision, format_size) -> list:
    if not info.vision_precision:
        return []
    precision = format_precision(info.vision_precision)
    return [("vision tower", f"{precision} ({format_size(info.vision_bytes)})")]


def _drafter_lines(info, format_precision, format_size) -> list:
    d = info.drafter
    made_for = d.get("num_target_layers")
    reads = ", ".join(map(str, d.get("target_layer_ids", [])))
    lines = [
        ("path", f"{info.path} ({info.format})"),
        ("architecture", info.architecture),
        ("layers", str(info.layers)),
    ]
    if "block_size" in d:
        lines.append(
            ("block size", f"{d['block_size']} ({d['block_size'] - 1} drafts)")
        )
    if reads:
        target = f" of a {made_for}-layer target" if made_for else ""
        lines.append(("reads", f"layers {reads}{target}"))
    return lines + [
        (
            "weights",
            f"{format_precision(info.trunk_precision)} "
            f"({format_size(info.trunk_bytes)})",
        ),
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
    path: Optional[Path] = typer.Argument(
        None,
        help="GGUF file, Hugging Face folder, MLX folder or drafter folder (none: "
        "the MTP families).",
    ),
    as_json: bool = typer.Option(
        False, "--json", help="Print one JSON object.", rich_help_panel=OUTPUT
    ),
):
    """Show a model's architecture, layers, MTP layers, precision per part and size."""
    if path is None:
        from mlx_mtp.families import families

        rows = families()
        if as_json:
            print(json.dumps(rows))
            return
        types = max(len(r["model_type"]) for r in rows)
        names = max(len(r["models"]) for r in rows)
        for row in rows:
            depth = ", layer j drafts depth j + 1" if row["layer_per_depth"] else ""
            print(
                f"{row['model_type']:<{types}}  {row['models']:<{names}}  MTP layers: "
                f"{row['mtp_layers']}{depth}"
            )
        return
    from mlx_mtp.convert.describe import describe

    described = describe(path)
    if as_json:
        print(json.dumps(described.to_dict()))
        return
    for key, value in info_lines(described):
        print(f"{key:<13} {value}")
