"""``mlx-mtp info`` without a path lists every MTP family and its layer count."""

import json

from mlx_mtp.cli.app import run_app

from mlx_mtp.families import families
from mlx_mtp.heads import family_for, supported_model_types


def test_info_lists_every_family(capsys):
    assert run_app(["info", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert sorted(r["model_type"] for r in rows) == sorted(supported_model_types())
    # every listed type is served by the module that declares it
    assert all(r["model_type"] in family_for(r["model_type"]).MODEL_TYPES for r in rows)
    by_type = {r["model_type"]: r for r in rows}
    assert (
        by_type["step3p5"]["mtp_layers"] == 3 and by_type["step3p5"]["layer_per_depth"]
    )
    assert by_type["qwen3_5"]["mtp_layers"] == 1
    assert run_app(["info"]) == 0
    text = capsys.readouterr().out
    assert "mimo_v2_flash" in text and "MiMo-V2-Flash" in text


def test_the_family_list_is_aligned_and_loads_no_model_code():
    import subprocess
    import sys

    code = (
        "import sys; from mlx_mtp.cli.app import run_app; run_app(['info']);"
        "print(sorted(m for m in ('mlx', 'mlx_lm', 'mlx.core') if m in sys.modules))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    *lines, loaded = r.stdout.strip().splitlines()
    assert loaded == "[]", "listing the families imported MLX"
    columns = {line.index("MTP layers:") for line in lines}
    assert len(lines) == len(families()) and len(columns) == 1, lines


def test_the_readme_marks_kimi_linear_as_borrowing_kimi_k3s_wiring():
    """No public runtime applies an MTP model to ``kimi_linear`` (vLLM routes
    only ``kimi_k3`` to one): the README's table says so."""
    from pathlib import Path

    readme = (Path(__file__).parent.parent / "README.md").read_text()
    row = next(line for line in readme.splitlines() if "`kimi_linear`" in line)
    models, model_type = [cell.strip() for cell in row.split("|")[1:3]]
    assert model_type == "`kimi_linear`"  # a row of its own, not Kimi-K3's
    assert "unverified" in models and "routes only `kimi_k3`" in models
