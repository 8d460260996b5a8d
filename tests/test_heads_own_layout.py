"""Heads in their own checkpoint layouts, pinned against numpy written from the cited wiring.

numpy computes each family's fuse (norms, concat order, projection), whether
position 0 is zeroed, the closing norm and the output head, reading the
checkpoint tensors by their checkpoint names; the decoder block in between is
mlx-lm's own layer class (or, for LongCat, its attention and MLP classes),
built here from the checkpoint tensors, so nothing of our head modules is
reused. Sources: ERNIE, FastDeploy ``ernie4_5_mtp.py``; EXAONE-MoE, vLLM
``exaone_moe_mtp.py``; LongCat-Flash, vLLM ``longcat_flash_mtp.py``.
"""

from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest
from conftest import OWN_LAYOUT_FAMILIES
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache

import mlx_mtp


def rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def run(block, x):
    xm = mx.array(x)[None]
    mask = create_attention_mask(xm, None, return_array=True)
    return np.array(block(xm, mask, KVCache()))[0]


def load(module, weights, prefix):
    module.load_weights(
        [(k[len(prefix) :], v) for k, v in weights.items() if k.startswith(prefix)]
    )
    return module


def ernie(model, w, hidden, tokens):
    args, g = model.target.model.args, lambda k: np.array(w[k])  # noqa: E731
    eps = args.rms_norm_eps
    e = g("model.embed_tokens.weight")[tokens]  # position 0 kept
    x = (
        np.concatenate(
            [
                rms(e, g("model.mtp_emb_norm.0.weight"), eps),
                rms(hidden, g("model.mtp_hidden_norm.0.weight"), eps),
            ],
            -1,
        )
        @ g("model.mtp_linear_proj.0.weight").T
    )
    layer_class = type(model.target.backbone.layers[0])
    dense = replace(args, moe_layer_start_index=args.num_hidden_layers + 1)
    y = run(load(layer_class(dense, 0), w, "model.mtp_block.0."), x)
    # the trunk's own final norm, then the trunk's output head
    return rms(y, g("model.norm.weight"), eps) @ g("lm_head.weight").T


def exaone(model, w, hidden, tokens):
    args, g = model.target.model.args, lambda k: np.array(w[k])  # noqa: E731
    eps = args.rms_norm_eps
    e = g("model.embed_tokens.weight")[tokens]
    x = (
        np.concatenate(
            [
                rms(e, g("mtp.pre_fc_norm_embedding.weight"), eps),
                rms(hidden, g("mtp.pre_fc_norm_hidden.weight"), eps),
            ],
            -1,
        )
        @ g("mtp.fc.weight").T
    )
    n = args.num_hidden_layers
    ext = replace(
        args,
        layer_types=list(args.layer_types) + ["full_attention"],
        is_moe_layer=list(args.is_moe_layer) + [False],
    )
    layer_class = type(model.target.backbone.layers[0])
    y = run(load(layer_class(ext, n), w, "mtp.layers.0."), x)
    return rms(y, g("mtp.norm.weight"), eps) @ g("lm_head.weight").T


def longcat(model, w, hidden, tokens):
    from mlx_lm.models.longcat_flash import LongcatFlashMLA, LongcatFlashMLP

    args, g = model.target.model.args, lambda k: np.array(w[k])  # noqa: E731
    eps, pre = args.rms_norm_eps, "model.mtp.layers.0."
    e = g("model.mtp.embed_tokens.weight")[tokens]  # the head's own embedding
    x = (
        np.concatenate(
            [
                rms(e, g(pre + "enorm.m.weight"), eps),
                rms(hidden, g(pre + "hnorm.m.weight"), eps),
            ],
            -1,
        )
        @ g(pre + "eh_proj.weight").T
    )
    # kv_b_proj [heads * (nope + v), rank] -> per-head nope part (transposed) and v part
    attn_w = {k: v for k, v in w.items() if k.startswith(pre + "self_attn.")}
    kv_b = g(pre + "self_attn.kv_b_proj.weight").reshape(
        args.num_attention_heads, -1, args.kv_lora_rank
    )
    del attn_w[pre + "self_attn.kv_b_proj.weight"]
    nope = args.qk_nope_head_dim
    attn_w[pre + "self_attn.embed_q.weight"] = mx.array(
        kv_b[:, :nope].swapaxes(1, 2).copy()
    )
    attn_w[pre + "self_attn.unembed_out.weight"] = mx.array(kv_b[:, nope:].copy())
    attn = load(LongcatFlashMLA(args), attn_w, pre + "self_attn.")
    mlp = load(LongcatFlashMLP(args), w, pre + "transformer_layer.mlp.")

    def block(xm, mask, cache):
        h = xm + attn(
            mx.fast.rms_norm(xm, w[pre + "input_layernorm.weight"], eps), mask, cache
        )
        return h + mlp(
            mx.fast.rms_norm(h, w[pre + "post_attention_layernorm.weight"], eps)
        )

    y = run(block, x)
    return rms(y, g("model.mtp.norm.weight"), eps) @ g("lm_head.weight").T


REFERENCES = {"ernie4_5_moe": ernie, "exaone_moe": exaone, "longcat_flash": longcat}


@pytest.mark.parametrize("family", OWN_LAYOUT_FAMILIES)
def test_head_matches_numpy(tiny_folders, family):
    full, _ = tiny_folders(family)
    model = mlx_mtp.load_model(full)
    weights = mx.load(str(full / "model.safetensors"))
    rng = np.random.default_rng(1)
    hidden = rng.standard_normal((6, model.config["hidden_size"])).astype(np.float32)
    tokens = rng.integers(0, 256, 6)
    expected = REFERENCES[family](model, weights, hidden, tokens)
    got, _ = model.head(
        mx.array(hidden)[None], mx.array(tokens)[None], model.head.make_cache()
    )
    np.testing.assert_allclose(np.array(got[0]), expected, rtol=1e-4, atol=1e-4)


def test_every_family_has_a_reference():
    assert set(REFERENCES) == set(OWN_LAYOUT_FAMILIES)
