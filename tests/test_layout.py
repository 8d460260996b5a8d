"""A source checkout runs as it is, and its comments cite only what it holds."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_checkout_runs_from_its_root():
    # `python -m` from the root puts the checkout's mlx_mtp/ first on sys.path,
    # ahead of any installed copy: it must still find cli/, convert/ and metal/.
    code = (
        "import mlx_mtp, mlx_mtp.cli, mlx_mtp.convert, mlx_mtp.recurrent.kernels as k;"
        "print(mlx_mtp.cli.__file__); print(len(k.source('ssm_keep.metal')))"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    path, size = r.stdout.split()
    assert Path(path).resolve() == ROOT / "cli" / "__init__.py"
    assert int(size) > 0
    r = subprocess.run(
        [sys.executable, "-m", "mlx_mtp", "--version"],
        cwd=ROOT, env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert r.returncode == 0 and r.stdout.startswith("mlx-mtp "), r.stderr


def test_no_comment_cites_a_file_outside_the_repository():
    cited = re.compile(r"\b(DESIGN|MEASURE|STYLE)\.md\b|\.\./shared|seeds/")
    found = []
    for folder in ("mlx_mtp", "cli", "convert", "metal", "scripts", "tests", "docs"):
        for path in (ROOT / folder).rglob("*"):
            if path.suffix not in (".py", ".md", ".metal", ".cu") or path == Path(__file__):
                continue
            for i, line in enumerate(path.read_text().splitlines(), 1):
                if cited.search(line):
                    found.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    for path in (ROOT / "README.md",):
        if cited.search(path.read_text()):
            found.append(str(path))
    assert found == []
