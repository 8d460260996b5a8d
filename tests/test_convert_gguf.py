"""The tiny models written as GGUF (as llama.cpp would) convert to what the HF path gives.

The reference for a quantized GGUF is the HF folder holding the same weights
after the ``gguf`` package's own quantize -> dequantize: Q4_0/Q4_1/Q8_0 must
then agree to float16 arithmetic (no second rounding), as must K-quants,
which are dequantized and kept as floats.
"""

import json

import mlx.core as mx
import numpy as np
import pytest
import tiny
import tiny_plain
from gguf import GGMLQuantizationType as Q
from mlx_mtp.convert import convert
from mlx_mtp.convert.quants import repack

import mlx_mtp
from mlx_mtp.errors import MTPError
from mlx_mtp.generate import mtp_logits

TOKENS = list(range(40, 72))
# the default GGUF dtype (float16 where a GPU runs it) against float32 activations:
# max |logit error| / max |logit|
BOUND_F16 = 5e-3


def rel_error(a, b):
    a, b = np.array(a.astype(mx.float32)), np.array(b.astype(mx.float32))
    return float(np.abs(a - b).max() / np.abs(a).max())


def roundtrip_weights(weights, qtype):
    """What a GGUF at ``qtype`` holds, as floats (None: F16 for matrices)."""
    import gguf

    out = {}
    for k, v in weights.items():
        w = np.array(v.astype(mx.float32))
        block = gguf.GGML_QUANT_SIZES[qtype][0] if qtype is not None else None
        if qtype is not None and w.ndim >= 2 and w.shape[-1] % block == 0:
            w = gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype)
        elif w.ndim >= 2:
            w = w.astype(np.float16).astype(np.float32)
        out[k] = mx.array(w)
    return out


def logits_of(path, tokens=TOKENS):
    model = mlx_mtp.load_model(path)
    logits, _ = model.target(mx.array(tokens)[None], model.target.make_cache())
    return model, logits[0]


def gguf_and_reference(tmp_path, family, qtype):
    config, weights = tiny_plain.plain_weights(family)
    arch = tiny_plain.GGUF_ARCH[family]
    gguf_path = tiny_plain.write_gguf(
        tmp_path / f"{family}.gguf", arch, config, weights, qtype
    )
    ref = tiny.save_folder(tmp_path / "ref", config, roundtrip_weights(weights, qtype))
    return gguf_path, ref


@pytest.mark.parametrize("family", list(tiny_plain.PLAIN_CONFIGS))
def test_f16_gguf_matches_hf_path(tmp_path, family):
    gguf_path, ref = gguf_and_reference(tmp_path, family, None)
    out = convert(
        gguf_path, tmp_path / "out", progress=True
    )  # the bar must not get in the way
    _, a = logits_of(ref)
    _, b = logits_of(out)
    assert rel_error(a, b) < BOUND_F16
    assert json.loads((out / "config.json").read_text())["rope_theta"] == 50000.0


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1])
def test_block_quants_map_without_second_rounding(tmp_path, qtype):
    gguf_path, ref = gguf_and_reference(tmp_path, "llama", qtype)
    out = convert(gguf_path, tmp_path / "out", dtype="float32")
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"]["group_size"] == 32
    stored = mx.load(str(out / "model.safetensors"))
    ref_w = mx.load(str(ref / "model.safetensors"))
    # every matrix dequantizes to exactly what the gguf package dequantizes
    name = "model.layers.1.self_attn.k_proj"  # permuted rows, so the unpermute is checked too
    bits = 8 if qtype == Q.Q8_0 else 4
    w = mx.dequantize(
        stored[f"{name}.weight"],
        stored[f"{name}.scales"],
        stored[f"{name}.biases"],
        32,
        bits,
    )
    np.testing.assert_array_equal(np.array(w), np.array(ref_w[f"{name}.weight"]))
    _, a = logits_of(ref)
    _, b = logits_of(out)
    assert rel_error(a, b) < 1e-5


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.Q5_0])
def test_other_types_are_dequantized(tmp_path, qtype):
    """K-quants (mx.load casts or refuses them) and Q5_0 go through gguf's dequantize."""
    import gguf

    # 256-wide rows: K-quant super-blocks hold 256 values
    config, weights = tiny_plain.plain_weights(
        "llama", hidden_size=256, intermediate_size=256, head_dim=64
    )
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    raws, floats = {}, dict(weights)
    for k, v in weights.items():
        if v.ndim == 2 and v.shape[-1] % block == 0:
            if qtype in (Q.Q5_0,):
                raw = gguf.quants.quantize(np.array(v), qtype)
            else:
                raw = tiny_plain.random_k_quant(*v.shape, qtype, seed=len(raws))
            raws[k] = raw
            floats[k] = mx.array(gguf.quants.dequantize(raw, qtype))
    assert raws
    path = tiny_plain.write_gguf(
        tmp_path / "m.gguf", "llama", config, {**weights, **raws}, raw_type=qtype
    )
    plain = roundtrip_weights({k: v for k, v in weights.items() if k not in raws}, None)
    ref = tiny.save_folder(tmp_path / "ref", config, {**floats, **plain})
    out = convert(path, tmp_path / "out", dtype="float32")
    assert "quantization" not in json.loads((out / "config.json").read_text())
    _, a = logits_of(ref)
    _, b = logits_of(out)
    assert rel_error(a, b) < 1e-5
    q = convert(path, tmp_path / "q", quantize=True, q_bits=8)
    assert json.loads((q / "config.json").read_text())["quantization"]["bits"] == 8


def test_repack_matches_mx_load(tmp_path):
    """mx.load reads Q4_0/Q4_1/Q8_0 as group-32 affine: our repack gives the same arrays."""
    import gguf

    w = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
    for qtype in (Q.Q8_0, Q.Q4_0, Q.Q4_1):
        writer = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "llama")
        raw = gguf.quants.quantize(w, qtype)
        writer.add_tensor("t.weight", raw, raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        theirs = mx.load(str(tmp_path / "t.gguf"))
        ours = repack(raw, qtype)
        for got, key in zip(ours, ("weight", "scales", "biases")):
            np.testing.assert_array_equal(np.array(got), np.array(theirs[f"t.{key}"]))


@pytest.mark.parametrize(
    "family,arch,joined_kv_b",
    [
        ("glm4_moe", "glm4moe", False),
        ("deepseek_v3", "deepseek2", False),
        ("deepseek_v3", "deepseek2", True),
        ("glm_moe_dsa", "glm-dsa", False),
    ],
)
def test_moe_gguf_with_nextn_head(tmp_path, tiny_folders, family, arch, joined_kv_b):
    """blk.N.nextn.* and the MTP block come back as the head: same logits as HF.

    DeepSeek's MLA comes as llama.cpp splits it (attn_k_b, attn_v_b, MQA keys),
    or, as older files have it, joined (attn_kv_b).
    """
    from mlx.utils import tree_flatten
    from mlx_mtp.convert.model import head_tensors

    config = dict(tiny.CONFIGS[family], model_type=family)
    # the GGUF holds mlx-lm names (stacked experts, split MLA), as llama.cpp stores them
    ref_model = mlx_mtp.load_model(convert(tiny_folders(family)[0], tmp_path / "hf"))
    weights = dict(tree_flatten(ref_model.target.model.parameters()))
    weights.update(head_tensors("model.layers.2.", ref_model.head))
    if joined_kv_b:
        attn = {k: v for k, v in weights.items() if ".self_attn." in k}
        weights = {k: v for k, v in weights.items() if k not in attn}
        weights.update(tiny._unsanitize(attn, config))
        assert "model.layers.0.self_attn.kv_b_proj.weight" in weights
    path = tiny_plain.write_gguf(tmp_path / "m.gguf", arch, config, weights)
    out = convert(path, tmp_path / "out", dtype="float32")
    ref = tiny.save_folder(tmp_path / "ref", config, roundtrip_weights(weights, None))
    got, expect = mlx_mtp.load_model(out), mlx_mtp.load_model(ref)
    assert got.model_type == family and got.head is not None
    _, a = logits_of(ref)
    _, b = logits_of(out)
    assert rel_error(a, b) < 1e-5
    assert rel_error(mtp_logits(expect, TOKENS), mtp_logits(got, TOKENS)) < 1e-5


def k_quant_gguf(tmp_path, qtypes):
    """A llama GGUF whose matrices are random K-quant blocks, in turn of ``qtypes``.

    Returns (path, every tensor's values as the gguf package reads them, types).
    """
    import gguf

    config, weights = tiny_plain.plain_weights(
        "llama", hidden_size=256, intermediate_size=256, head_dim=64
    )
    raws, kinds, floats = {}, {}, dict(weights)
    for k, v in weights.items():
        if v.ndim == 2 and v.shape[-1] % 256 == 0:
            kinds[k] = qtypes[len(raws) % len(qtypes)]
            raws[k] = tiny_plain.random_k_quant(*v.shape, kinds[k], seed=len(raws))
            floats[k] = mx.array(gguf.quants.dequantize(raws[k], kinds[k]))
    path = tiny_plain.write_gguf(
        tmp_path / "k.gguf", "llama", config, {**weights, **raws}, raw_type=kinds
    )
    plain = roundtrip_weights({k: v for k, v in weights.items() if k not in raws}, None)
    return path, {**floats, **plain}, kinds, config


def stored_matrix(out, name, bits):
    stored = mx.load(str(out / "model.safetensors"))
    return mx.dequantize(
        stored[f"{name}.weight"],
        stored[f"{name}.scales"],
        stored[f"{name}.biases"],
        32,
        bits,
    )


def test_quantized_gguf_stays_quantized_at_the_nearest_width(tmp_path):
    """No precision asked: Q4_K is written at 4 bits, Q6_K at 8, groups of 32."""
    path, floats, kinds, config = k_quant_gguf(tmp_path, [Q.Q4_K, Q.Q4_K, Q.Q6_K])
    said = []
    out = convert(path, tmp_path / "out", notify=said.append)
    assert said == [
        "GGUF weights are Q4_K, Q6_K: writing 4-bit MLX (group 32), 8-bit for Q6_K; "
        "--dtype float32 keeps full precision"
    ]
    quant = json.loads((out / "config.json").read_text())["quantization"]
    assert (quant["bits"], quant["group_size"]) == (4, 32)
    for name, kind in kinds.items():
        module = name[: -len(".weight")]
        bits = 8 if kind == Q.Q6_K else 4
        assert quant.get(module, {"bits": 4})["bits"] == bits, module
        w = np.array(stored_matrix(out, module, bits).astype(mx.float32))
        ref = np.array(floats[name])
        # a GGUF 32-value (sub-)block kept on a grid as fine as its own: what is
        # lost is a fraction of the GGUF's own step
        step = np.abs(ref).max() / (7 if bits == 4 else 31)
        assert np.abs(w - ref).max() < step, module
    ref = tiny.save_folder(tmp_path / "ref", config, floats)
    _, a = logits_of(ref)
    _, b = logits_of(out)
    assert rel_error(a, b) < 2e-2
    full = convert(path, tmp_path / "full", dtype="float32")
    assert "quantization" not in json.loads((full / "config.json").read_text())
    assert out.joinpath("model.safetensors").stat().st_size < 0.5 * (
        full.joinpath("model.safetensors").stat().st_size
    )


def test_block_quant_gguf_says_its_type(tmp_path):
    gguf_path, _ = gguf_and_reference(tmp_path, "llama", Q.Q4_1)
    said = []
    out = convert(gguf_path, tmp_path / "out", notify=said.append)
    assert said == [
        "GGUF weights are Q4_1: writing 4-bit MLX (group 32); "
        "--dtype float32 keeps full precision"
    ]
    assert json.loads((out / "config.json").read_text())["quantization"]["bits"] == 4
    said.clear()
    (tmp_path / "f").mkdir()
    f16, _ = gguf_and_reference(tmp_path / "f", "llama", None)
    convert(f16, tmp_path / "f16", notify=said.append)
    assert said == []  # a float GGUF has nothing to choose


def test_corrupt_gguf_is_refused(tmp_path):
    gguf_path, _ = gguf_and_reference(tmp_path, "qwen3", None)
    data = gguf_path.read_bytes()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(data[: len(data) // 2])
    with pytest.raises(MTPError, match="bad.gguf"):
        convert(bad, tmp_path / "out")
    assert not any(p.name.startswith("out") for p in tmp_path.iterdir())


def test_unsupported_gguf_architecture_is_refused(tmp_path):
    config, weights = tiny_plain.plain_weights("llama")
    path = tiny_plain.write_gguf(tmp_path / "m.gguf", "llama", config, weights)
    data = (
        path.read_bytes()
        .replace(b"llama.", b"lxama.")
        .replace(
            b"\x05\x00\x00\x00\x00\x00\x00\x00llama",
            b"\x05\x00\x00\x00\x00\x00\x00\x00lxama",
        )
    )
    (tmp_path / "x.gguf").write_bytes(data)
    with pytest.raises(MTPError, match="lxama"):
        convert(tmp_path / "x.gguf", tmp_path / "out")
    assert not any(p.name.startswith("out") for p in tmp_path.iterdir())


def test_unsupported_quant_type_and_missing_tokenizer_are_refused(tmp_path):
    import gguf

    config, weights = tiny_plain.plain_weights(
        "llama", hidden_size=256, intermediate_size=256, head_dim=64
    )
    name = "model.layers.0.mlp.up_proj.weight"
    rows, cols = weights[name].shape
    raw = np.zeros((rows, cols // 256 * gguf.GGML_QUANT_SIZES[Q.Q8_K][1]), np.uint8)
    path = tiny_plain.write_gguf(
        tmp_path / "q8k.gguf", "llama", config, {**weights, name: raw}, raw_type=Q.Q8_K
    )
    with pytest.raises(MTPError, match="unsupported quantization type Q8_K"):
        convert(path, tmp_path / "out")
    bare = tiny_plain.write_gguf(
        tmp_path / "bare.gguf", "llama", config, weights, tokenizer=False
    )
    with pytest.raises(MTPError, match="no tokenizer"):
        convert(bare, tmp_path / "out")
    assert not any(p.name.startswith("out") for p in tmp_path.iterdir())


def test_tokenizer_builders_of_older_transformers(tmp_path, monkeypatch):
    """transformers 5.7-5.17 (which mlx-lm accepts) keep the GGUF tokenizer
    builders in ``integrations.ggml``; 5.18 moved them. Both convert."""
    import sys
    import types

    from transformers.integrations.gguf import gguf_tokenizer_mapping as new

    old = types.ModuleType("transformers.integrations.ggml")
    old.GGUF_TOKENIZER_MAPPING = new.GGUF_TOKENIZER_MAPPING
    old.convert_gguf_tokenizer = new.convert_gguf_tokenizer
    moved = "transformers.integrations.gguf.gguf_tokenizer_mapping"
    monkeypatch.setitem(sys.modules, moved, None)  # as if it did not exist
    monkeypatch.setitem(sys.modules, "transformers.integrations.ggml", old)
    import transformers.integrations as integrations

    monkeypatch.setattr(integrations, "ggml", old, raising=False)
    gguf_path, ref = gguf_and_reference(tmp_path, "llama", None)
    out = convert(gguf_path, tmp_path / "out")
    assert json.loads((out / "tokenizer.json").read_text())["model"]
    assert (out / "tokenizer_config.json").is_file()
    _, a = logits_of(ref)
    _, b = logits_of(out)
    assert rel_error(a, b) < BOUND_F16
