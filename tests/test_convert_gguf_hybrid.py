"""Qwen3-Next / Qwen3.5 GGUFs, written as llama.cpp's converter writes them, convert to the HF result.

``tiny_hybrid.write_gguf`` re-implements llama.cpp's transforms (norms + 1,
``-exp(A_log)``, squeezed conv, the qwen3next q/k/v/z split, Qwen3.5's tiled V
heads, MTP tensors as ``blk.N.nextn.*`` and ``blk.{N+j}.*``). The reference is
the same Hugging Face checkpoint with its matrices rounded to float16 as the
GGUF stores them: trunk and MTP logits must agree to float32 arithmetic.
"""

import mlx.core as mx
import numpy as np
import pytest
import tiny
import tiny_hybrid
from gguf import GGMLQuantizationType as Q
from mlx_mtp.convert import add_mtp, convert
from mlx_mtp.convert.describe import describe

import mlx_mtp
from mlx_mtp.errors import MTPError
from mlx_mtp.generate import mtp_logits

TOKENS = list(range(40, 72))
FAMILIES = list(tiny_hybrid.GGUF_ARCH)


def f16(weights):
    """What an F16 GGUF holds: matrices rounded to float16, vectors kept."""
    return {
        k: v.astype(mx.float16).astype(mx.float32) if v.ndim >= 2 else v
        for k, v in weights.items()
    }


def rel_error(a, b):
    a, b = np.array(a.astype(mx.float32)), np.array(b.astype(mx.float32))
    return float(np.abs(a - b).max() / np.abs(a).max())


def trunk_logits(model):
    logits, _ = model.target(mx.array(TOKENS)[None], model.target.make_cache())
    return logits[0]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root, done = tmp_path_factory.mktemp("gguf-hybrid"), {}

    def get(family):
        if family not in done:
            config, trunk_w, mtp_w = tiny_hybrid.build_weights(family)
            weights = {**trunk_w, **mtp_w}
            path = tiny_hybrid.write_gguf(
                root / f"{family}.gguf", family, config, weights
            )
            ref = tiny.save_folder(root / f"{family}-ref", config, f16(weights))
            done[family] = (path, ref, config, weights)
        return done[family]

    return get


@pytest.mark.parametrize("family", FAMILIES)
def test_gguf_gives_the_hf_trunk_and_head(built, tmp_path, family):
    path, ref, _, _ = built(family)
    out = convert(path, tmp_path / "out", dtype="float32")
    got, expect = mlx_mtp.load_model(out), mlx_mtp.load_model(ref)
    assert got.model_type == family
    assert rel_error(trunk_logits(expect), trunk_logits(got)) < 1e-5
    if family == "qwen3_next":  # llama.cpp's qwen3next files carry no head
        assert got.head is None and describe(path).mtp_layers == 0
        return
    assert got.head is not None and describe(path).mtp_layers == 1
    assert rel_error(mtp_logits(expect, TOKENS), mtp_logits(got, TOKENS)) < 1e-5


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_quantized_gguf_stays_close(built, tmp_path, family):
    _, ref, config, weights = built(family)
    path = tiny_hybrid.write_gguf(
        tmp_path / "q.gguf", family, config, weights, qtype=Q.Q8_0
    )
    got = mlx_mtp.load_model(convert(path, tmp_path / "out", dtype="float32"))
    expect = mlx_mtp.load_model(ref)
    assert rel_error(trunk_logits(expect), trunk_logits(got)) < 0.03
    assert rel_error(mtp_logits(expect, TOKENS), mtp_logits(got, TOKENS)) < 0.03


@pytest.mark.parametrize("family", FAMILIES)
def test_mtp_only_onto_a_gguf_trunk(built, tmp_path, family):
    """A trunk from a head-less GGUF takes its head later: from the HF folder or a GGUF."""
    path, ref, config, weights = built(family)
    bare = tiny_hybrid.write_gguf(
        tmp_path / "bare.gguf", family, config, weights, mtp=False
    )
    trunk = convert(bare, tmp_path / "trunk", dtype="float32")
    assert mlx_mtp.load_model(trunk).head is None
    # qwen3next GGUFs have no head to give: it comes from the Hugging Face folder
    source = ref if family == "qwen3_next" else path
    add_mtp(source, trunk)
    got, expect = mlx_mtp.load_model(trunk), mlx_mtp.load_model(ref)
    assert got.head is not None
    assert rel_error(mtp_logits(expect, TOKENS), mtp_logits(got, TOKENS)) < 1e-5


def test_separate_mtp_gguf(built, tmp_path):
    """llama.cpp's ``mtp-*.gguf`` (embedding, output and the NextN block) beside a bare trunk."""
    import gguf

    path, ref, config, weights = built("qwen3_5")
    bare = tiny_hybrid.write_gguf(
        tmp_path / "bare.gguf", "qwen3_5", config, weights, mtp=False
    )
    reader = gguf.GGUFReader(str(path))
    n = config["text_config"]["num_hidden_layers"]
    keep = ("token_embd.", "output_norm.", "output.", f"blk.{n}.")
    head_only = {
        k: v
        for k, v in weights.items()
        if k.startswith("mtp.")
        or "embed_tokens" in k
        or k == "lm_head.weight"
        or k.endswith("language_model.norm.weight")
    }
    mtp_path = tiny_hybrid.write_gguf(
        tmp_path / "mtp-x.gguf", "qwen3_5", config, head_only
    )
    names = [t.name for t in gguf.GGUFReader(str(mtp_path)).tensors]
    assert names and all(name.startswith(keep) for name in names)
    assert len(reader.tensors) > len(names)
    out = convert(bare, tmp_path / "out", dtype="float32", mtp_gguf=mtp_path)
    got, expect = mlx_mtp.load_model(out), mlx_mtp.load_model(ref)
    assert rel_error(mtp_logits(expect, TOKENS), mtp_logits(got, TOKENS)) < 1e-5


def test_older_qwen3next_layout_is_refused(built, tmp_path):
    """``ssm_in`` (the q/k/v/z projection in one tensor) is not what today's converter writes."""
    _, _, config, weights = built("qwen3_next")
    bad = tiny_hybrid.write_gguf(
        tmp_path / "old.gguf",
        "qwen3_next",
        config,
        weights,
        rename={"blk.0.attn_qkv.weight": "blk.0.ssm_in.weight"},
    )
    with pytest.raises(MTPError, match="ssm_in"):
        convert(bad, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_step35_gguf_gives_the_hf_trunk_and_every_mtp_layer(tmp_path):
    """Step-3.5's three MTP layers come back from ``blk.{N+j}`` (llama.cpp's step35)."""
    import tiny_own_layout

    config, trunk_w, mtp_w = tiny_own_layout.build_weights("step3p5")
    weights = {**trunk_w, **mtp_w}
    path = tiny_own_layout.write_step35_gguf(tmp_path / "s.gguf", config, weights)
    ref = tiny.save_folder(tmp_path / "ref", config, f16(weights))
    got = mlx_mtp.load_model(convert(path, tmp_path / "out", dtype="float32"))
    expect = mlx_mtp.load_model(ref)
    assert describe(path).mtp_layers == 3 and got.head.num_layers == 3
    assert rel_error(trunk_logits(expect), trunk_logits(got)) < 1e-5
    for j in range(3):
        a, b = expect.head.layer(j), got.head.layer(j)
        h = mx.random.normal((1, 9, config["hidden_size"]))
        t = mx.array(TOKENS[:9])[None]
        assert rel_error(a(h, t, a.make_cache())[0], b(h, t, b.make_cache())[0]) < 1e-5


def test_step35_mtp_only_onto_a_gguf_trunk(tmp_path):
    import tiny_own_layout

    config, trunk_w, mtp_w = tiny_own_layout.build_weights("step3p5")
    weights = {**trunk_w, **mtp_w}
    full = tiny_own_layout.write_step35_gguf(tmp_path / "s.gguf", config, weights)
    bare = tiny_own_layout.write_step35_gguf(tmp_path / "b.gguf", config, trunk_w, mtp=False)
    trunk = convert(bare, tmp_path / "trunk", dtype="float32")
    assert mlx_mtp.load_model(trunk).head is None
    add_mtp(full, trunk)
    got = mlx_mtp.load_model(trunk)
    expect = mlx_mtp.load_model(
        tiny.save_folder(tmp_path / "ref", config, f16(weights))
    )
    assert got.head.num_layers == 3
    assert rel_error(mtp_logits(expect, TOKENS), mtp_logits(got, TOKENS)) < 1e-5
