"""``mlx-mtp convert`` of a Qwen3.5 (and Qwen3.6-MoE) vision-language
checkpoint: the vision tower kept as it is, the MTP layers kept beside the
text model (at 8 bits when it is quantized), the text model quantized as
mlx-vlm's own converter quantizes it, the processor files copied.

The references: the unconverted folder's generation (float), and mlx-vlm
0.7.10's own plain generation on the converted weights and on the folder its
converter writes (quantized). Skipped where mlx-vlm is not installed.
"""

import json
import shutil

import pytest

pytest.importorskip(
    "mlx_vlm", reason="mlx-vlm is not installed (pip install '.[vision]')"
)

import mlx.core as mx  # noqa: E402
import tiny_vlm  # noqa: E402

import mlx_mtp  # noqa: E402
from mlx_mtp.cli.app import run_app  # noqa: E402
from mlx_mtp.generate import stream_generate  # noqa: E402
from mlx_mtp.prompt import Prompt  # noqa: E402
from mlx_mtp.vision import VisionTarget, is_tower_key  # noqa: E402
from mlx_mtp.weights import read_safetensors  # noqa: E402

DRAFTS = dict(draft_max=2, adaptive_draft=False)
N = 16


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm-src")
    images = [tiny_vlm.write_image(root / f"i{k}.png", k, (32, 48)) for k in range(2)]
    folders = {
        t: tiny_vlm.build_folder(root / t, model_type=t)
        for t in ("qwen3_5", "qwen3_5_moe")
    }
    return folders, images


def _convert(capsys, src, out, *flags):
    code = run_app(["convert", str(src), str(out), *flags])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return captured.err


def _info(capsys, folder):
    assert run_app(["info", str(folder), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _tokens(model, processor, prompt, **kw):
    out = list(stream_generate(model, processor, prompt, N, **kw))
    return [r.token for r in out], out[-1].stats


def _prompts(processor, image):
    return {
        "image": processor.prompt("look at it:", image),
        "text": Prompt(tuple(processor.encode("no picture here"))),
    }


def test_a_float_convert_keeps_the_tower_and_the_head(sources, tmp_path, capsys):
    src, images = sources[0]["qwen3_5"], sources[1]
    out = tmp_path / "mlx"
    said = _convert(capsys, src, out)
    assert "vision tower float32" in said and "MTP layers 1" in said
    names = {p.name for p in out.iterdir()}
    assert {"model-vision.safetensors", "mtp.safetensors"} <= names
    copied = {"preprocessor_config.json", "tokenizer.json", "chat_template.jinja"}
    assert copied <= names
    # the tower's tensors are the checkpoint's, name for name and bit for bit
    before = {k: v for k, v in read_safetensors([src / "model.safetensors"]).items()
              if is_tower_key(k)}  # fmt: skip
    after = read_safetensors([out / "model-vision.safetensors"])
    assert before.keys() == after.keys() and before
    assert all(mx.array_equal(before[k], after[k]).item() for k in before)
    info = _info(capsys, out)
    assert info["format"] == "MLX folder" and info["mtp_layers"] == 1
    assert info["vision_precision"] == {"float32": len(before)}
    assert set(info["trunk_precision"]) == set(info["mtp_precision"]) == {"float32"}
    assert run_app(["info", str(out)]) == 0
    assert "vision tower  float32 x" in capsys.readouterr().out

    model, processor = mlx_mtp.load(out)
    assert isinstance(model.target, VisionTarget) and model.head is not None
    theirs, their_processor = mlx_mtp.load(src)
    for which, prompt in _prompts(processor, images[0]).items():
        again = _prompts(their_processor, images[0])[which]
        assert prompt.tokens == again.tokens and prompt.keys() == again.keys()
        want, _ = _tokens(theirs, their_processor, again, mtp=False)
        got, stats = _tokens(model, processor, prompt, **DRAFTS)
        assert got == want, which
        assert 0 < stats.accepted < stats.drafted


@pytest.mark.parametrize("model_type", ["qwen3_5", "qwen3_5_moe"])
@pytest.mark.parametrize("bits", [4, 8])
def test_a_quantized_convert_is_mlx_vlms_text_model_and_generates_as_it_does(
    sources, tmp_path, capsys, model_type, bits
):
    """The text model's tensors are those mlx-vlm's converter writes (its
    quantization predicate: Qwen3.6-MoE's router gates at 8 bits), the tower
    is not quantized, the head is at 8 bits; mlx-vlm's plain generation on
    our folder and on its own, and ours with drafts, are the same tokens."""
    import mlx_vlm
    from mlx_vlm.convert import convert as mlx_vlm_convert

    src, images = sources[0][model_type], sources[1]
    out, theirs_out = tmp_path / "ours", tmp_path / "theirs"
    flags = ["-q", "--q-bits", str(bits), "--q-group-size", "32"]
    said = _convert(capsys, src, out, *flags)
    assert "vision tower float32" in said
    mlx_vlm_convert(str(src), str(theirs_out), quantize=True, q_bits=bits,
                    q_group_size=32)  # fmt: skip
    capsys.readouterr()

    def text_model(folder):
        files = sorted(folder.glob("model*.safetensors"))
        return {k: v for k, v in read_safetensors(files).items()
                if k.startswith("language_model.")}  # fmt: skip

    ours, theirs = text_model(out), text_model(theirs_out)
    assert ours.keys() == theirs.keys()
    assert all(mx.array_equal(ours[k], theirs[k]).item() for k in ours)
    config = json.loads((out / "config.json").read_text())
    their_config = json.loads((theirs_out / "config.json").read_text())
    for path, q in their_config["quantization"].items():
        if isinstance(q, dict):  # the modules at other precisions
            assert {k: config["quantization"][path][k] for k in q} == q
    if model_type == "qwen3_5_moe":
        assert config["quantization"]["language_model.model.layers.0.mlp.gate"][
            "bits"
        ] == 8
    info = _info(capsys, out)
    assert f"{bits}-bit/g32" in info["trunk_precision"]
    assert set(info["vision_precision"]) == {"float32"}
    assert "8-bit/g32" in info["mtp_precision"]
    assert not any(k.endswith(".scales") for k in
                   read_safetensors([out / "model-vision.safetensors"]))  # fmt: skip

    model, processor = mlx_mtp.load(out)
    assert model.head is not None
    on_ours, _ = mlx_vlm.load(str(out))
    on_theirs, _ = mlx_vlm.load(str(theirs_out))
    for which, prompt in _prompts(processor, images[1]).items():
        want = tiny_vlm.mlx_vlm_greedy(on_ours, processor, prompt, N)
        assert len(want) > 8
        assert tiny_vlm.mlx_vlm_greedy(on_theirs, processor, prompt, N) == want
        assert _tokens(model, processor, prompt, mtp=False)[0] == want, which
        got, stats = _tokens(model, processor, prompt, **DRAFTS)
        assert got == want, which
        assert stats.drafted > 0 and stats.accepted > 0


def test_a_vision_config_without_a_tower_is_refused_in_one_line(
    sources, tmp_path, capsys
):
    src = sources[0]["qwen3_5"]
    broken = tmp_path / "no-tower"
    shutil.copytree(src, broken)
    weights = read_safetensors([broken / "model.safetensors"])
    kept = {k: v for k, v in weights.items() if not is_tower_key(k)}
    mx.save_safetensors(str(broken / "model.safetensors"), kept, {"format": "pt"})
    assert run_app(["convert", str(broken), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no tensor holds one" in err
    assert not (tmp_path / "out").exists()
