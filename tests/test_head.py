"""The MTP head's math, pinned against numpy written from docs/design.md section 3.

numpy computes the fuse (norms, concat order, projection), the position-0
embedding zeroing, the closing norm and the output head; the decoder block in
between is mlx-lm's own layer class, built separately from the checkpoint
tensors through mlx-lm's sanitize, so nothing of our head module is reused.
"""

import mlx.core as mx
import numpy as np
import pytest
from conftest import DRAFT_FAMILIES
from mlx.utils import tree_flatten
from mlx_lm.models.base import create_attention_mask
from mlx_lm.utils import _get_classes

import mlx_mtp
from mlx_mtp.heads import family_for


def rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def reference_block(config, weights, prefix, model_type):
    """mlx-lm's decoder layer for index N, loaded from the checkpoint tensors."""
    model_class, args_class = _get_classes(config)
    args = args_class.from_dict(config)
    trunk = model_class(args)
    n = config["num_hidden_layers"]
    layer_cls = type(trunk.model.layers[0])
    block = layer_cls(args) if model_type == "mimo" else layer_cls(args, n)
    own = {"enorm", "hnorm", "eh_proj", "embed_tokens", "shared_head"}
    own |= {"token_layernorm", "hidden_layernorm", "input_proj", "final_layernorm"}
    raw = {
        "model.layers.0." + k[len(prefix) :]: v
        for k, v in weights.items()
        if k.startswith(prefix) and k[len(prefix) :].split(".")[0] not in own
    }
    clean = trunk.sanitize(raw)
    block.load_weights([(k[len("model.layers.0.") :], v) for k, v in clean.items()])
    return block


def numpy_head(model_type, w, prefix, eps, hidden, tokens, block, first, cache):
    g = lambda name: np.array(w[prefix + name])  # noqa: E731
    if model_type == "mimo":
        e = np.array(w["model.embed_tokens.weight"])[tokens]
        if first:
            e[0] = 0
        x = np.concatenate(
            [rms(hidden, g("hidden_layernorm.weight"), eps),
             rms(e, g("token_layernorm.weight"), eps)], -1
        ) @ g("input_proj.weight").T
    else:
        e = g("embed_tokens.weight")[tokens]
        if first:
            e[0] = 0
        x = np.concatenate(
            [rms(e, g("enorm.weight"), eps), rms(hidden, g("hnorm.weight"), eps)], -1
        ) @ g("eh_proj.weight").T
    xm = mx.array(x)[None]
    y = np.array(block(xm, create_attention_mask(xm, None, return_array=True), cache))[0]
    if model_type == "mimo":
        h = rms(y, g("final_layernorm.weight"), eps)
        return h @ np.array(w["lm_head.weight"]).T
    h = rms(y, g("shared_head.norm.weight"), eps)
    return h @ g("shared_head.head.weight").T


@pytest.mark.parametrize("family", DRAFT_FAMILIES)
def test_head_matches_numpy(tiny_folders, family):
    full, _ = tiny_folders(family)
    model = mlx_mtp.load_model(full)
    weights = mx.load(str(full / "model.safetensors"))
    config = model.config
    prefix = family_for(family).prefix(config, 0)
    block = reference_block(config, weights, prefix, family)
    rng = np.random.default_rng(1)
    hidden = rng.standard_normal((6, config["hidden_size"])).astype(np.float32)
    tokens = rng.integers(0, 256, 6)
    # a fresh cache of the trunk's kind for one layer (DSA: [latent, indexer keys])
    cache = model.target.make_cache()[0]
    expected = numpy_head(
        family, weights, prefix, config["rms_norm_eps"], hidden, tokens, block, True, cache
    )
    got, _ = model.head(mx.array(hidden)[None], mx.array(tokens)[None], model.head.make_cache())
    np.testing.assert_allclose(np.array(got[0]), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe", "glm4_moe_lite"])
def test_moe_where_the_trunk_has_moe(tiny_folders, family):
    model = mlx_mtp.load_model(tiny_folders(family)[0])
    trunk_moe = type(model.target.backbone.layers[-1].mlp)
    assert type(model.head.block.mlp) is trunk_moe
    assert any("switch_mlp" in k for k, _ in tree_flatten(model.head.parameters()))


def test_missing_embedding_and_head_fall_back_to_the_trunk(tmp_path):
    """GLM-4.6 ships no nextn embed_tokens / shared_head.head."""
    import tiny

    config, trunk_w, mtp_w = tiny.build_weights("glm4_moe")
    n = config["num_hidden_layers"]
    for name in ("embed_tokens.weight", "shared_head.head.weight"):
        mtp_w.pop(f"model.layers.{n}.{name}")
    folder = tiny.save_folder(tmp_path / "glm46", config, trunk_w, mtp_w, tokenizer=False)
    model = mlx_mtp.load_model(folder)
    assert "embed_tokens" not in model.head and "head" not in model.head.shared_head
    # the builder's nextn copies equal the trunk's, so the logits are unchanged
    full = tiny.save_folder(tmp_path / "full", *tiny.build_weights("glm4_moe"), tokenizer=False)
    ref = mlx_mtp.load_model(full)
    tokens = list(range(30, 50))
    np.testing.assert_allclose(
        np.array(mlx_mtp.mtp_logits(model, tokens)),
        np.array(mlx_mtp.mtp_logits(ref, tokens)),
        rtol=1e-5,
        atol=1e-5,
    )


@pytest.mark.parametrize("family", DRAFT_FAMILIES)
def test_teacher_forced_logits_match_step_by_step(tiny_folders, family):
    model = mlx_mtp.load_model(tiny_folders(family)[0])
    tokens = list(range(20, 45))
    batched = mlx_mtp.mtp_logits(model, tokens)
    assert batched.shape == (len(tokens) - 1, model.config["vocab_size"])
    _, hidden = model.target(mx.array(tokens)[None], model.target.make_cache())
    cache = model.head.make_cache()
    for i in range(len(tokens) - 1):
        row, _ = model.head(hidden[:, i : i + 1], mx.array([[tokens[i + 1]]]), cache)
        np.testing.assert_allclose(np.array(row[0, 0]), np.array(batched[i]), atol=1e-4, rtol=1e-4)


def test_pre_norm_tap_feeds_a_different_hidden_state(tiny_folders):
    full, _ = tiny_folders("deepseek_v3")
    post = mlx_mtp.load_model(full)
    pre = mlx_mtp.load_model(full, hidden_tap="pre")
    assert post.target.hidden_tap == "post" and pre.target.hidden_tap == "pre"
    tokens = list(range(10, 30))
    a, b = mlx_mtp.mtp_logits(post, tokens), mlx_mtp.mtp_logits(pre, tokens)
    assert not np.allclose(np.array(a), np.array(b))
    # the tap changes drafts only, never the trunk's logits
    la, _ = post.target(mx.array(tokens)[None], post.target.make_cache())
    lb, _ = pre.target(mx.array(tokens)[None], pre.target.make_cache())
    np.testing.assert_array_equal(np.array(la), np.array(lb))
