"""Hugging Face folder -> ``convert`` -> load: same logits, same MTP logits, same greedy output.

At the source's float32 the converted model is bit-identical to the source.
Quantized, the error bounds below are stated relative to the largest logit.
"""

import json

import mlx.core as mx
import numpy as np
import pytest
import tiny
import tiny_hybrid
import tiny_plain
from conftest import DRAFT_FAMILIES, MULTI_LAYER_FAMILIES, OWN_LAYOUT_FAMILIES
from mlx_mtp.convert import convert
from test_speculative import assert_same_or_near_tie, mtp_greedy, reference_greedy

import mlx_mtp
from mlx_mtp.errors import MTPError
from mlx_mtp.generate import mtp_logits
from mlx_mtp.loader import read_config

PLAIN = list(tiny_plain.PLAIN_CONFIGS)
HYBRID = list(tiny_hybrid.MODEL_TYPES)  # Qwen3-Next / Qwen3.5: mtp.* heads
HEADS = DRAFT_FAMILIES + HYBRID + OWN_LAYOUT_FAMILIES + MULTI_LAYER_FAMILIES
TOKENS = list(range(40, 72))
# 8-bit trunk, 8-bit head: max |logit error| / max |logit|
BOUND_8BIT = 0.03


@pytest.fixture(scope="module")
def sources(tiny_folders, tmp_path_factory):
    root = tmp_path_factory.mktemp("plain")

    def get(family):
        if family in PLAIN:
            return tiny_plain.build_plain(root / family, family)
        if family in HYBRID:
            return tiny_hybrid.build_folder(root / family, family)[0]
        return tiny_folders(family)[0]

    return get


@pytest.fixture(scope="module")
def converted(sources, tmp_path_factory):
    root = tmp_path_factory.mktemp("converted")
    done = {}

    def get(family, **options):
        key = (family, tuple(sorted(options.items())))
        if key not in done:
            out = root / f"{family}-{len(done)}"
            done[key] = convert(sources(family), out, **options)
        return done[key]

    return get


def trunk_logits(model, tokens=TOKENS):
    logits, _ = model.target(mx.array(tokens)[None], model.target.make_cache())
    return np.array(logits[0].astype(mx.float32))


def rel_error(a, b):
    return float(np.abs(a - b).max() / np.abs(a).max())


@pytest.mark.parametrize("family", HEADS + PLAIN)
def test_float_round_trip_is_exact(sources, converted, family):
    src = mlx_mtp.load_model(sources(family))
    out = mlx_mtp.load_model(converted(family))
    np.testing.assert_array_equal(trunk_logits(src), trunk_logits(out))
    if family in HEADS:
        assert out.head is not None
        np.testing.assert_array_equal(
            np.array(mtp_logits(src, TOKENS)), np.array(mtp_logits(out, TOKENS))
        )
        assert out.head.num_layers == src.head.num_layers
        for j in range(1, src.head.num_layers):  # every later layer came along
            a, b = src.head.layer(j), out.head.layer(j)
            h = mx.random.normal((1, 8, src.target.embed_tokens.weight.shape[-1]))
            t = mx.array(TOKENS[:8])[None]
            np.testing.assert_array_equal(
                np.array(a(h, t, a.make_cache())[0]), np.array(b(h, t, b.make_cache())[0])
            )


# dense families only: MLX's CPU MoE kernel (GatherMM) runs float32 alone
@pytest.mark.parametrize("family", ["mimo", "qwen3_5", "gemma3_text"])
def test_bfloat16_round_trip_is_exact(sources, converted, family):
    """--dtype bfloat16 stores exactly the source weights rounded to bfloat16."""
    from mlx_mtp.convert.precision import cast

    src = mlx_mtp.load_model(sources(family))
    cast(src.target.model, "bfloat16")
    out = mlx_mtp.load_model(converted(family, dtype="bfloat16"))
    np.testing.assert_array_equal(trunk_logits(src), trunk_logits(out))
    if family not in HEADS:
        return
    cast(src.head, "bfloat16")
    a = mtp_logits(src, TOKENS).astype(mx.float32)
    b = mtp_logits(out, TOKENS).astype(mx.float32)
    np.testing.assert_array_equal(np.array(a), np.array(b))


@pytest.mark.parametrize("family", HEADS)
def test_quantized_round_trip_within_bound(sources, converted, family):
    src = mlx_mtp.load_model(sources(family))
    path = converted(family, quantize=True, q_bits=8, q_group_size=32)
    out = mlx_mtp.load_model(path)
    assert rel_error(trunk_logits(src), trunk_logits(out)) < BOUND_8BIT
    a = np.array(mtp_logits(src, TOKENS))
    b = np.array(mtp_logits(out, TOKENS))
    assert rel_error(a, b) < BOUND_8BIT


@pytest.mark.parametrize("family", HEADS)
def test_mtp_block_precision_follows_policy(converted, family):
    """4-bit trunk: head at 8 bits by default, float with mtp_bits=16, float unquantized."""
    q8 = json.loads((converted(family, quantize=True) / "config.json").read_text())
    quant = q8["quantization"]
    assert (quant["group_size"], quant["bits"]) == (64, 4)
    head_entries = {k: v for k, v in quant.items() if isinstance(v, dict)}
    assert head_entries and all(v["bits"] == 8 for v in head_entries.values())
    with mx.stream(mx.cpu):
        stored = mx.load(str(converted(family, quantize=True) / "mtp.safetensors"))
    quantized = {k[: -len(".scales")] for k in stored if k.endswith(".scales")}
    assert quantized == set(head_entries)

    q16 = converted(family, quantize=True, mtp_bits=16)
    stored = mx.load(str(q16 / "mtp.safetensors"))
    assert not any(k.endswith(".scales") for k in stored)
    assert mlx_mtp.load_model(q16).head is not None

    flt = converted(family)
    assert "quantization" not in json.loads((flt / "config.json").read_text())


@pytest.mark.parametrize("family", HEADS)
def test_greedy_mtp_equals_plain_mlx_lm(converted, family):
    """The converted quantized folder: MTP greedy == mlx-lm greedy on the same folder."""
    from mlx_lm import load as mlx_lm_load

    path = converted(family, quantize=True)
    model = mlx_mtp.load_model(path)
    reference, _ = mlx_lm_load(str(path))  # plain mlx-lm: the trunk alone
    prompt = list(range(60, 90))
    expected = reference_greedy(reference, prompt, 24)
    got, stats, _ = mtp_greedy(model, prompt, 24, draft_max=3)
    assert_same_or_near_tie(reference, prompt, expected, got)
    assert stats.drafted > 0


def test_plain_mlx_lm_loads_the_trunk(converted):
    from mlx_lm import load as mlx_lm_load

    path = converted("deepseek_v3", quantize=True)
    model, tokenizer = mlx_lm_load(str(path))
    ours = mlx_mtp.load_model(path)
    logits = model(mx.array(TOKENS)[None])
    np.testing.assert_array_equal(np.array(logits[0]), trunk_logits(ours))
    assert tokenizer.chat_template == tiny.CHAT_TEMPLATE


def test_rope_parameters_config_is_read_right(tmp_path):
    """A transformers-5 config (rope_parameters only) converts to one mlx-lm reads right."""
    from mlx_lm import load as mlx_lm_load

    config, weights = tiny_plain.plain_weights("llama")
    theta = config.pop("rope_theta")
    drifted = dict(
        config, rope_parameters={"rope_theta": theta, "rope_type": "default"}
    )
    src = tiny.save_folder(tmp_path / "src", drifted, weights)
    right = tiny.save_folder(
        tmp_path / "right", dict(config, rope_theta=theta), weights
    )
    out = convert(src, tmp_path / "out")
    assert json.loads((out / "config.json").read_text())["rope_theta"] == theta
    a, _ = mlx_lm_load(str(out))
    b, _ = mlx_lm_load(str(right))
    wrong, _ = mlx_lm_load(str(src))  # what mlx-lm does with the raw config
    x = mx.array(TOKENS)[None]
    np.testing.assert_array_equal(np.array(a(x)), np.array(b(x)))
    assert not np.allclose(np.array(wrong(x)), np.array(b(x)), atol=1e-3)


# --- refusals: one-line errors, nothing written ----------------------------


def _nothing_written(parent, name):
    return not any(p.name.startswith(name) for p in parent.iterdir())


def test_existing_output_is_refused_unless_forced(sources, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep").write_text("x")
    with pytest.raises(MTPError, match="exists"):
        convert(sources("llama"), out)
    # --force replaces a model or an empty folder, never a folder of other files
    with pytest.raises(MTPError, match="not a model"):
        convert(sources("llama"), out, force=True)
    assert [p.name for p in out.iterdir()] == ["keep"]
    (out / "keep").unlink()
    convert(sources("llama"), out, force=True)  # empty
    convert(sources("qwen2"), out, force=True)  # a model
    assert read_config(out)["model_type"] == "qwen2"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_missing_tokenizer_is_refused(tmp_path):
    config, weights = tiny_plain.plain_weights("qwen3")
    src = tiny.save_folder(tmp_path / "src", config, weights, tokenizer=False)
    with pytest.raises(MTPError, match="no tokenizer"):
        convert(src, tmp_path / "out")
    assert _nothing_written(tmp_path, "out")


def test_truncated_weights_are_refused(sources, tmp_path):
    import shutil

    src = shutil.copytree(sources("qwen2"), tmp_path / "src")
    data = (src / "model.safetensors").read_bytes()
    (src / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(MTPError, match="model.safetensors"):
        convert(src, tmp_path / "out")
    assert _nothing_written(tmp_path, "out")


def test_unsupported_architecture_is_refused(sources, tmp_path):
    import shutil

    src = shutil.copytree(sources("qwen2"), tmp_path / "src")
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(
        json.dumps(dict(config, model_type="no_such_model"))
    )
    with pytest.raises(MTPError, match="no_such_model"):
        convert(src, tmp_path / "out")
    assert _nothing_written(tmp_path, "out")


def test_interrupt_leaves_nothing(sources, tmp_path, monkeypatch):
    import mlx_mtp.convert.pipeline as pipeline

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(pipeline, "write_config", interrupted)
    with pytest.raises(KeyboardInterrupt):
        convert(sources("mimo"), tmp_path / "out")
    assert _nothing_written(tmp_path, "out")
