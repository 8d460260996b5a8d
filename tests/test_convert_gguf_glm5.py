"""GLM-5.3-Flash GGUFs (llama.cpp arch ``glm5-next``) convert to what the
Hugging Face checkpoint converts to, MTP layer included and kept at higher
precision; a Qwen3.8-Flash-Next GGUF (``qwen4exp``), which llama.cpp writes
without its MTP layer, is refused in one line.

The GGUFs are written as llama.cpp's converter writes them
(``tiny_glm5_gguf``); with a llama.cpp checkout at ``$LLAMA_CPP`` (and
torch), its own converter writes one too, and both are checked.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip(
    "mlx_vlm", reason="mlx-vlm is not installed (pip install '.[vision]')"
)

import tiny_glm5_gguf  # noqa: E402
from gguf import GGMLQuantizationType as Q  # noqa: E402
from tiny import random_prompt, save_folder  # noqa: E402

import mlx_mtp  # noqa: E402
from mlx_mtp.adaptive import FixedDraft  # noqa: E402
from mlx_mtp.cli.app import run_app  # noqa: E402
from mlx_mtp.convert import convert  # noqa: E402
from mlx_mtp.errors import MTPError  # noqa: E402
from mlx_mtp.speculative import speculative_generate_step  # noqa: E402
from mlx_mtp.stats import MTPStats  # noqa: E402

PROMPT = random_prompt(30, seed=3)  # past the indexer's 8 keys: sparse attention
FILES = ("model.safetensors", "mtp.safetensors")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf-glm5")
    config, trunk, mtp = tiny_glm5_gguf.build()
    hf = save_folder(root / "hf", config, trunk, mtp)
    ggufs = {
        kind: tiny_glm5_gguf.write_gguf(
            root / f"{kind}.gguf", config, {**trunk, **mtp}, mtp=kind
        )
        for kind in ("with", "none", "only")
    }
    ref = convert(hf, root / "ref", dtype="float32")
    return config, hf, ggufs, ref


def tensors(folder: Path):
    return {f: mx.load(str(folder / f)) for f in FILES if (folder / f).exists()}


def assert_same_tensors(a: Path, b: Path):
    ta, tb = tensors(a), tensors(b)
    assert set(ta) == set(tb)
    for f in ta:
        assert set(ta[f]) == set(tb[f]), f
        for k, v in ta[f].items():
            w = tb[f][k]
            assert v.shape == w.shape and v.dtype == w.dtype, k
            # ssm_a = -exp(A_log) comes back through a log: within a rounding
            np.testing.assert_allclose(np.array(v), np.array(w), rtol=1e-6, err_msg=k)


def mtp_greedy(folder, n=30, k=2):
    m, _ = mlx_mtp.load(folder)
    assert m.head is not None
    stats = MTPStats(trace=[])
    steps = speculative_generate_step(
        PROMPT, m, max_tokens=n, drafts=FixedDraft(k), stats=stats
    )
    return [int(t) for t, _ in steps], stats


def vlm_greedy(folder, n=30):
    """mlx-vlm's own plain decode of the Hugging Face checkpoint."""
    from mlx_vlm.utils import load_model

    lm = load_model(folder).language_model
    cache = lm.make_cache()
    logits = lm(mx.array(PROMPT)[None], cache=cache).logits
    out = []
    while len(out) < n:
        out.append(int(mx.argmax(logits[0, -1])))
        logits = lm(mx.array([out[-1:]]), cache=cache).logits
    return out


def test_gguf_gives_the_hf_model_and_greedy_tokens(built, tmp_path):
    config, hf, ggufs, ref = built
    out = convert(ggufs["with"], tmp_path / "out", dtype="float32")
    assert_same_tensors(out, ref)
    got = json.loads((out / "config.json").read_text())
    assert got["model_type"] == "glm5_next"
    text, want = got["text_config"], config["text_config"]
    for key in ("layer_types", "num_nextn_predict_layers", "hc_mult", "index_kpool"):
        assert text[key] == want[key], key
    tokens, stats = mtp_greedy(out)
    assert tokens == mtp_greedy(ref)[0] == vlm_greedy(hf)
    assert 0 < stats.accepted < stats.drafted  # drafts kept and rejected


def test_quantized_convert_keeps_the_mtp_layer_at_8_bits(built, tmp_path):
    """``-q``: GGUF and checkpoint give the same 4-bit trunk and 8-bit MTP layer."""
    _, hf, ggufs, _ = built
    options = dict(quantize=True, q_group_size=32, dtype="float32")
    out = convert(ggufs["with"], tmp_path / "q", **options)
    ref = convert(hf, tmp_path / "ref-q", **options)
    assert_same_tensors(out, ref)
    quant = json.loads((out / "config.json").read_text())["quantization"]
    mtp = {k: v for k, v in quant.items() if ".layers.4." in k}
    trunk = {k: v for k, v in quant.items() if isinstance(v, dict) and k not in mtp}
    assert mtp and {v["bits"] for v in mtp.values()} == {8}
    assert trunk and {v["bits"] for v in trunk.values()} == {4}
    assert mtp_greedy(out)[0] == mtp_greedy(ref)[0]


def test_separate_mtp_gguf_onto_a_bare_trunk(built, tmp_path):
    """llama.cpp's ``--no-mtp`` trunk plus its ``--mtp`` file: the whole model.
    The trunk alone converts too, without a head."""
    _, _, ggufs, ref = built
    out = convert(
        ggufs["none"], tmp_path / "out", dtype="float32", mtp_gguf=ggufs["only"]
    )
    assert_same_tensors(out, ref)
    bare = convert(ggufs["none"], tmp_path / "bare", dtype="float32")
    assert not (bare / "mtp.safetensors").exists()
    m, _ = mlx_mtp.load(bare)
    assert m.head is None
    # the whole file's MTP layer serves as well; a bare file has none to give
    out = convert(
        ggufs["none"], tmp_path / "whole", dtype="float32", mtp_gguf=ggufs["with"]
    )
    assert_same_tensors(out, ref)
    with pytest.raises(MTPError, match="holds no MTP layer"):
        convert(ggufs["none"], tmp_path / "x", mtp_gguf=ggufs["none"])


def test_quantized_gguf_converts_at_its_own_width(built, tmp_path):
    """A Q8_0 file, no precision asked: the nearest width (8 bits, groups of
    32) for the trunk and the MTP layer, the same model as ``-q --q-bits 8``
    makes of a checkpoint holding the file's values."""
    config, _, _, _ = built
    _, trunk, mtp = tiny_glm5_gguf.build()
    weights = {**trunk, **mtp}
    path = tiny_glm5_gguf.write_gguf(
        tmp_path / "q8.gguf", config, weights, qtype=Q.Q8_0
    )
    said = []
    out = convert(path, tmp_path / "out", notify=said.append)
    assert said and "Q8_0" in said[0] and "8-bit" in said[0]
    quant = json.loads((out / "config.json").read_text())["quantization"]
    assert {v["bits"] for v in quant.values() if isinstance(v, dict)} == {8}
    assert any(".layers.4." in k for k in quant)  # the MTP layer, at 8 bits
    same = save_folder(
        tmp_path / "held", config, tiny_glm5_gguf.held(config, weights, Q.Q8_0)
    )
    ref = convert(
        same, tmp_path / "ref", quantize=True, q_bits=8, q_group_size=32,
        dtype="float32",
    )  # fmt: skip
    # the same modules at the same widths (the grids may differ by a rounding:
    # the file's values come through MLX's dequantize here, gguf's there),
    # but for the trunk's indexer weights, which llama.cpp keeps F32 and so
    # stay floats
    ta, tb = tensors(out), tensors(ref)
    assert set(ta) == set(tb)
    differ = set()
    for f, a in ta.items():
        b = tb[f]
        differ |= set(a) ^ set(b)
        differ |= {k for k in a if k in b and a[k].shape != b[k].shape}
    proj = "language_model.model.layers.1.self_attn.indexer.weights_proj."
    assert differ == {proj + p for p in ("weight", "scales", "biases")}
    assert ta["model.safetensors"][proj + "weight"].dtype == mx.float32
    assert mtp_greedy(out)[0] == mtp_greedy(ref)[0]


def test_cli_converts_a_bare_trunk_and_its_mtp_file(built, tmp_path):
    """``mlx-mtp convert TRUNK.gguf OUT --mtp-gguf mtp-X.gguf -q``, then
    ``mlx-mtp info OUT``: the family, a 4-bit trunk and an 8-bit MTP layer."""
    _, _, ggufs, _ = built
    out = tmp_path / "q"
    cli = [sys.executable, "-m", "mlx_mtp"]
    r = subprocess.run(
        [*cli, "convert", str(ggufs["none"]), str(out), "--mtp-gguf",
         str(ggufs["only"]), "-q", "--q-group-size", "32"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    r = subprocess.run([*cli, "info", str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    lines = {ln.split()[0]: ln for ln in r.stdout.splitlines() if ln.strip()}
    assert "glm5_next" in lines["architecture"]
    assert "4-bit/g32" in lines["trunk"] and "8-bit/g32" in lines["MTP"]


def test_info_names_the_family(built, capsys):
    _, _, ggufs, _ = built
    assert run_app(["info", str(ggufs["with"]), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["architecture"] == "glm5-next (glm5_next)"
    assert (got["layers"], got["mtp_layers"]) == (4, 1)


def _bare_gguf(path: Path, arch: str) -> Path:
    """A GGUF as llama.cpp's converter writes ``arch`` by default: metadata,
    tokenizer, no nextn key and no MTP block (``Qwen4ExpTextModel.no_mtp``)."""
    import gguf
    from tiny_plain import _tokenizer_metadata

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_uint32(f"{arch}.block_count", 2)
    writer.add_uint32(f"{arch}.embedding_length", 32)
    _tokenizer_metadata(writer, 0)
    writer.add_tensor("token_embd.weight", np.zeros((288, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(
    "arch,family,why",
    [("qwen4exp", "qwen4_exp (Qwen3.8-Flash-Next)", "drops its MTP layer")],
)
def test_gguf_without_a_head_to_keep_is_refused_saying_why(
    tmp_path, capsys, arch, family, why
):
    path = _bare_gguf(tmp_path / "m.gguf", arch)
    with pytest.raises(MTPError, match=why):
        convert(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    r = subprocess.run(
        [sys.executable, "-m", "mlx_mtp", "convert", str(path), str(tmp_path / "o")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode != 0 and "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and family in lines[0] and "Hugging Face" in lines[0]
    assert run_app(["info", str(path), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["architecture"] == f"{arch} ({family}; not convertible from GGUF)"


def test_a_glm5_next_gguf_it_cannot_read_is_one_line(built, tmp_path):
    """Metadata without the layer kinds, then a tensor of no known kind."""
    import gguf

    bare = _bare_gguf(tmp_path / "bare.gguf", "glm5-next")
    r = subprocess.run(
        [sys.executable, "-m", "mlx_mtp", "convert", str(bare), str(tmp_path / "o")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode != 0 and "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "head_count_kv" in lines[0]

    _, _, ggufs, _ = built
    reader = gguf.GGUFReader(str(ggufs["with"]))
    writer = gguf.GGUFWriter(str(tmp_path / "odd.gguf"), "glm5-next")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        writer.add_key_value(
            field.name, field.contents(), field.types[0],
            field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None,
        )  # fmt: skip
    for t in reader.tensors:
        writer.add_tensor(t.name, np.array(t.data))
    writer.add_tensor("blk.0.attn_sinks.weight", np.zeros(2, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(MTPError, match="blk.0.attn_sinks.weight has no counterpart"):
        convert(tmp_path / "odd.gguf", tmp_path / "out")


def _llama_cpp():
    root = os.environ.get("LLAMA_CPP")
    if not root or not Path(root, "convert_hf_to_gguf.py").exists():
        pytest.skip("no llama.cpp checkout at $LLAMA_CPP")
    pytest.importorskip("torch", reason="llama.cpp's converter needs torch")
    return root


def _llama_cpp_gguf(hf: Path, out: Path, outtype: str) -> Path:
    helper = Path(__file__).with_name("llama_cpp_convert.py")
    r = subprocess.run(
        [sys.executable, str(helper), str(hf), "--outtype", outtype,
         "--outfile", str(out)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    return out


def test_llama_cpps_own_converter_writes_what_the_tests_write(built, tmp_path):
    """llama.cpp's convert_hf_to_gguf.py on the tiny checkpoint, at f32 and
    q8_0: the same tensors, types and model keys as ``tiny_glm5_gguf``, and
    converting its f32 file gives the checkpoint's tensors."""
    from mlx_mtp.convert import gguf_source
    from mlx_mtp.convert.gguf_file import GGUFFile
    from mlx_mtp.convert.source import copy_tokenizer

    _llama_cpp()
    config, hf, ggufs, ref = built
    _, trunk, mtp = tiny_glm5_gguf.build()
    ours = {
        "f32": ggufs["with"],
        "q8_0": tiny_glm5_gguf.write_gguf(
            tmp_path / "q8.gguf", config, {**trunk, **mtp}, qtype=Q.Q8_0
        ),
    }
    for outtype, path in ours.items():
        theirs = _llama_cpp_gguf(hf, tmp_path / f"llama-{outtype}.gguf", outtype)
        a, b = GGUFFile(path), GGUFFile(theirs)
        ta, tb = {t.name: t for t in a.tensors}, {t.name: t for t in b.tensors}
        assert set(ta) == set(tb)
        for name, t in ta.items():
            assert t.tensor_type == tb[name].tensor_type, (outtype, name)
            assert t.shape == tb[name].shape, name
            x, y = t.data, tb[name].data
            if x.dtype == np.uint8:  # Q8_0 blocks: the same rounding
                assert np.array_equal(x, y), (outtype, name)
            else:
                np.testing.assert_allclose(x, y, rtol=1e-6, err_msg=name)
        model_keys = [k for k in b.fields if k.startswith("glm5-next.")]
        assert {k: a.fields.get(k) for k in model_keys} == {
            k: b.fields[k] for k in model_keys
        }
    # its vocabulary is a stand-in (see llama_cpp_convert): the checkpoint's
    # tokenizer files go with it
    real = gguf_source.gguf_tokenizer_writer
    gguf_source.gguf_tokenizer_writer = lambda path, fields: copy_tokenizer(hf)
    try:
        out = convert(tmp_path / "llama-f32.gguf", tmp_path / "out", dtype="float32")
    finally:
        gguf_source.gguf_tokenizer_writer = real
    assert_same_tensors(out, ref)
