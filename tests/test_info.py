"""``mlx-mtp info`` on a GGUF file, a Hugging Face folder and an MLX folder."""

import json
import os

import tiny_plain
from gguf import GGMLQuantizationType as Q
from mlx_mtp.cli.app import run_app
from mlx_mtp.convert import convert


def info_json(capsys, path):
    assert run_app(["info", str(path), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_info_shows_each_part_and_the_mtp_policy(tiny_folders, tmp_path, capsys):
    src = tiny_folders("glm4_moe")[0]
    hf = info_json(capsys, src)
    assert hf["format"] == "Hugging Face folder"
    assert (hf["architecture"], hf["layers"], hf["mtp_layers"]) == ("glm4_moe", 2, 1)
    assert hf["trunk_precision"] == {"float32": hf["trunk_precision"]["float32"]}

    out = convert(src, tmp_path / "q", quantize=True)
    mlx = info_json(capsys, out)
    assert mlx["format"] == "MLX folder" and mlx["mtp_layers"] == 1
    assert set(mlx["trunk_precision"]) == {"4-bit/g64", "float32"}
    assert set(mlx["mtp_precision"]) == {"8-bit/g64", "float32"}  # the default policy
    assert mlx["size_bytes"] > mlx["trunk_bytes"] + mlx["mtp_bytes"]

    out16 = convert(src, tmp_path / "q16", quantize=True, mtp_bits=16)
    assert set(info_json(capsys, out16)["mtp_precision"]) == {"float32"}

    trunk_only = convert(tiny_folders("glm4_moe")[1], tmp_path / "t")
    assert info_json(capsys, trunk_only)["mtp_layers"] == 0


def test_info_reads_gguf_types(tmp_path, capsys):
    config, weights = tiny_plain.plain_weights("qwen3")
    path = tiny_plain.write_gguf(tmp_path / "m.gguf", "qwen3", config, weights, Q.Q8_0)
    got = info_json(capsys, path)
    assert got["format"] == "GGUF" and got["layers"] == 2 and got["mtp_layers"] == 0
    assert got["architecture"] == "qwen3 (qwen3)"
    assert set(got["trunk_precision"]) == {"Q8_0", "F32"}
    assert got["size_bytes"] == path.stat().st_size

    assert run_app(["info", str(path)]) == 0
    text = capsys.readouterr().out
    assert "Q8_0" in text and "MTP layers    none" in text


def test_info_errors_are_one_line(tmp_path, capsys):
    assert run_app(["info", str(tmp_path / "absent")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1
    (tmp_path / "x.bin").write_bytes(b"junk")
    assert run_app(["info", str(tmp_path / "x.bin")]) == 1
    assert "not a GGUF file" in capsys.readouterr().err


def test_info_names_a_truncated_weights_file(tiny_folders, tmp_path, capsys):
    """As generate refuses it: the header promises more bytes than there are."""
    import shutil

    bad = tmp_path / "truncated"
    shutil.copytree(tiny_folders("mimo")[0], bad)
    weights = bad / "model.safetensors"
    size = weights.stat().st_size
    os.truncate(weights, size // 2)
    assert run_app(["info", str(bad)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err == (
        f"error: {weights}: truncated ({size // 2} bytes, the header promises {size})\n"
    )


def test_info_sees_a_head_trained_by_train_head(tmp_path, capsys):
    """The default model's layout: a llama trunk with mtp.safetensors and
    mtp_config.json beside it; the head's tensors are not the trunk's."""
    import mlx.core as mx
    import tiny

    config, weights = tiny_plain.plain_weights("llama")
    model = convert(tiny.save_folder(tmp_path / "src", config, weights), tmp_path / "m")
    bare = info_json(capsys, model)
    tiny.write_trained_head(model, config, draft_vocab=range(10))
    headed = info_json(capsys, model)
    assert bare["mtp_layers"] == 0 and headed["mtp_layers"] == 1
    assert headed["trained_head"] and not bare["trained_head"]
    assert headed["trunk_precision"] == bare["trunk_precision"]
    assert headed["trunk_bytes"] == bare["trunk_bytes"]
    head = mx.load(str(model / "mtp.safetensors"))
    assert headed["mtp_bytes"] == sum(v.nbytes for v in head.values())
    assert headed["mtp_precision"] == {"float32": len(head) - 1, "int32": 1}
    assert run_app(["info", str(model)]) == 0
    out = capsys.readouterr().out
    assert "MTP layers    1 (a head trained by train-head" in out
