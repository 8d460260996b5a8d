"""The drafters that read the target's layers (DFlash, EAGLE-3) under the
long-context cache policies: a quantized cache rolls their drafts back with
greedy output equal to mlx-lm's own ``generate_step(kv_bits=...)``; a bounded
cache works where the drafter can be bounded and is one line where it cannot;
a drafter whose heads do not take the groups is one line before any work."""

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
import test_eagle3 as te
import tiny
import tiny_dflash as td
from mlx_lm.generate import generate_step

import mlx_mtp
from mlx_mtp.errors import MTPError
from mlx_mtp.kv import QuantizingKVCache, RollingKVCache

PROMPT = tiny.random_prompt(40, 3)
N = 40
WIDE = 32  # heads 32 wide: a group of 32 fits


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("kvd")
    target = td.build_target(root / "target", "qwen3", 6, head_dim=WIDE)
    dflash = td.build_drafter(
        root / "dflash", [1, 4], 6, agreeable=True, head_dim=WIDE
    )
    head = np.array(mx.load(str(target / "model.safetensors"))["lm_head.weight"])
    eagle = te.save(
        root / "eagle",
        te.eagle_config("speculators"),
        te.eagle_weights("speculators", head, True),
    )  # its heads are 16 wide
    return target, dflash, eagle


@pytest.fixture(scope="module")
def reference(folders):
    return mlx_lm.load(str(folders[0]))[0]


def want(ref, n=N, **kv):
    steps = generate_step(mx.array(PROMPT), ref, **kv)
    return [int(t) for (t, _), _ in zip(steps, range(n))]


def ours(model, tokenizer, k, source, n=N, **kv):
    return list(
        mlx_mtp.stream_generate(
            model, tokenizer, PROMPT, n, draft_max=k, adaptive_draft=False,
            draft_source=source, **kv,
        )
    )  # fmt: skip


@pytest.mark.parametrize("bits", [8, 4])
def test_dflash_drafts_over_quantized_caches(folders, reference, bits):
    target, dflash, _ = folders
    model, tokenizer = mlx_mtp.load(target, draft=dflash)
    kv = dict(kv_bits=bits, kv_group_size=WIDE, quantized_kv_start=0)
    expected = want(reference, **kv)
    for k in (1, 2, 3):
        cache = model.make_cache()
        got = ours(model, tokenizer, k, "dflash", prompt_cache=cache, **kv)
        assert [r.token for r in got] == expected
        assert got[-1].stats.accepted > 0
        drafts = cache.drafts["dflash"].caches  # the drafter's caches follow
        assert drafts and all(isinstance(c, QuantizingKVCache) for c in drafts)
        assert all(c.quantized for c in drafts)


def test_dflash_cannot_be_bounded(folders):
    target, dflash, _ = folders
    model, tokenizer = mlx_mtp.load(target, draft=dflash)
    with pytest.raises(MTPError, match="dflash drafter keeps the whole context"):
        mlx_mtp.generate(model, tokenizer, PROMPT, max_tokens=4, max_kv_size=48)


def test_eagle3_drafts_over_a_bounded_cache(folders, reference, monkeypatch):
    monkeypatch.setattr(RollingKVCache, "step", 16)  # many drops in a short run
    target, _, eagle = folders
    model, tokenizer = mlx_mtp.load(target, draft=eagle)
    expected = want(reference, 90, max_kv_size=48)
    for k in (1, 3):
        cache = model.make_cache()
        got = ours(model, tokenizer, k, "mtp", 90, max_kv_size=48, prompt_cache=cache)
        assert [r.token for r in got] == expected
        assert got[-1].stats.accepted > 0
        assert all(c.dropped > 0 for c in cache.drafts["eagle3"].caches)


def test_a_drafter_whose_heads_do_not_take_the_groups_is_one_line(folders):
    target, _, eagle = folders
    model, tokenizer = mlx_mtp.load(target, draft=eagle)
    with pytest.raises(MTPError, match="heads are 16 wide"):
        mlx_mtp.generate(
            model, tokenizer, PROMPT, max_tokens=4, kv_bits=8, kv_group_size=32
        )
