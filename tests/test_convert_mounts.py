"""``convert`` into a folder that is a mount point (a mounted drive, a container
volume): written in place on that file system, never a raw cross-device error.

Each case runs the real command in a private mount namespace (``unshare``)
with a tmpfs mounted on the target; skipped where namespaces are not allowed.
"""

import shutil
import subprocess
import sys

import pytest
import tiny_plain
from gguf import GGMLQuantizationType as Q

pytestmark = pytest.mark.slow  # end-to-end: see pyproject's markers


def _can_mount(tmp_path) -> bool:
    if shutil.which("unshare") is None:
        return False
    d = tmp_path / "probe"
    d.mkdir()
    r = subprocess.run(
        ["unshare", "-rm", "sh", "-c", f"mount -t tmpfs none {d}"],
        capture_output=True,
    )
    return r.returncode == 0


@pytest.fixture
def gguf(tmp_path):
    if not _can_mount(tmp_path):
        pytest.skip("no mount namespaces here")
    config, weights = tiny_plain.plain_weights("llama")
    return tiny_plain.write_gguf(tmp_path / "m.gguf", "llama", config, weights, Q.Q8_0)


def convert_on_mount(tmp_path, gguf, options: str, *runs: str):
    """Mount a tmpfs (``options``) on ``tmp_path/vol``, then run each of ``runs``
    (arguments after ``convert GGUF VOL``); returns their results and what the
    mount held afterwards."""
    vol = tmp_path / "vol"
    vol.mkdir(exist_ok=True)
    convert = f"{sys.executable} -m mlx_mtp convert {gguf} {vol}"
    script = [f"mount -t tmpfs -o {options} none {vol} || exit 99"]
    for i, args in enumerate(runs):
        script.append(
            f"{convert} {args} >{tmp_path}/out{i} 2>{tmp_path}/err{i};"
            f" echo $? >{tmp_path}/rc{i}"
        )
    script.append(f"ls -A {vol} >{tmp_path}/listing")
    r = subprocess.run(["unshare", "-rm", "sh", "-c", "\n".join(script)], cwd=tmp_path)
    assert r.returncode != 99
    results = [
        (
            int((tmp_path / f"rc{i}").read_text()),
            (tmp_path / f"err{i}").read_text(),
        )
        for i in range(len(runs))
    ]
    return results, (tmp_path / "listing").read_text().split()


def test_convert_into_an_empty_mount_point(gguf, tmp_path):
    (first, again), listing = convert_on_mount(
        tmp_path, gguf, "size=64m", "--force", "--force --dequantize"
    )
    assert first[0] == 0, first[1]
    assert again[0] == 0, again[1]  # a model there: replaced in place
    assert "Traceback" not in first[1] + again[1]
    assert "config.json" in listing and any(n.endswith(".safetensors") for n in listing)
    assert not [n for n in listing if ".tmp-" in n or ".old-" in n]


def test_read_only_mount_point_fails_before_the_work(gguf, tmp_path):
    ((code, err),), listing = convert_on_mount(tmp_path, gguf, "ro", "--force")
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 1, err
    assert lines[0].startswith("error: cannot write into ") and "vol" in lines[0]
    assert listing == []
