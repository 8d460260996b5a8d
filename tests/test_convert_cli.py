"""``mlx-mtp convert``: every flag reaches the conversion and shows in the output folder."""

import json

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
    assert run(capsys, path, tmp_path / "kept")[0] == 0
    assert config_of(tmp_path / "kept")["quantization"]["bits"] == 8
    assert run(capsys, path, tmp_path / "flat", "--dequantize")[0] == 0
    assert "quantization" not in config_of(tmp_path / "flat")


def test_separate_mtp_gguf(tiny_folders, tmp_path, capsys):
    """--mtp-gguf: trunk GGUF + a GGUF holding only blk.N.* gives the full model's head."""
    from mlx.utils import tree_flatten
    from mlx_mtp.convert.model import head_tensors

    from mlx_mtp.generate import mtp_logits

    full = mlx_mtp.load_model(tiny_folders("glm4_moe")[0])
    config = dict(tiny.CONFIGS["glm4_moe"], model_type="glm4_moe")
    trunk_w = dict(tree_flatten(full.trunk.model.parameters()))
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
