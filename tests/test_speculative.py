"""Greedy MTP output equals mlx-lm's own greedy output, for every family.

Drafts, rejections, stop tokens inside a draft and max_tokens inside a draft
all happen in these runs (the tiny models are built so the head often agrees
with the trunk); the caches afterwards hold exactly the processed tokens.
"""

import mlx.core as mx
import numpy as np
import pytest
from conftest import DRAFT_FAMILIES, OWN_LAYOUT_FAMILIES
from mlx_lm.generate import generate_step
from mlx_lm.utils import load_model as mlx_lm_load_model

import tiny

import mlx_mtp
from mlx_mtp.adaptive import FixedDraft
from mlx_mtp.speculative import speculative_generate_step
from mlx_mtp.stats import MTPStats

FAMILIES = DRAFT_FAMILIES + OWN_LAYOUT_FAMILIES
NEAR_TIE = 1e-4  # a divergence is only acceptable on a top-2 logit gap below this
PREFILL = 16  # small prefill chunk so that the prompts below span several chunks


@pytest.fixture(scope="module")
def models(tiny_folders):
    loaded = {}

    def get(model_type):
        if model_type not in loaded:
            full, trunk_only = tiny_folders(model_type)
            model = mlx_mtp.load_model(full)
            reference, _ = mlx_lm_load_model(trunk_only)
            loaded[model_type] = (model, reference)
        return loaded[model_type]

    return get


def reference_greedy(reference, prompt, max_tokens, stop=()):
    out = []
    for tok, _ in generate_step(
        mx.array(prompt), reference, max_tokens=max_tokens, sampler=_argmax
    ):
        out.append(int(tok))
        if tok in stop:
            break
    return out


def _argmax(logprobs):
    return mx.argmax(logprobs, axis=-1)


def mtp_greedy(model, prompt, max_tokens, draft_max, stop=(), cache=None):
    stats = MTPStats(trace=[])
    cache = cache if cache is not None else model.make_cache()
    out = [
        t
        for t, _ in speculative_generate_step(
            prompt,
            model,
            max_tokens=max_tokens,
            drafts=FixedDraft(draft_max),
            stop_tokens=stop,
            prompt_cache=cache,
            prefill_step_size=PREFILL,
            stats=stats,
        )
    ]
    return out, stats, cache


def assert_same_or_near_tie(reference, prompt, expected, got):
    """Identical, or the first difference falls on a near-tie of the reference."""
    if expected == got:
        return
    i = next(i for i, (a, b) in enumerate(zip(expected, got)) if a != b)
    logits = reference(mx.array(prompt + expected[:i])[None])[0, -1]
    top2 = np.sort(np.array(logits))[-2:]
    gap = float(top2[1] - top2[0])
    assert gap < NEAR_TIE, f"diverged at {i}: {expected[i]} vs {got[i]}, gap {gap}"


def _kv(cache):
    """Every array a cache holds (a ``CacheList`` holds several caches)."""
    if hasattr(cache, "caches"):
        return [a for c in cache.caches for a in _kv(c)]
    if getattr(cache, "keys", ()) is None:  # a fresh cache (nothing read yet)
        return []
    return list(cache.keys_and_values())


def assert_states_close(caches, fresh):
    for c, f in zip(caches, fresh):
        assert c.offset == f.offset
        for a, b in zip(_kv(c), _kv(f)):
            np.testing.assert_allclose(np.array(a), np.array(b), atol=1e-4, rtol=1e-4)


def assert_cache_exact(model, cache, prompt, out):
    """The trunk holds prompt + out[:-1]; the head holds every pair but the pending ones."""
    processed = prompt + out[:-1]
    assert cache.offset == len(processed)
    fresh = model.make_cache()
    _, hidden = model.target(mx.array(processed)[None], fresh.trunk)
    assert_states_close(cache.trunk, fresh.trunk)
    n_head = tiny.head_offset(cache)
    pending = 0 if tiny.pending_hidden(cache) is None else tiny.pending_hidden(cache).shape[1]
    assert n_head + pending == len(processed)
    assert len(tiny.pending_tokens(cache)) == pending - 1
    # the head's cache equals a fresh head run over the true pairs
    head_fresh = model.head.make_cache()
    if n_head:  # (a head that defers its reads may not have read any yet)
        model.head(hidden[:, :n_head], mx.array(processed[1 : n_head + 1])[None], head_fresh)
    assert_states_close(cache.head, head_fresh)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("draft_max", [1, 2, 3, 4])
def test_greedy_identical_long_prompt(models, family, draft_max):
    model, reference = models(family)
    prompt = list(range(40, 40 + 3 * PREFILL + 5))  # spans several prefill chunks
    expected = reference_greedy(reference, prompt, 40)
    got, stats, cache = mtp_greedy(model, prompt, 40, draft_max)
    assert_same_or_near_tie(reference, prompt, expected, got)
    assert stats.accepted > 0 and stats.accepted < stats.drafted  # both paths ran
    assert stats.generation_tokens == len(got) == stats.rounds + stats.accepted
    assert_cache_exact(model, cache, prompt, got)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("draft_max", [1, 2, 3, 4])
def test_stop_token_inside_a_draft(models, family, draft_max):
    model, reference = models(family)
    prompt = list(range(100, 120))
    free, stats, _ = mtp_greedy(model, prompt, 48, draft_max)
    # a token first emitted as an accepted draft that is not the round's last
    pos = 0
    stop = None
    seen = set()
    for r in stats.trace:
        round_tokens = free[pos : pos + r.accepted + 1]
        for j, t in enumerate(round_tokens[:-1]):
            if t not in seen and j + 1 < len(round_tokens) - 0 and r.accepted >= 1:
                if t not in free[:pos + j]:
                    stop = t
                    break
        if stop is not None:
            break
        seen.update(round_tokens)
        pos += r.accepted + 1
    if stop is None:
        pytest.skip("no accepted draft to stop inside")
    expected = reference_greedy(reference, prompt, 48, stop={stop})
    got, stats, cache = mtp_greedy(model, prompt, 48, draft_max, stop={stop})
    assert_same_or_near_tie(reference, prompt, expected, got)
    assert got[-1] == stop and stop not in got[:-1]
    assert stats.generation_tokens == len(got) == stats.rounds + stats.accepted
    assert_cache_exact(model, cache, prompt, got)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("draft_max", [1, 2, 3, 4])
def test_max_tokens_inside_a_draft(models, family, draft_max):
    model, reference = models(family)
    prompt = list(range(7, 30))
    free, stats, _ = mtp_greedy(model, prompt, 32, draft_max)
    # every limit that ends inside a round of the free run
    limits, pos = [], 0
    for r in stats.trace:
        if r.accepted >= 1:
            limits.append(pos + 1)  # ends right after the first accepted draft
        pos += r.accepted + 1
    assert limits
    for limit in limits[:3]:
        expected = reference_greedy(reference, prompt, limit)
        got, st, cache = mtp_greedy(model, prompt, limit, draft_max)
        assert len(got) == limit
        assert_same_or_near_tie(reference, prompt, expected, got)
        assert st.generation_tokens == limit == st.rounds + st.accepted
        assert_cache_exact(model, cache, prompt, got)


@pytest.mark.parametrize("family", FAMILIES)
def test_no_mtp_path_is_plain_greedy(models, family):
    model, reference = models(family)
    prompt = list(range(60, 90))
    expected = reference_greedy(reference, prompt, 20)
    got, stats, _ = mtp_greedy(model, prompt, 20, draft_max=0)
    assert got == expected
    assert stats.drafted == 0 and stats.rounds == 20


@pytest.mark.parametrize("family", ["deepseek_v3", "mimo"])
def test_snapshot_brings_trunk_and_head_back(tiny_folders, family):
    """``StreamCache.snapshot``/``restore``: generating on from a restored cache
    gives what generating from the snapshot point gave."""
    import mlx_mtp
    from mlx_mtp.adaptive import FixedDraft

    model, _ = mlx_mtp.load(tiny_folders(family)[0])
    cache = model.make_cache()
    prompt = list(range(3, 30))
    steps = speculative_generate_step
    first = [t for t, _ in steps(prompt, model, max_tokens=8, prompt_cache=cache,
                                 drafts=FixedDraft(2))]  # fmt: skip
    snap = cache.snapshot()
    offset, pending = cache.offset, [q.size for q in cache.pending]
    again = [t for t, _ in steps([first[-1]], model, max_tokens=8, prompt_cache=cache,
                                 drafts=FixedDraft(2))]  # fmt: skip
    cache.restore(snap)
    assert cache.offset == offset and [q.size for q in cache.pending] == pending
    redo = [t for t, _ in steps([first[-1]], model, max_tokens=8, prompt_cache=cache,
                                drafts=FixedDraft(2))]  # fmt: skip
    assert redo == again
    trunk = cache.snapshot(trunk_only=True)
    assert trunk.drafts is None and len(trunk.marks) == len(cache.trunk)
