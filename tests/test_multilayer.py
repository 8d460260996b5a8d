"""Heads of several MTP layers: layer j drafts depth j + 1.

Built on the DeepSeek layout with ``num_nextn_predict_layers = 3`` (layers at
``model.layers.{N + j}``). Greedy output stays mlx-lm's; after generation each
layer's cache equals a fresh run over exactly the pairs it should have read:
layer 0 reads ``(h_i, t_{i+1})`` at chain position ``i``, layer ``j > 0`` reads
layer ``j - 1``'s output at ``i - 1`` with ``t_{i+1}``, from position ``j``.
"""

import mlx.core as mx
import numpy as np
import pytest
import tiny
from test_speculative import (
    PREFILL,
    assert_same_or_near_tie,
    assert_states_close,
    mtp_greedy,
    reference_greedy,
)

import mlx_mtp
from mlx_mtp.adaptive import FixedDraft
from mlx_mtp.cache import truncate
from mlx_mtp.heads import MultiLayerHead

LAYERS = 3


def build_multilayer(path, model_type="deepseek_v3", layers=LAYERS):
    """The tiny DeepSeek-style model with ``layers`` MTP layers (each its own seed)."""
    config, trunk_w, mtp_w = tiny.build_weights(model_type, seed=0)
    n = config["num_hidden_layers"]
    for j in range(1, layers):
        _, _, more = tiny.build_weights(model_type, seed=0, agreeable=True)
        rng = np.random.default_rng(j)
        for k, v in more.items():
            name = k.replace(f"model.layers.{n}.", f"model.layers.{n + j}.", 1)
            if "self_attn" in k or "mlp" in k:  # a block of its own
                v = v * mx.array(rng.uniform(0.8, 1.2, v.shape).astype(np.float32))
            mtp_w[name] = v
    config["num_nextn_predict_layers"] = layers
    full = tiny.save_folder(path, config, trunk_w, mtp_w)
    trunk_only = tiny.save_folder(path.parent / (path.name + "-trunk"), config, trunk_w)
    return full, trunk_only


@pytest.fixture(scope="module")
def multi(tmp_path_factory):
    from mlx_lm.utils import load_model as mlx_lm_load_model

    full, trunk_only = build_multilayer(tmp_path_factory.mktemp("multi") / "ds3")
    model = mlx_mtp.load_model(full)
    reference, _ = mlx_lm_load_model(trunk_only)
    return model, reference


def fresh_layer_states(model, processed, cache):
    """Per layer, a fresh cache over the pairs it should have read, and its outputs."""
    head = model.head
    _, x = model.target(mx.array(processed)[None], model.target.make_cache())
    fresh = []
    for j in range(head.num_layers):
        first = cache.start[j]
        last = first + head.layer_cache(cache.head, j)[0].offset - 1  # last read
        c = head.layer(j).make_cache()
        fresh.append(c)
        if last < first:  # nothing read yet (a head that defers its reads)
            x = mx.zeros_like(x)
            continue
        # inputs: layer j - 1's output at i - 1 (the trunk's h_i for layer 0)
        shift = 0 if j == 0 else 1
        inputs = x[:, first - shift : last + 1 - shift]
        tokens = mx.array(processed[first + 1 : last + 2])[None]
        _, out = head.layer(j)(inputs, tokens, c)
        # the next layer reads this layer's outputs from position ``first``
        x = mx.concatenate([mx.zeros_like(x[:, :first]), out], axis=1)
    return fresh


def test_load_is_multilayer(multi):
    model, _ = multi
    assert isinstance(model.head, MultiLayerHead) and model.head.num_layers == LAYERS
    o = [np.array(layer.block.self_attn.o_proj.weight) for layer in model.head.layers]
    assert not np.allclose(o[1], o[2])  # each layer loaded its own tensors


@pytest.mark.parametrize("draft_max", [1, 2, 3, 4, 5])
def test_greedy_identical_and_layer_caches_exact(multi, draft_max):
    model, reference = multi
    prompt = list(range(40, 40 + 2 * PREFILL + 5))
    expected = reference_greedy(reference, prompt, 40)
    got, stats, cache = mtp_greedy(model, prompt, 40, draft_max)
    assert_same_or_near_tie(reference, prompt, expected, got)
    assert stats.generation_tokens == len(got) == stats.rounds + stats.accepted
    assert len(stats.per_position_acceptance) == draft_max
    if draft_max >= 2:
        assert stats.accepted_at[1] > 0  # layer 1's drafts were accepted too
    processed = prompt + got[:-1]
    fresh = fresh_layer_states(model, processed, cache)
    for j in range(LAYERS):
        assert_states_close(model.head.layer_cache(cache.head, j), fresh[j])
    # pending inputs line up: layer 0 waits on the trunk's last states, layer j
    # on layer j-1's output at that layer's last position
    ends = [
        cache.start[j] + model.head.layer_cache(cache.head, j)[0].offset - 1
        for j in range(LAYERS)
    ]
    assert ends[0] + cache.pending[0].size == len(processed) - 1
    for j in range(1, LAYERS):
        assert ends[j] + cache.pending[j].size == ends[j - 1] + 1


def test_stop_and_max_tokens_inside_drafts(multi):
    model, reference = multi
    prompt = list(range(7, 30))
    free, stats, _ = mtp_greedy(model, prompt, 32, 3)
    pos, limits = 0, []
    for r in stats.trace:
        if r.accepted >= 2:
            limits.append(pos + 2)  # ends inside the round, after layer 1's draft
        pos += r.accepted + 1
    assert limits
    for limit in limits[:2]:
        got, st, _ = mtp_greedy(model, prompt, limit, 3)
        assert got == reference_greedy(reference, prompt, limit)
        assert st.generation_tokens == limit
        stop = got[-1]
        if stop not in got[:-1]:
            expected = reference_greedy(reference, prompt, 32, stop={stop})
            got2, _, _ = mtp_greedy(model, prompt, 32, 3, stop={stop})
            assert got2 == expected and got2[-1] == stop


@pytest.mark.parametrize("keep", [0, 3, 20, 36, 38])
def test_truncate_then_continue(multi, keep):
    """Cut anywhere, continue: the output is that of a fresh generation.

    A layer above the first that cannot be cut exactly starts afresh where it
    can (``cache.start``); its entries from there on are still exact.
    """
    model, _ = multi
    prompt = list(range(60, 100))
    cache = model.make_cache()
    out = [
        t
        for t, _ in mlx_mtp.speculative_generate_step(
            prompt, model, max_tokens=3, drafts=FixedDraft(3), prompt_cache=cache
        )
    ]
    seq = prompt + out
    kept = truncate(model, cache, keep)
    assert kept in (keep, keep - 1, 0)
    assert cache.offset == kept
    more = [
        t
        for t, _ in mlx_mtp.speculative_generate_step(
            seq[kept:keep] + [7, 8], model, max_tokens=8, drafts=FixedDraft(3), prompt_cache=cache
        )
    ]
    ref = [
        t
        for t, _ in mlx_mtp.speculative_generate_step(
            seq[:keep] + [7, 8], model, max_tokens=8, drafts=FixedDraft(0)
        )
    ]
    assert more == ref
    # every layer's cache is what its pairs give, from where it (re)started
    processed = seq[:keep] + [7, 8] + more[:-1]
    fresh = fresh_layer_states(model, processed, cache)
    for j in range(LAYERS):
        assert_states_close(model.head.layer_cache(cache.head, j), fresh[j])
