"""A quantized KV cache in the server and in ``batch_generate``: ragged batches
hold quantized caches (no fall-back to one stream at a time), and every
stream's tokens and log-probabilities equal mlx-lm's ``generate_step`` with
the same ``kv_bits`` and ``quantized_kv_start`` 0, one stream or 8 at once."""

import threading

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
import tiny
import tiny_hybrid
from live_server import LiveServer
from mlx_lm.generate import generate_step

import mlx_mtp
from mlx_mtp.batch_cache import RaggedQuantizedKVCache
from mlx_mtp.kv import KVSettings
from mlx_mtp.draft_settings import DraftSettings
from mlx_mtp.serve import ServeConfig

CLIENTS = 8
GROUP = 32
FAMILIES = {
    "glm4_moe": (tiny, {"num_attention_heads": 2, "head_dim": 32}),
    "qwen3_next": (tiny_hybrid, {"head_dim": 32}),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-kv")
    built = {}

    def get(family):
        if family not in built:
            builder, overrides = FAMILIES[family]
            full, trunk = builder.build_folder(root / family, family, **overrides)
            model, tokenizer = mlx_mtp.load(full)
            built[family] = model, tokenizer, mlx_lm.load(str(trunk))[0]
        return built[family]

    return get


def reference(model, prompt, n, bits):
    steps = generate_step(
        mx.array(prompt), model, kv_bits=bits, kv_group_size=GROUP,
        quantized_kv_start=0,
    )  # fmt: skip
    return [(t, lp[t].item()) for (t, lp), _ in zip(steps, range(n))]


def prompts():
    """Different lengths: the streams sit at different positions."""
    return [tiny.random_prompt(8 + 11 * i, i) for i in range(CLIENTS)]


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("bits", [8, 4])
def test_eight_clients_at_once_equal_mlx_lm(models, family, bits):
    model, tokenizer, ref = models(family)
    kv = KVSettings(bits, GROUP, 0)
    config = ServeConfig(max_batch=CLIENTS, prompt_cache_entries=0, kv=kv, drafts=DraftSettings(adaptive=False))
    server = LiveServer(model, tokenizer, family, config)
    try:
        assert server.engine.batched
        client = server.client()
        n = [28 + 3 * i for i in range(CLIENTS)]

        def ask(i, prompt):
            r = client.completions.create(
                model=family, prompt=prompt, max_tokens=n[i], temperature=0.0,
                logprobs=0, extra_body={"draft_max": [3, 1, 2, 3, 1, 2, 3, 2][i]},
            )  # fmt: skip
            return r.choices[0], r.usage

        got = [None] * CLIENTS
        threads = [
            threading.Thread(target=lambda i=i, p=p: got.__setitem__(i, ask(i, p)))
            for i, p in enumerate(prompts())
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert server.get("/health")[1]["peak_batch"] == CLIENTS
        alone = ask(0, prompts()[0])  # one stream alone, too
        for (choice, usage), prompt in zip(got + [alone], prompts() + prompts()[:1]):
            want = reference(ref, prompt, usage.completion_tokens, bits)
            text = mlx_lm.generate(
                ref, tokenizer, prompt, max_tokens=usage.completion_tokens,
                kv_bits=bits, kv_group_size=GROUP, quantized_kv_start=0,
            )  # fmt: skip
            assert choice.text == text
            lps = choice.logprobs.token_logprobs
            np.testing.assert_array_equal(lps, [x for _, x in want])
        assert sum(u.mtp["accepted"] for _, u in got) > 0
    finally:
        server.close()


def test_batch_generate_batches_quantized_caches(models):
    model, tokenizer, ref = models("glm4_moe")
    ps = prompts()
    r = mlx_mtp.batch_generate(
        model, tokenizer, ps, max_tokens=16, return_token_ids=True,
        return_logprobs=True, draft_max=2, adaptive_draft=False, kv_bits=4,
        kv_group_size=GROUP, quantized_kv_start=0,
    )  # fmt: skip
    for tokens, lps, p in zip(r.token_ids, r.logprobs, ps):
        want = reference(ref, p, len(tokens), 4)
        assert tokens == [t for t, _ in want]
        assert lps == [x for _, x in want]
    assert r.stats.generation_steps < 16 * len(ps) / 2  # batched rounds


def test_a_ragged_quantized_cache_rolls_back_per_stream():
    mx.random.seed(0)
    kv = KVSettings(8, GROUP, 0)
    singles = []
    for n in (3, 7):
        c = kv.layer(mlx_lm.models.cache.KVCache())
        c.update_and_fetch(*(mx.random.normal((1, 2, n, 32)),) * 2)
        singles.append(c)
    batch = __import__("mlx_mtp.batch_cache").batch_cache.merge(singles)
    assert isinstance(batch, RaggedQuantizedKVCache) and batch.bits == 8
    new = mx.random.normal((2, 2, 4, 32))
    batch.update_and_fetch(new, new)
    batch.rollback([3, 1])
    assert batch.lengths == [4, 10]
    back = batch.extract(1)
    assert back.quantized and back.offset == 10
    want = singles[1].copy()
    want.update_and_fetch(new[1:2], new[1:2])
    want.trim(1)
    for a, b in zip(back.keys, want.keys_and_values()[0]):
        assert mx.array_equal(a, b[..., :10, :])


def test_the_prompt_cache_keeps_quantized_entries(models):
    """A request that extends an earlier one reuses its quantized cache; the
    answer is mlx-lm's over the whole prompt (8 bits: no near-tie flips)."""
    model, tokenizer, ref = models("glm4_moe")
    config = ServeConfig(kv=KVSettings(8, GROUP, 0), drafts=DraftSettings(adaptive=False))
    server = LiveServer(model, tokenizer, "m", config)
    try:
        client = server.client()
        first = tiny.random_prompt(40, 3)
        r = client.completions.create(model="m", prompt=first, max_tokens=12,
                                      logprobs=0)  # fmt: skip
        again = first + tokenizer.encode(r.choices[0].text) + tiny.random_prompt(9, 4)
        server.wait_idle()
        entry = server.engine.prompt_cache.entries[-1].cache
        assert all(c.quantized for c in entry.trunk)
        r2 = client.completions.create(model="m", prompt=again, max_tokens=12)
        assert r2.usage.prompt_tokens_details.cached_tokens >= 30
        want = mlx_lm.generate(ref, tokenizer, again, max_tokens=12, kv_bits=8,
                               kv_group_size=GROUP, quantized_kv_start=0)  # fmt: skip
        assert r2.choices[0].text == want
    finally:
        server.close()


@pytest.mark.parametrize("bits", [None, 8])
def test_a_ragged_caches_keys_can_be_tied_as_pipeline_sharding_ties_them(bits):
    """mlx-lm's pipelined models write ``cache[-1].keys = mx.depends(...)``;
    a read-only ``keys`` hung a pipelined server's first prompt."""
    from mlx_mtp.batch_cache import merge

    singles = []
    for n in (3, 7):
        c = mlx_lm.models.cache.KVCache()
        if bits:
            c = KVSettings(bits, GROUP, 0).layer(c)
        c.update_and_fetch(*(mx.random.normal((1, 2, n, 32)),) * 2)
        c.update_and_fetch(*(mx.random.normal((1, 2, 1, 32)),) * 2)  # turned
        singles.append(c)
    batch = merge(singles)
    h = mx.ones((2, 1, 8))
    before = batch.keys
    batch.keys = mx.depends(batch.keys, h)
    batch.values = mx.depends(batch.values, h)
    after = batch.keys
    if bits:
        assert isinstance(after, tuple) and len(after) == len(before)
        assert all(mx.array_equal(a, b) for a, b in zip(after, before))
    else:
        assert mx.array_equal(after, before)
