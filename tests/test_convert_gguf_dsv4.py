"""DeepSeek-V4-Flash GGUFs (llama.cpp arch ``deepseek4``): the model file and
llama.cpp's separate ``mtp-`` file convert to what the Hugging Face
checkpoint converts to, MTP layer included and kept at higher precision.

The GGUFs are written as llama.cpp's converter writes them
(``tiny_dsv4_gguf``); with a llama.cpp checkout at ``$LLAMA_CPP`` (and
torch), its own converter writes them too, and both are checked.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip(
    "mlx_vlm", reason="mlx-vlm is not installed (pip install '.[vision]')"
)

import tiny_dsv4_gguf  # noqa: E402
from gguf import GGMLQuantizationType as Q  # noqa: E402
from tiny import random_prompt, save_folder  # noqa: E402
from vlm_greedy import mtp_greedy, vlm_greedy  # noqa: E402

import mlx_mtp  # noqa: E402
from mlx_mtp.cli.app import run_app  # noqa: E402
from mlx_mtp.convert import convert  # noqa: E402
from mlx_mtp.convert.pipeline import default_gguf_dtype  # noqa: E402
from mlx_mtp.errors import MTPError  # noqa: E402

PROMPT = random_prompt(30, seed=3)  # past the window (8) and the index top-k (4)
FILES = ("model.safetensors", "mtp.safetensors")
CLI = [sys.executable, "-m", "mlx_mtp"]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The checkpoint, its two GGUFs (float; experts in MXFP4 where llama.cpp
    repacks them: the ``mxfp4`` pair also holds its matrices at Q8_0) and the
    checkpoint's own conversion."""
    root = tmp_path_factory.mktemp("gguf-dsv4")
    config, trunk, mtp = tiny_dsv4_gguf.build(mxfp4=True)
    hf = save_folder(root / "hf", config, trunk, mtp)
    files = {}
    for label, options in (
        ("f32", {}), ("q8", {"qtype": Q.Q8_0, "experts": "MXFP4"}),
    ):  # fmt: skip
        name = f"DSV4-Tiny-{label.upper()}.gguf"
        files[label] = (
            tiny_dsv4_gguf.write_gguf(root / name, config, trunk, mtp, "model", **options),
            tiny_dsv4_gguf.write_gguf(
                root / f"mtp-{name}", config, trunk, mtp, "mtp", **options
            ),
        )
    ref = convert(hf, root / "ref", dtype="float32")
    return config, (trunk, mtp), hf, files, ref


def tensors(folder: Path):
    return {f: mx.load(str(folder / f)) for f in FILES if (folder / f).exists()}


def assert_same_tensors(a: Path, b: Path):
    """Bit for bit: names, shapes, dtypes and values."""
    ta, tb = tensors(a), tensors(b)
    assert set(ta) == set(tb) == set(FILES)
    for f in ta:
        assert set(ta[f]) == set(tb[f]), f
        for k, v in ta[f].items():
            w = tb[f][k]
            assert v.shape == w.shape and v.dtype == w.dtype, k
            assert np.array_equal(np.array(v), np.array(w)), k


def greedy(folder, k=2):
    m, _ = mlx_mtp.load(folder)
    assert m.head is not None and m.notice is None
    return mtp_greedy(m, PROMPT, 24, k)


def test_float_gguf_pair_gives_the_checkpoint_and_its_greedy_tokens(built, tmp_path):
    config, _, hf, files, ref = built
    model, mtp = files["f32"]
    out = convert(model, tmp_path / "out", dtype="float32", mtp_gguf=mtp)
    assert_same_tensors(out, ref)
    got = json.loads((out / "config.json").read_text())
    assert got["model_type"] == "deepseek_v4"
    for key in (
        "num_hidden_layers", "compress_ratios", "hc_mult", "o_groups",
        "num_hash_layers", "sliding_window", "index_topk", "rope_scaling",
        "num_nextn_predict_layers", "scoring_func", "swiglu_limit",
    ):  # fmt: skip
        assert got[key] == config[key], key
    from mlx_vlm.utils import load_model

    plain = vlm_greedy(load_model(hf).language_model, PROMPT, 24)
    for k in (1, 3):
        tokens, stats = greedy(out, k)
        assert tokens == plain, k
        assert stats.accepted > 0  # drafts kept
    assert greedy(ref, 2)[0] == plain


def test_a_folder_of_llama_cpps_files_or_the_model_file_alone(built, tmp_path):
    """What a user downloads: the model file and its ``mtp-`` sibling side by
    side; the folder, or the model file alone, finds the MTP file."""
    _, _, _, files, ref = built
    folder = tmp_path / "dl"
    folder.mkdir()
    for f in files["f32"]:
        shutil.copy(f, folder / f.name)
    assert_same_tensors(convert(folder, tmp_path / "a", dtype="float32"), ref)
    model = folder / files["f32"][0].name
    args = ["convert", model, tmp_path / "b", "--dtype", "float32"]
    assert run_app(args) == 0
    assert_same_tensors(tmp_path / "b", ref)


def test_q8_0_and_mxfp4_convert_at_their_own_width(built, tmp_path):
    """The published precision: FP8 matrices as Q8_0 (the MTP layer's too),
    experts as MXFP4, ``eh_proj`` Q8_0. No precision asked: 8-bit groups of
    32 for the trunk and the MTP layer, the same model, bit for bit, as
    ``-q --q-bits 8`` makes of a checkpoint holding the files' values."""
    config, (trunk, mtp), _, files, _ = built
    said = []
    out = convert(
        files["q8"][0], tmp_path / "out", mtp_gguf=files["q8"][1], notify=said.append
    )
    assert said and "Q8_0" in said[0] and "MXFP4" in said[0], said
    quant = json.loads((out / "config.json").read_text())["quantization"]
    modules = {k: v for k, v in quant.items() if isinstance(v, dict)}
    assert {(v["bits"], v["group_size"]) for v in modules.values()} == {(8, 32)}
    assert any(k.startswith("mtp.0.") for k in modules)  # the MTP layer, at 8 bits
    same = save_folder(tmp_path / "held", config, tiny_dsv4_gguf.held({**trunk, **mtp}))
    ref = convert(same, tmp_path / "ref", quantize=True, q_bits=8, q_group_size=32,
                  dtype=default_gguf_dtype())  # fmt: skip
    assert_same_tensors(out, ref)
    assert greedy(out, 2)[0] == greedy(ref, 2)[0]


def test_quantized_convert_keeps_the_mtp_layer_at_8_bits(built, tmp_path):
    """``-q``: GGUF pair and checkpoint give the same 4-bit trunk, 8-bit head."""
    _, _, hf, files, _ = built
    options = dict(quantize=True, q_group_size=32, dtype="float32")
    out = convert(files["f32"][0], tmp_path / "q", mtp_gguf=files["f32"][1], **options)
    ref = convert(hf, tmp_path / "ref-q", **options)
    assert_same_tensors(out, ref)
    quant = json.loads((out / "config.json").read_text())["quantization"]
    head = {v["bits"] for k, v in quant.items() if k.startswith("mtp.0.")}
    assert head == {8} and quant["bits"] == 4


def test_info_names_the_family_and_the_mtp_file(built, capsys):
    _, _, _, files, _ = built
    model, mtp = files["f32"]
    assert run_app(["info", str(model), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["architecture"] == "deepseek4 (deepseek_v4)"
    assert (got["layers"], got["mtp_layers"]) == (4, 0)
    assert run_app(["info", str(mtp), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert (got["layers"], got["mtp_layers"]) == (4, 1)


def _one_line_failure(capsys, args, *wanted):
    """``mlx-mtp convert ARGS`` (in this process) fails with one line."""
    capsys.readouterr()
    assert run_app(["convert", *args]) != 0
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    for w in wanted:
        assert w in lines[0], lines[0]
    return lines[0]


def _rewritten(src: Path, dst: Path, arch=None, drop=(), resize=None) -> Path:
    """``src`` with another arch name, tensors dropped, or one resized."""
    import gguf

    reader = gguf.GGUFReader(str(src))
    old = reader.fields["general.architecture"].contents()
    arch = arch or old
    writer = gguf.GGUFWriter(str(dst), arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        writer.add_key_value(
            field.name.replace(f"{old}.", f"{arch}.", 1), field.contents(),
            field.types[0],
            field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None,
        )  # fmt: skip
    for t in reader.tensors:
        if t.name in drop:
            continue
        data = np.array(t.data)
        if t.name == resize:
            data = np.zeros((data.shape[0], data.shape[1] + 32), np.float32)
        writer.add_tensor(t.name, data, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def test_bad_input_is_one_line(built, tmp_path, capsys):
    _, _, _, files, _ = built
    model, mtp = files["f32"]
    alone = tmp_path / "alone"
    alone.mkdir()
    shutil.copy(model, alone / "m.gguf")
    out = tmp_path / "o"
    r = subprocess.run([*CLI, "convert", str(alone / "m.gguf"), str(out)],
                       capture_output=True, text=True, timeout=600)  # fmt: skip
    assert r.returncode != 0 and "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "--mtp-gguf" in lines[0] and "mtp-" in lines[0]
    with pytest.raises(MTPError, match="separate mtp-"):  # and from Python
        convert(alone / "m.gguf", out)
    fail = _one_line_failure
    fail(capsys, [mtp, out], "only the MTP layer")
    fail(capsys, [model, out, "--mtp-gguf", model], "holds no MTP layer")
    other = _rewritten(mtp, tmp_path / "other.gguf", arch="glm-dsa")
    fail(capsys, [model, out, "--mtp-gguf", other], "'glm-dsa'")
    wide = _rewritten(mtp, tmp_path / "wide.gguf", resize="output.weight")
    fail(capsys, [model, out, "--mtp-gguf", wide], "not the same checkpoint")
    no_eh = _rewritten(mtp, tmp_path / "no-eh.gguf", drop=("blk.4.nextn.eh_proj.weight",))
    fail(capsys, [model, out, "--mtp-gguf", no_eh], "nextn.eh_proj")
    two = tmp_path / "two"
    two.mkdir()
    for name in ("a.gguf", "b.gguf"):
        shutil.copy(model, two / name)
    fail(capsys, [two, out], "one model GGUF expected", "a.gguf, b.gguf")
    assert not out.exists()


def test_a_glm_dsa_gguf_with_shared_indexers_is_refused(tmp_path, capsys):
    """GLM-5.x (llama.cpp's ``glm-dsa``, mlx-lm's ``glm_moe_dsa``): a config's
    ``indexer_types`` reach the file as ``attention.indexer.types``; a layer
    that shares another's indexer is more than mlx-lm's class runs."""
    import gguf
    from tiny_plain import _tokenizer_metadata

    path = tmp_path / "glm.gguf"
    writer = gguf.GGUFWriter(str(path), "glm-dsa")
    writer.add_uint32("glm-dsa.block_count", 3)
    writer.add_array("glm-dsa.attention.indexer.types", [True, False, True])
    _tokenizer_metadata(writer, 0)
    writer.add_tensor("token_embd.weight", np.zeros((288, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    line = _one_line_failure(capsys, [path, tmp_path / "o"], "glm-dsa", "[1]", "glm_moe_dsa")
    assert "indexer" in line


def _llama_cpp():
    root = os.environ.get("LLAMA_CPP")
    if not root or not Path(root, "convert_hf_to_gguf.py").exists():
        pytest.skip("no llama.cpp checkout at $LLAMA_CPP")
    pytest.importorskip("torch", reason="llama.cpp's converter needs torch")
    return root


def test_llama_cpps_own_converter_writes_what_the_tests_write(built, tmp_path):
    """llama.cpp's convert_hf_to_gguf.py, plain and ``--mtp``, on the
    checkpoint with its experts in DeepSeek's FP4 (what its MXFP4 repack
    reads): the same tensors, types, values and model keys as
    ``tiny_dsv4_gguf`` at ``experts="MXFP4"``."""
    from mlx_mtp.convert.gguf_file import GGUFFile

    _llama_cpp()
    config, (trunk, mtp), _, _, _ = built
    fp4 = {}
    for k, v in {**trunk, **mtp}.items():
        if ".ffn.experts." in k:
            packed, scale = tiny_dsv4_gguf.mxfp4_codes(v)
            fp4[k] = mx.array(packed.view(np.int8))
            fp4[k[: -len("weight")] + "scale"] = mx.array(scale)
        else:
            fp4[k] = v
    hf = save_folder(tmp_path / "hf-fp4", config, fp4)
    helper = Path(__file__).with_name("llama_cpp_convert.py")
    for part, extra in (("model", []), ("mtp", ["--mtp"])):
        theirs = tmp_path / f"llama-{part}.gguf"
        r = subprocess.run(
            [sys.executable, str(helper), str(hf), "--outtype", "f32",
             "--outfile", str(theirs), *extra],
            capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr[-2000:]
        ours = tiny_dsv4_gguf.write_gguf(
            tmp_path / f"ours-{part}.gguf", config, trunk, mtp, part, experts="MXFP4"
        )
        a, b = GGUFFile(ours), GGUFFile(theirs)
        ta, tb = {t.name: t for t in a.tensors}, {t.name: t for t in b.tensors}
        assert set(ta) == set(tb), part
        for name, t in ta.items():
            assert t.tensor_type == tb[name].tensor_type, (part, name)
            assert t.shape == tb[name].shape, (part, name)
            assert np.array_equal(np.asarray(t.data), np.asarray(tb[name].data)), name
        keys = [k for k in b.fields if k.startswith("deepseek4.")]
        assert {k: a.fields.get(k) for k in keys} == {k: b.fields[k] for k in keys}
