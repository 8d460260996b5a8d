"""``mlx-mtp convert``: every flag reaches the conversion and shows in the output folder."""

import json
from pathlib import Path

import mlx.core as mx
import pytest
import tiny
import tiny_plain
from gguf import GGMLQuantizationType as Q
from mlx_mtp.cli.app import run_app

import mlx_mtp


def config_of(path):
    return json.loads((path / "config.json").read_text())


def run(capsys, *args):
    code = run_app(["convert", *map(str, args)])
    return code, capsys.readouterr()


@pytest.fixture(scope="module")
def src(tiny_folders):
    return tiny_folders("glm4_moe")[0]


def test_quantization_flags(src, tmp_path, capsys):
    out = tmp_path / "a"
    code, io = run(capsys, src, out, "-q", "--q-bits", 8, "--q-group-size", 32)
    assert code == 0, io.err
    quant = config_of(out)["quantization"]
    assert (quant["bits"], quant["group_size"]) == (8, 32)
    assert "MTP layers 1" in io.err

    code, io = run(
        capsys, src, tmp_path / "b", "-q", "--mtp-bits", 16, "--dtype", "bfloat16"
    )
    assert code == 0, io.err
    stored = mx.load(str(tmp_path / "b" / "mtp.safetensors"))
    assert not any(k.endswith(".scales") for k in stored)
    assert stored["model.layers.2.eh_proj.weight"].dtype == mx.bfloat16
    assert config_of(tmp_path / "b")["torch_dtype"] == "bfloat16"


def test_force_and_refusal(src, tmp_path, capsys):
    out = tmp_path / "o"
    assert run(capsys, src, out)[0] == 0
    code, io = run(capsys, src, out)
    assert code == 1 and io.err.startswith("error: ") and "--force" in io.err
    assert run(capsys, src, out, "--force", "-q")[0] == 0
    assert "quantization" in config_of(out)


def test_bad_flag_values_are_one_line_errors(src, tmp_path, capsys):
    for args in (["--mtp-bits", 4], ["--dtype", "int8"], ["-q", "--dequantize"]):
        code, io = run(capsys, src, tmp_path / "x", *args)
        assert code == 1 and io.err.startswith("error: ") and io.err.count("\n") == 1
    assert not any(tmp_path.iterdir())


def test_dequantize_gguf(tmp_path, capsys):
    config, weights = tiny_plain.plain_weights("llama")
    path = tiny_plain.write_gguf(tmp_path / "m.gguf", "llama", config, weights, Q.Q8_0)
    code, io = run(capsys, path, tmp_path / "kept")
    assert code == 0
    assert config_of(tmp_path / "kept")["quantization"]["bits"] == 8
    assert io.err.splitlines()[0] == (
        "GGUF weights are Q8_0: writing 8-bit MLX (group 32); "
        "--dtype float32 keeps full precision"
    )
    assert run(capsys, path, tmp_path / "flat", "--dequantize")[0] == 0
    assert "quantization" not in config_of(tmp_path / "flat")
    # an explicit dtype is full precision in it; with -q it is the rest's dtype
    code, io = run(capsys, path, tmp_path / "f16", "--dtype", "float16")
    assert code == 0 and "GGUF weights are" not in io.err
    assert "quantization" not in config_of(tmp_path / "f16")
    stored = mx.load(str(tmp_path / "f16" / "model.safetensors"))
    assert stored["model.layers.0.self_attn.q_proj.weight"].dtype == mx.float16
    assert run(capsys, path, tmp_path / "q", "-q", "--dtype", "float16")[0] == 0
    assert config_of(tmp_path / "q")["quantization"]["bits"] == 8  # the GGUF's kept


def test_separate_mtp_gguf(tiny_folders, tmp_path, capsys):
    """--mtp-gguf: trunk GGUF + a GGUF holding only blk.N.* gives the full model's head."""
    from mlx.utils import tree_flatten
    from mlx_mtp.convert.model import head_tensors

    from mlx_mtp.generate import mtp_logits

    full = mlx_mtp.load_model(tiny_folders("glm4_moe")[0])
    config = dict(tiny.CONFIGS["glm4_moe"], model_type="glm4_moe")
    trunk_w = dict(tree_flatten(full.target.model.parameters()))
    head_w = head_tensors("model.layers.2.", full.head)
    trunk_cfg = {k: v for k, v in config.items() if k != "num_nextn_predict_layers"}
    tiny_plain.write_gguf(tmp_path / "t.gguf", "glm4moe", trunk_cfg, trunk_w)
    tiny_plain.write_gguf(tmp_path / "mtp-t.gguf", "glm4moe", config, head_w)
    code, io = run(
        capsys,
        tmp_path / "t.gguf",
        tmp_path / "out",
        "--mtp-gguf",
        tmp_path / "mtp-t.gguf",
        "--dtype",
        "float32",
    )
    assert code == 0, io.err
    got = mlx_mtp.load_model(tmp_path / "out")
    tokens = list(range(40, 60))
    assert mx.allclose(
        mtp_logits(full, tokens), mtp_logits(got, tokens), atol=1e-2
    ).item()


def test_mtp_only_flags(tiny_folders, tmp_path, capsys):
    full_src, trunk_src = tiny_folders("mimo")
    assert run(capsys, trunk_src, tmp_path / "m", "-q")[0] == 0
    code, io = run(capsys, full_src, tmp_path / "other", "--mtp-only")
    assert code == 1 and "--into" in io.err
    code, io = run(
        capsys, "--mtp-only", full_src, "--into", tmp_path / "m", "--mtp-bits", 16
    )
    assert code == 0, io.err
    stored = mx.load(str(tmp_path / "m" / "mtp.safetensors"))
    assert not any(k.endswith(".scales") for k in stored)
    assert mlx_mtp.load_model(tmp_path / "m").head is not None


# -- what --force may replace, and writing that fails -------------------------


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    config, weights = tiny_plain.plain_weights("llama")
    path = tmp_path_factory.mktemp("gguf") / "m.gguf"
    return tiny_plain.write_gguf(path, "llama", config, weights, Q.Q8_0)


def one_line(code, io):
    lines = io.err.strip().splitlines()
    assert code == 1 and len(lines) == 1 and lines[0].startswith("error: "), io.err
    return lines[0]


def left_overs(folder):
    return [p.name for p in folder.rglob("*") if ".tmp-" in p.name or ".old-" in p.name]


def test_force_replaces_only_a_model_or_an_empty_folder(gguf, tmp_path, capsys):
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("my notes")
    err = one_line(*run(capsys, gguf, notes, "--force"))
    assert "not a model" in err and str(notes) in err
    assert [p.name for p in notes.iterdir()] == ["todo.txt"]
    assert (notes / "todo.txt").read_text() == "my notes"
    assert run(capsys, gguf, notes.parent / "m")[0] == 0
    assert run(capsys, gguf, notes.parent / "m", "--force", "--dequantize")[0] == 0
    assert "quantization" not in config_of(tmp_path / "m")
    assert not left_overs(tmp_path)


def test_force_into_the_current_folder(gguf, tmp_path, capsys, monkeypatch):
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    code, io = run(capsys, gguf, ".", "--force")  # empty: filled in place
    assert code == 0, io.err
    assert (here / "config.json").is_file() and Path.cwd() == here
    assert not left_overs(tmp_path)
    err = one_line(*run(capsys, gguf, ".", "--force"))  # a model: not under our feet
    assert "the folder you are in" in err
    assert (here / "config.json").is_file() and not left_overs(tmp_path)


def test_unwritable_target_fails_before_the_work(gguf, tmp_path, capsys, monkeypatch):
    import errno
    import os
    import tempfile

    import mlx_mtp.convert.pipeline as pipeline

    opened = []
    real_open = pipeline.open_source
    monkeypatch.setattr(
        pipeline, "open_source", lambda *a, **k: opened.append(1) or real_open(*a, **k)
    )
    locked = tmp_path / "locked"
    locked.mkdir()
    if os.geteuid() != 0:
        locked.chmod(0o555)
    else:  # root writes anywhere: the file system says no instead
        real_mkdtemp = tempfile.mkdtemp

        def mkdtemp(*args, dir=None, **kwargs):
            if dir is not None and Path(dir) == locked:
                raise OSError(errno.EROFS, os.strerror(errno.EROFS))
            return real_mkdtemp(*args, dir=dir, **kwargs)

        monkeypatch.setattr(tempfile, "mkdtemp", mkdtemp)
    try:
        err = one_line(*run(capsys, gguf, locked / "out"))
    finally:
        locked.chmod(0o755)
    assert f"cannot write into {locked}" in err and not opened


def test_full_disk_is_one_line_and_leaves_nothing(gguf, tmp_path, capsys, monkeypatch):
    import shutil
    from collections import namedtuple

    import mlx_mtp.convert.output as output

    usage = namedtuple("usage", "total used free")
    real_usage = shutil.disk_usage
    monkeypatch.setattr(output.shutil, "disk_usage", lambda p: usage(10**9, 0, 10**4))
    err = one_line(*run(capsys, gguf, tmp_path / "out"))
    assert "not enough space" in err and str(tmp_path / "out") in err
    assert list(tmp_path.iterdir()) == []

    # the space runs out while writing: MLX raises a bare RuntimeError
    monkeypatch.setattr(output.shutil, "disk_usage", real_usage)

    def full(*args, **kwargs):
        monkeypatch.setattr(output.shutil, "disk_usage", lambda p: usage(1, 1, 0))
        raise RuntimeError("[write] Unable to write 47257 bytes")

    monkeypatch.setattr(mx, "save_safetensors", full)
    # (--dequantize: a quantized GGUF says first what it writes, before the error)
    err = one_line(*run(capsys, gguf, tmp_path / "out", "--dequantize"))
    assert err == f"error: cannot write {tmp_path / 'out'}: No space left on device"
    assert list(tmp_path.iterdir()) == []


def test_a_killed_convert_is_cleaned_up_by_the_next(gguf, tmp_path, capsys):
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    killed = tmp_path / f"out.tmp-mlx-mtp-{child.pid}-abcd1234"
    killed.mkdir()
    (killed / "model.safetensors").write_bytes(b"\0" * 100)
    mine = tmp_path / "out.tmp-notes"
    mine.mkdir()
    assert run(capsys, gguf, tmp_path / "out")[0] == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "out.tmp-notes"]


def test_converted_folder_follows_the_umask(gguf, tmp_path, capsys):
    import os

    old = os.umask(0o022)
    try:
        assert run(capsys, gguf, tmp_path / "out")[0] == 0
    finally:
        os.umask(old)
    assert (tmp_path / "out").stat().st_mode & 0o777 == 0o755


# -- Ctrl-C -------------------------------------------------------------------


def snapshot(folder: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_ctrl_c_says_so_and_leaves_the_output_as_it_was(
    src, tmp_path, capsys, monkeypatch
):
    """Ctrl-C exited 130 with no message. Interrupted at the last step of the
    build: a new folder is not left behind, one replaced with --force (and a
    folder receiving --mtp-only) keeps its files."""
    from mlx_mtp.convert import mtp_only, pipeline

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    kept = tmp_path / "kept"
    assert run(capsys, src, kept)[0] == 0
    before = snapshot(kept)
    monkeypatch.setattr(pipeline, "write_config", interrupted)
    monkeypatch.setattr(mtp_only, "write_config", interrupted)
    new = tmp_path / "new"
    for args, target, said in [
        ([src, new], new, "was not written"),
        ([src, kept, "--force"], kept, "is as it was"),
        (["--mtp-only", src, "--into", kept, "--force"], kept, "is as it was"),
    ]:  # fmt: skip
        code, io = run(capsys, *args)
        assert code == 130
        assert io.err.strip().splitlines()[-1] == f"interrupted: {target} {said}"
    assert not new.exists() and snapshot(kept) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept"]
