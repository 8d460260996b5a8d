"""Bounded caches (``max_kv_size``) that still roll drafts back: the tokens of
mlx-lm's ``generate_step(max_kv_size=...)`` at every draft count, memory that
stops growing, and a one-line refusal where a family cannot bound its cache."""

import mlx.core as mx
import mlx_lm
import pytest
import tiny
import tiny_gemma4
from mlx_lm.generate import generate_step

import mlx_mtp
from mlx_mtp.errors import MTPError
from mlx_mtp.kv import ROLLING_SLACK, RollingKVCache

PROMPT = tiny.random_prompt(30, 1)
BOUND = 48
N = 160


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    full, trunk = tiny.build_folder(
        tmp_path_factory.mktemp("bounded") / "m", "glm4_moe"
    )
    model, tokenizer = mlx_mtp.load(full)
    return model, tokenizer, mlx_lm.load(str(trunk))[0]


@pytest.fixture
def small_steps(monkeypatch):
    """Drop old tokens every 16 past the bound (256 by default), so a short
    test sees many drops."""
    monkeypatch.setattr(RollingKVCache, "step", 16)


def test_tokens_equal_mlx_lm_at_each_draft_count(pair, small_steps):
    model, tokenizer, ref = pair
    steps = generate_step(mx.array(PROMPT), ref, max_kv_size=BOUND)
    want = [(t, lp) for (t, lp), _ in zip(steps, range(N))]
    unbounded = generate_step(mx.array(PROMPT), ref)
    plain = [lp for (_, lp), _ in zip(unbounded, range(N))]
    # the bound changes the model's distributions: the test sees it
    assert max(mx.abs(a[1] - b).max().item() for a, b in zip(want, plain)) > 1e-3
    for k in (0, 1, 2, 3):
        cache = model.make_cache()
        got = list(
            mlx_mtp.stream_generate(
                model, tokenizer, PROMPT, N, draft_max=k, adaptive_draft=False,
                draft_source="mtp", mtp=k > 0, max_kv_size=BOUND,
                prompt_cache=cache,
            )
        )  # fmt: skip
        assert [r.token for r in got] == [t for t, _ in want]
        for r, (_, lp) in zip(got, want):  # mlx-lm's buffer rotates: sums differ
            assert mx.allclose(r.logprobs, lp, atol=1e-5)
        if k:
            assert got[-1].stats.accepted > 0
        rolling = [c for c in cache.state_list() if isinstance(c, RollingKVCache)]
        assert len(rolling) == 3  # the trunk's two layers and the head's
        assert all(c.dropped > 0 for c in rolling[: 3 if k else 2])
        held = rolling[0].keys_and_values()[0].shape[2]
        assert held <= BOUND + rolling[0].slack + 2 * RollingKVCache.step


def test_memory_stops_growing(pair):
    model, tokenizer, _ = pair
    cache = model.make_cache()
    capacity = []
    for i, _ in enumerate(
        mlx_mtp.stream_generate(
            model, tokenizer, PROMPT, 1200, max_kv_size=BOUND, prompt_cache=cache
        )  # fmt: skip
    ):
        if i % 50 == 0:
            capacity.append(max(c.keys.shape[2] for c in cache.trunk))
    # the bound, its slack and one step of room, in steps
    most = -(-(BOUND + ROLLING_SLACK + RollingKVCache.step) // 256) * 256
    assert max(capacity) <= most + 256 and cache.offset > 1000


def test_a_drafter_that_reads_the_whole_cache_is_refused(tmp_path):
    target = tiny_gemma4.build_target(tmp_path / "target")
    assistant = tiny_gemma4.build_assistant(tmp_path / "assistant")
    model, tokenizer = mlx_mtp.load(target, mtp=assistant)
    with pytest.raises(MTPError, match="cannot be bounded"):
        mlx_mtp.generate(model, tokenizer, "hi", max_tokens=4, max_kv_size=BOUND)


def test_a_family_without_plain_attention_caches_is_refused(tmp_path):
    full, _ = tiny.build_folder(tmp_path / "v32", "deepseek_v32")
    model, tokenizer = mlx_mtp.load(full)
    with pytest.raises(MTPError, match="no plain attention cache to bound"):
        mlx_mtp.generate(model, tokenizer, "hi", max_tokens=4, max_kv_size=BOUND)


def test_a_bound_too_small_is_one_line(pair):
    model, tokenizer, _ = pair
    with pytest.raises(MTPError, match="max_kv_size must be more than 4"):
        mlx_mtp.generate(model, tokenizer, "hi", max_tokens=4, max_kv_size=3)


def test_a_prompt_longer_than_the_bound(pair, small_steps):
    """Read in one chunk, each prompt token sees the first 4 and the latest
    (its mask is causal); drafts change nothing."""
    import numpy as np

    mask = np.array(RollingKVCache(8, keep=2, slack=2).make_mask(12))
    assert mask[11].tolist() == [1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1]
    assert mask[1].tolist() == [1, 1] + [0] * 10
    model, tokenizer, _ = pair
    prompt = tiny.random_prompt(100, 2)
    plain = mlx_mtp.generate(model, tokenizer, prompt, max_tokens=60, mtp=False,
                             max_kv_size=BOUND)  # fmt: skip
    for k in (1, 3):
        got = mlx_mtp.generate(model, tokenizer, prompt, max_tokens=60, draft_max=k,
                               adaptive_draft=False, max_kv_size=BOUND)  # fmt: skip
        assert got == plain
