"""Hybrid gated-delta-net trunks (Qwen3-Next, Qwen3.5, Qwen3.5 MoE) with MTP.

Greedy MTP output equals mlx-lm's greedy output; after every round each GDN
layer's conv window and recurrent state equal those of mlx-lm processing the
kept tokens one by one; a round costs exactly one trunk forward (rollback picks
a kept state, it never recomputes); the head's block reads the checkpoint's
zero-centred norms and experts as mlx-lm reads the same tensors in the trunk.
"""

import dataclasses
import gc

import mlx.core as mx
import numpy as np
import pytest
import tiny_hybrid
from mlx.utils import tree_flatten
from mlx_lm.models.cache import ArraysCache, make_prompt_cache
from mlx_lm.utils import load_model as mlx_lm_load_model
from test_speculative import (
    PREFILL,
    assert_same_or_near_tie,
    mtp_greedy,
    reference_greedy,
)

import mlx_mtp
from mlx_mtp.adaptive import FixedDraft
from mlx_mtp.cache import rollback, start_verify
from mlx_mtp.recurrent.gdn_cache import GDNCache, patch_trunk
from mlx_mtp.speculative import speculative_generate_step
from mlx_mtp.stats import MTPStats

FAMILIES = list(tiny_hybrid.MODEL_TYPES)
# float32 states: bit-identical on CPU (measured: max |diff| 0.0); a GPU kernel
# may sum a (k+1)-token verify in another order than one-token steps.
# On CUDA mlx-lm's own float32 matmuls run at reduced precision (measured on an
# H100: kept states up to 5e-4 off the one-token reference, same tokens).
CUDA = mx.default_device() == mx.gpu and not mx.metal.is_available()
STATE_ATOL = 5e-3 if CUDA else 1e-5


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid")
    loaded = {}

    def get(model_type):
        if model_type not in loaded:
            full, trunk_only = tiny_hybrid.build_folder(root / model_type, model_type)
            reference, _ = mlx_lm_load_model(trunk_only)
            loaded[model_type] = (mlx_mtp.load_model(full), reference)
        return loaded[model_type]

    return get


class CountingTrunk:
    """The trunk, counting its forward passes."""

    def __init__(self, trunk):
        self.trunk, self.calls = trunk, 0

    def __call__(self, tokens, cache):
        logits, taps = self.forward(tokens, cache)
        return logits, taps.hidden

    def forward(self, tokens, cache, **kwargs):
        self.calls += 1
        return self.trunk.forward(tokens, cache, **kwargs)

    def __getattr__(self, name):
        return getattr(self.trunk, name)


def run_with_snapshots(model, prompt, max_tokens, draft_max, stop=()):
    """Greedy MTP run that records the GDN caches after every round's rollback."""
    counting = CountingTrunk(model.target)
    model = dataclasses.replace(model, target=counting)
    cache = model.make_cache()
    snapshots, offset = [], 0
    out = []
    stats = MTPStats(trace=[])
    prefill_calls = -(-(len(prompt) - 1) // PREFILL)
    for tok, _ in speculative_generate_step(
        prompt,
        model,
        max_tokens=max_tokens,
        drafts=FixedDraft(draft_max),
        stop_tokens=stop,
        prompt_cache=cache,
        prefill_step_size=PREFILL,
        stats=stats,
    ):
        if cache.offset != offset:  # a new round has rolled back
            offset = cache.offset
            snapshots.append((offset, [_gdn_state(c) for c in cache.trunk]))
        out.append(tok)
    return out, stats, snapshots, counting.calls - prefill_calls


def _gdn_state(c):
    if not isinstance(c, ArraysCache):
        return None
    assert not getattr(c, "verifying", False)  # nothing kept outside a verify
    return c[0], c[1]


def assert_states_match(reference, prompt, out, snapshots):
    """Each snapshot equals mlx-lm's caches after the same tokens, one at a time."""
    tokens = prompt + out
    cache = make_prompt_cache(reference)
    done = 0
    for s in range(0, len(prompt) - 1, PREFILL):  # the same prefill chunks
        chunk = prompt[s : min(s + PREFILL, len(prompt) - 1)]
        reference(mx.array(chunk)[None], cache=cache)
        done += len(chunk)
    for offset, states in snapshots:
        for t in tokens[done:offset]:
            reference(mx.array([[t]]), cache=cache)
        done = offset
        assert cache[-1].offset == offset
        for got, ref in zip(states, cache):
            if got is None:
                continue
            for a, b in zip(got, (ref[0], ref[1])):
                assert a.shape == b.shape and a.dtype == b.dtype
                np.testing.assert_allclose(np.array(a), np.array(b), atol=STATE_ATOL)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("draft_max", [1, 2, 3, 4])
def test_greedy_identical_and_states_after_every_round(models, family, draft_max):
    model, reference = models(family)
    prompt = list(range(40, 40 + 3 * PREFILL + 5))  # spans several prefill chunks
    expected = reference_greedy(reference, prompt, 40)
    got, stats, snapshots, forwards = run_with_snapshots(model, prompt, 40, draft_max)
    assert_same_or_near_tie(reference, prompt, expected, got)
    assert 0 < stats.accepted < stats.drafted  # accepted and rejected drafts both ran
    assert stats.generation_tokens == len(got) == stats.rounds + stats.accepted
    # one trunk forward per round: no replay for the rollback
    assert forwards == stats.rounds == len(snapshots)
    assert forwards / len(got) == pytest.approx(1 / stats.mean_accepted_length)
    assert stats.mean_accepted_length > 1
    assert_states_match(reference, prompt, got, snapshots)


def _first_accepted_draft(out, trace):
    """(position, token) of an accepted draft, not a round's last token, seen first."""
    pos = 0
    for r in trace:
        if r.accepted >= 1 and out[pos] not in out[:pos]:
            return pos, out[pos]
        pos += r.accepted + 1
    return None


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("draft_max", [1, 2, 3, 4])
def test_stop_and_max_tokens_inside_a_draft(models, family, draft_max):
    model, reference = models(family)
    prompt = list(range(100, 130))
    free, stats, _ = mtp_greedy(model, prompt, 48, draft_max)
    found = _first_accepted_draft(free, stats.trace)
    assert found is not None
    pos, stop = found
    # a stop token that is accepted as a draft, with drafts after it
    expected = reference_greedy(reference, prompt, 48, stop={stop})
    got, st, snapshots, _ = run_with_snapshots(model, prompt, 48, draft_max, {stop})
    assert_same_or_near_tie(reference, prompt, expected, got)
    assert got[-1] == stop and len(got) == pos + 1
    assert st.generation_tokens == len(got) == st.rounds + st.accepted
    assert_states_match(reference, prompt, got, snapshots)
    # a token limit that ends right after the same accepted draft
    expected = reference_greedy(reference, prompt, pos + 1)
    got, st, snapshots, _ = run_with_snapshots(model, prompt, pos + 1, draft_max)
    assert got == expected and len(got) == pos + 1
    assert_states_match(reference, prompt, got, snapshots)


@pytest.mark.parametrize("family", FAMILIES)
def test_rollback_of_every_length(models, family):
    """Verify 4 tokens, roll back n = 0..3: the caches hold the first 4 - n.

    Rolling back all 4 is refused: the state before the pass is not kept."""
    model, reference = models(family)
    prompt, verified = list(range(50, 70)), [7, 8, 9, 10]
    for n, split in [(0, 4), (1, 4), (2, 4), (3, 4), (1, 2), (3, 1)]:
        cache = model.make_cache().trunk
        model.target(mx.array(prompt)[None], cache)
        start_verify(cache)
        # one forward, or two (a pass may come in pieces)
        model.target(mx.array(verified[:split])[None], cache)
        if split < len(verified):
            model.target(mx.array(verified[split:])[None], cache)
        rollback(cache, n)
        ref = make_prompt_cache(reference)
        reference(mx.array(prompt)[None], cache=ref)
        for t in verified[: len(verified) - n]:
            reference(mx.array([[t]]), cache=ref)
        for c, r in zip(cache, ref):
            if isinstance(c, GDNCache):
                assert not c.verifying and c.nbytes == r.nbytes
                for a, b in zip(c.cache, r.cache):
                    np.testing.assert_allclose(
                        np.array(a), np.array(b), atol=STATE_ATOL
                    )
            else:
                assert c.offset == r.offset
    cache = model.make_cache().trunk
    start_verify(cache)
    model.target(mx.array(verified)[None], cache)
    with pytest.raises(ValueError, match="cannot roll back 4 of 4"):
        rollback(cache, 4)


def _gdn_heavy_model():
    """Qwen3-Next GDN layers of the 80B's shape (Hv=32, Dv=Dk=128), tiny otherwise."""
    from mlx_lm.models import qwen3_next

    shape = dict(tiny_hybrid.config_for("qwen3_next"), num_experts=0)
    shape.update(linear_num_value_heads=32, linear_num_key_heads=16)
    shape.update(linear_key_head_dim=128, linear_value_head_dim=128)
    model = qwen3_next.Model(qwen3_next.ModelArgs.from_dict(shape))
    mx.eval(model.parameters())
    patch_trunk(model)
    return model


def _verify_memory(model, keep: bool):
    """(peak above resident during a T=4 verify, resident growth after the round)."""
    cache = model.make_cache()
    model(mx.array([list(range(30, 60))]), cache=cache)
    mx.eval([c.state for c in cache])
    gc.collect()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    if keep:
        start_verify(cache)
    logits = model(mx.array([[5, 6, 7, 8]]), cache=cache)
    mx.eval(logits, [c.state for c in cache])
    peak = mx.get_peak_memory() - base
    rollback(cache, 2 if keep else 0)
    mx.eval([c.state for c in cache])
    del logits
    gc.collect()
    return peak, mx.get_active_memory() - base


def test_verify_keeps_at_most_t_states_per_layer_and_releases_them():
    model = _gdn_heavy_model()
    n_gdn = sum(layer.is_linear for layer in model.layers)
    state_bytes = 32 * 128 * 128 * 4  # float32
    plain_peak, plain_after = _verify_memory(model, keep=False)
    keep_peak, keep_after = _verify_memory(model, keep=True)
    assert 0 < keep_peak - plain_peak <= n_gdn * 4 * state_bytes
    assert keep_after == plain_after  # the rollback pins no kept buffer


@pytest.mark.parametrize("family", FAMILIES)
def test_head_block_reads_checkpoint_like_mlx_lm(tmp_path, family):
    """The MTP layer's tensors, put in the trunk's full-attention slot and loaded
    by mlx-lm (which adds 1 to zero-centred norms and stacks experts), give the
    same layer as the head's block."""
    config, trunk_w, mtp_w = tiny_hybrid.build_weights(family, agreeable=False)
    slot = "model.language_model.layers.3." if "text_config" in config else None
    slot = slot or "model.layers.3."
    swapped = {k: v for k, v in trunk_w.items() if not k.startswith(slot)}
    for k, v in mtp_w.items():
        if k.startswith("mtp.layers.0."):
            swapped[slot + k[len("mtp.layers.0.") :]] = v
    folder = tiny_hybrid.save_folder(tmp_path / "s", config, swapped, mtp_w, False)
    model = mlx_mtp.load_model(folder)
    layer = model.target.backbone.layers[3]
    assert not layer.is_linear
    x = mx.random.normal((1, 5, config.get("hidden_size", 64)))
    mask = "causal"
    np.testing.assert_allclose(
        np.array(model.head.block(x, mask, None)),
        np.array(layer(x, mask, None)),
        atol=1e-5,
    )
    head_params = dict(tree_flatten(model.head.block.layers[0].parameters()))
    assert set(head_params) == set(dict(tree_flatten(layer.parameters())))
