"""Step-3.5 and MiMo-V2-Flash heads in their real layouts: layer j drafts depth j + 1.

Greedy output is mlx-lm's at every draft length, stop tokens and max_tokens
inside a draft included; per-depth stats match a recount from the reference
output; each layer's cache after generation equals a fresh run over exactly
the pairs it should have read; each layer's teacher-forced logits equal numpy
written from the cited wiring (vLLM ``step3p5_mtp.py``, ``mimo_v2_mtp.py``)
around mlx-lm's own decoder layer.
"""

from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest
import tiny_own_layout
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache
from test_multilayer import fresh_layer_states
from test_speculative import (
    PREFILL,
    assert_same_or_near_tie,
    assert_states_close,
    mtp_greedy,
    reference_greedy,
)

import mlx_mtp
from mlx_mtp.heads import MultiLayerHead

FAMILIES = list(tiny_own_layout.MULTI_LAYER_TYPES)
LAYERS = 3


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from mlx_lm.utils import load_model as mlx_lm_load_model

    root, loaded = tmp_path_factory.mktemp("multi2026"), {}

    def get(family):
        if family not in loaded:
            full, trunk = tiny_own_layout.build_folder(root / family, family)
            loaded[family] = (
                mlx_mtp.load_model(full),
                mlx_lm_load_model(trunk)[0],
                mx.load(str(full / "model.safetensors")),
            )
        return loaded[family]

    return get


def recount(stats, prompt_out, start):
    """Per-depth acceptance from the drafts and the reference output alone."""
    reached, kept, pos = [], [], start
    for r in stats.trace:
        for d, token in enumerate(r.drafted):
            while len(reached) <= d:
                reached.append(0)
                kept.append(0)
            reached[d] += 1
            if token != prompt_out[pos + d]:
                break
            kept[d] += 1
        pos += r.accepted + 1
    return [k / r for k, r in zip(kept, reached)]


@pytest.mark.parametrize("family", FAMILIES)
def test_every_layer_loads_its_own_tensors(models, family):
    model, _, _ = models(family)
    head = model.head
    assert isinstance(head, MultiLayerHead) and head.num_layers == LAYERS
    w = [np.array(head.layer(j).block.mlp.down_proj.weight) for j in (0, 2)]
    w += [np.array(head.layer(j).enorm.weight) for j in range(LAYERS)]
    assert not np.allclose(w[0], w[1])  # the blocks' own tensors
    assert not any(np.allclose(w[2 + i], w[3 + i]) for i in range(LAYERS - 1))
    # Step-3.5 hands over the trunk's pre-norm state and chains pre-norm outputs
    expected = ("pre", "pre") if family == "step3p5" else ("post", "post")
    assert (model.target.hidden_tap, head.layer(1).chain_hidden) == expected


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("draft_max", [1, 2, 3, 4])
def test_greedy_identical_and_layer_caches_exact(models, family, draft_max):
    model, reference, _ = models(family)
    prompt = list(range(40, 40 + 2 * PREFILL + 5))
    expected = reference_greedy(reference, prompt, 40)
    got, stats, cache = mtp_greedy(model, prompt, 40, draft_max)
    assert_same_or_near_tie(reference, prompt, expected, got)
    assert stats.generation_tokens == len(got) == stats.rounds + stats.accepted
    assert 0 < stats.accepted < stats.drafted
    assert len(stats.per_position_acceptance) == draft_max
    np.testing.assert_allclose(
        stats.per_position_acceptance, recount(stats, expected, 0)
    )
    if draft_max >= 2:
        assert stats.accepted_at[1] > 0  # layer 1's drafts were accepted too
    processed = prompt + got[:-1]
    fresh = fresh_layer_states(model, processed, cache)
    for j in range(LAYERS):
        layer_caches = model.head.layer_cache(cache.head, j)
        # the layers that drafted have read; a deeper one defers its reads
        # until it is asked or holds ``drafter.PENDING_LIMIT`` states
        assert layer_caches[0].offset > 0 or j >= draft_max
        assert_states_close(layer_caches, fresh[j])


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("draft_max", [2, 3, 4])
def test_stop_and_max_tokens_inside_drafts(models, family, draft_max):
    model, reference, _ = models(family)
    prompt = list(range(7, 30))
    _, stats, _ = mtp_greedy(model, prompt, 40, draft_max)
    pos, limits = 0, []
    for r in stats.trace:
        if r.accepted >= 2:
            limits.append(pos + 2)  # ends inside the round, after layer 1's draft
        pos += r.accepted + 1
    assert limits
    for limit in limits[:2]:
        got, st, _ = mtp_greedy(model, prompt, limit, draft_max)
        assert got == reference_greedy(reference, prompt, limit)
        assert st.generation_tokens == limit == st.rounds + st.accepted
        stop = got[-1]
        if stop not in got[:-1]:
            expected = reference_greedy(reference, prompt, 40, stop={stop})
            got2, _, _ = mtp_greedy(model, prompt, 40, draft_max, stop={stop})
            assert got2 == expected and got2[-1] == stop


# --- numpy references of the wiring ---------------------------------------


def rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def run(block, x, window):
    xm = mx.array(x)[None]
    mask = create_attention_mask(xm, None, window_size=window, return_array=True)
    return np.array(block(xm, mask, KVCache()))[0]


def step3p5_layer(model, w, j, hidden, tokens):
    """vLLM: GemmaRMSNorm (x * (1 + w)) everywhere, cat[enorm(e), hnorm(h)], own head."""
    args = model.target.model.args
    g, eps, n = (lambda k: np.array(w[k])), args.rms_norm_eps, args.num_hidden_layers
    pre = f"model.layers.{n + j}."
    e = g("model.embed_tokens.weight")[tokens]
    x = (
        np.concatenate(
            [
                rms(e, 1 + g(pre + "enorm.weight"), eps),
                rms(hidden, 1 + g(pre + "hnorm.weight"), eps),
            ],
            -1,
        )
        @ g(pre + "eh_proj.weight").T
    )
    # mlx-lm's decoder layer at index N + j; its sanitize maps the MoE names,
    # and its norms take 1 + w (what its sanitize adds to a Hugging Face file)
    ext = replace(args, rope_theta=list(args.rope_theta) + [args.rope_theta[-1]] * 3)
    layer = type(model.target.backbone.layers[0])(ext, n + j)
    block = {k[len(pre) :]: v for k, v in w.items() if k.startswith(pre)}
    block = {
        k: v
        for k, v in block.items()
        if k.split(".")[0] not in ("enorm", "hnorm", "eh_proj", "shared_head")
    }
    clean = model.target.model.sanitize(
        {f"model.layers.0.{k}": v for k, v in block.items()}
    )
    clean = {k[len("model.layers.0.") :]: v for k, v in clean.items()}
    clean = {
        k: (v + 1 if "norm" in k and not block_is_moe(block) else v)
        for k, v in clean.items()
    }
    layer.load_weights(list(clean.items()))
    window = args.sliding_window if layer.is_sliding else None
    y = run(layer, x, window)
    h = rms(y, 1 + g(pre + "shared_head.norm.weight"), eps)
    return h @ g(pre + "shared_head.output.weight").T, y


def block_is_moe(block):
    # mlx-lm's sanitize adds the 1 itself when it sees Hugging Face MoE names
    return any(".moe." in f".{k}" for k in block)


def mimo_v2_layer(model, w, j, hidden, tokens):
    """vLLM: plain RMSNorm, cat[enorm(e), hnorm(h)], SWA block, final_layernorm, lm_head."""
    args = model.target.model.args
    g, eps = (lambda k: np.array(w[k])), args.layernorm_epsilon
    pre = f"model.mtp.layers.{j}."
    e = g("model.embed_tokens.weight")[tokens]
    x = (
        np.concatenate(
            [
                rms(e, g(pre + "enorm.weight"), eps),
                rms(hidden, g(pre + "hnorm.weight"), eps),
            ],
            -1,
        )
        @ g(pre + "eh_proj.weight").T
    )
    layer = type(model.target.backbone.layers[0])(
        args, is_moe=False, is_sliding_window=True
    )
    # vLLM's pre_mlp_layernorm is the norm mlx-lm's layer calls post_attention_layernorm
    block = {
        k[len(pre) :].replace("pre_mlp_layernorm.", "post_attention_layernorm."): v
        for k, v in w.items()
        if k.startswith(pre)
        and k[len(pre) :].split(".")[0]
        in ("input_layernorm", "self_attn", "pre_mlp_layernorm", "mlp")
    }
    layer.load_weights(list(block.items()))
    y = run(layer, x, args.sliding_window_size)
    h = rms(y, g(pre + "final_layernorm.weight"), eps)
    return h @ g("lm_head.weight").T, h


REFERENCES = {"step3p5": step3p5_layer, "mimo_v2_flash": mimo_v2_layer}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("j", range(LAYERS))
def test_each_layer_matches_numpy(models, family, j):
    model, _, weights = models(family)
    rng = np.random.default_rng(j)
    # longer than the sliding window, so the window shows
    hidden = rng.standard_normal((10, model.config["hidden_size"])).astype(np.float32)
    tokens = rng.integers(0, 256, 10)
    logits, chained = REFERENCES[family](model, weights, j, hidden, tokens)
    layer = model.head.layer(j)
    got, out = layer(mx.array(hidden)[None], mx.array(tokens)[None], layer.make_cache())
    np.testing.assert_allclose(np.array(got[0]), logits, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.array(out[0]), chained, rtol=1e-4, atol=1e-4)


# --- Qwen3-Next / Qwen3.5: several mtp.layers around one fc and one norm ---


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    import tiny_hybrid
    from mlx_lm.utils import load_model as mlx_lm_load_model

    root = tmp_path_factory.mktemp("qwen-multi")
    full, trunk = tiny_hybrid.build_folder(root / "q", "qwen3_5", mtp_layers=2)
    return mlx_mtp.load_model(full), mlx_lm_load_model(trunk)[0], full


def test_qwen_layers_share_fc_and_norms(qwen):
    model, _, _ = qwen
    head = model.head
    assert isinstance(head, MultiLayerHead) and head.num_layers == 2
    a, b = head.layer(0), head.layer(1)
    assert (
        a.fc is b.fc
        and a.norm is b.norm
        and a.pre_fc_norm_hidden is b.pre_fc_norm_hidden
    )
    assert a.block.layers[1] is b.block.layers[1]  # one list of layers, held once
    assert (a.block.depth, b.block.depth) == (0, 1)


@pytest.mark.parametrize("draft_max", [1, 2, 3, 4])
def test_qwen_greedy_identical_and_layer_caches_exact(qwen, draft_max):
    model, reference, _ = qwen
    prompt = list(range(40, 40 + 2 * PREFILL + 5))
    expected = reference_greedy(reference, prompt, 40)
    got, stats, cache = mtp_greedy(model, prompt, 40, draft_max)
    assert_same_or_near_tie(reference, prompt, expected, got)
    assert stats.generation_tokens == len(got) == stats.rounds + stats.accepted
    np.testing.assert_allclose(
        stats.per_position_acceptance, recount(stats, expected, 0)
    )
    fresh = fresh_layer_states(model, prompt + got[:-1], cache)
    for j in range(2):
        assert_states_close(model.head.layer_cache(cache.head, j), fresh[j])


def test_qwen_round_trip_keeps_both_layers(qwen, tmp_path):
    from mlx_mtp.convert import convert
    from mlx_mtp.convert.describe import describe

    from mlx_mtp.generate import mtp_logits

    model, _, src = qwen
    out = convert(src, tmp_path / "out")
    again = mlx_mtp.load_model(out)
    assert again.head.num_layers == 2 and describe(out).mtp_layers == 2
    tokens = list(range(30, 60))
    np.testing.assert_array_equal(
        np.array(mtp_logits(model, tokens)), np.array(mtp_logits(again, tokens))
    )
    for j in range(2):
        layer, layer2 = model.head.layer(j), again.head.layer(j)
        h = mx.random.normal((1, 5, model.config["text_config"]["hidden_size"]))
        t = mx.array([[1, 2, 3, 4, 5]])
        np.testing.assert_array_equal(
            np.array(layer(h, t, layer.make_cache())[0]),
            np.array(layer2(h, t, layer2.make_cache())[0]),
        )


def test_step3p5_tensors_under_transformer_load_the_same(models, tmp_path):
    """Step's checkpoints nest the shared head under ``.transformer.`` (vLLM and llama.cpp drop it)."""
    import json

    import tiny

    model, _, weights = models("step3p5")
    n = model.config["num_hidden_layers"]
    nested = {}
    for k, v in weights.items():
        for j in range(LAYERS):
            pre = f"model.layers.{n + j}."
            if k.startswith(pre + "shared_head.") or k.startswith(pre + "self_attn."):
                k = pre + "transformer." + k[len(pre) :]
        nested[k] = v
    folder = tiny.save_folder(tmp_path / "nested", model.config, nested)
    assert json.loads((folder / "config.json").read_text())["model_type"] == "step3p5"
    again = mlx_mtp.load_model(folder)
    for j in range(LAYERS):
        a, b = model.head.layer(j), again.head.layer(j)
        h = mx.random.normal((1, 5, model.config["hidden_size"]))
        t = mx.array([[1, 2, 3, 4, 5]])
        np.testing.assert_array_equal(
            np.array(a(h, t, a.make_cache())[0]), np.array(b(h, t, b.make_cache())[0])
        )
