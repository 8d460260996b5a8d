"""A DFlash drafter in the loop: greedy output identical to plain mlx-lm at
block sizes 2-8 from one stream, in ``batch_generate`` and in the server's
batched rounds; sampling exact (chi-square); and each round's accepted count
the one a round-by-round simulation of the numpy drafter predicts.

The targets are a Qwen3 dense and a Qwen3.5 hybrid model; the drafter is
``tiny_dflash``'s agreeable one (its drafts are often, not always, kept)."""

import json
import math
import threading

import mlx.core as mx
import numpy as np
import pytest
import tiny
import tiny_dflash as td
from dflash_numpy import NumpyDFlash
from live_server import LiveServer
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import apply_top_k
from mlx_lm.utils import load_model as mlx_lm_load_model

import mlx_mtp
from mlx_mtp.adaptive import FixedDraft
from mlx_mtp.drafts import ModelDrafts
from mlx_mtp.sampling import SamplingConfig, make_verifier
from mlx_mtp.draft_settings import DraftSettings
from mlx_mtp.serve import ServeConfig
from mlx_mtp.speculative import speculative_generate_step
from mlx_mtp.target import output_head

FAMILIES = {"qwen3": 6, "qwen3_5": 4}
PROMPTS = [
    tiny.random_prompt(n, seed=i) for i, n in enumerate([9, 23, 5, 17, 31, 12, 8, 40])
]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def pair(request, tmp_path_factory):
    """(model with the drafter attached, tokenizer, mlx-lm's model, drafter folder)."""
    family, n = request.param, FAMILIES[request.param]
    root = tmp_path_factory.mktemp(family)
    target = td.build_target(root / "target", family, n)
    folder = td.build_drafter(root / "dflash", [1, n - 2], n, agreeable=True)
    model, tokenizer = mlx_mtp.load(target, draft=folder)
    return model, tokenizer, mlx_lm_load_model(target)[0], folder


def reference_greedy(reference, prompt, n):
    steps = generate_step(
        mx.array(prompt), reference, max_tokens=n, sampler=lambda x: mx.argmax(x, -1)
    )
    return [int(t) for t, _ in steps]


def until_eos(tokens):
    """What a generation that stops at the end-of-sequence token keeps."""
    eos = tiny.VOCAB - 1
    return tokens[: tokens.index(eos)] if eos in tokens else tokens


def run(model, prompt, k, max_tokens=24, verifier=None, trace=False):
    stats = mlx_mtp.MTPStats(trace=[] if trace else None)
    steps = speculative_generate_step(
        prompt,
        model,
        max_tokens=max_tokens,
        drafts=ModelDrafts(FixedDraft(k), "dflash"),
        verifier=verifier,
        stats=stats,
    )
    return [t for t, _ in steps], stats


def test_greedy_is_plain_at_block_sizes_2_to_8(pair):
    model, tokenizer, reference, _ = pair
    total = mlx_mtp.MTPStats()
    for k in range(1, 8):  # a block of k + 1
        for prompt in PROMPTS[:3]:
            got, stats = run(model, prompt, k)
            assert got == reference_greedy(reference, prompt, 24), (k, prompt)
            assert stats.drafted > 0
            total.add(stats)
    assert 0 < total.accepted < total.drafted
    # through stream_generate, the block drafter's own block as the most
    responses = list(
        mlx_mtp.stream_generate(
            model,
            tokenizer,
            PROMPTS[4],
            30,
            draft_max=7,
            adaptive_draft=False,
            draft_source="mtp",
        )  # fmt: skip
    )
    assert [r.token for r in responses] == reference_greedy(reference, PROMPTS[4], 30)
    assert responses[-1].stats.drafted > 0


def test_the_last_block_is_cut_to_what_is_left(pair):
    model, _, reference, _ = pair
    got, stats = run(model, PROMPTS[1], 7, max_tokens=5, trace=True)
    assert got == reference_greedy(reference, PROMPTS[1], 5)
    generated = 0
    for r in stats.trace:
        assert len(r.drafted) <= 5 - generated - 1
        generated += r.accepted + 1


def test_eight_ragged_streams_in_batch_generate(pair):
    model, tokenizer, reference, _ = pair
    limits = [20, 7, 16, 3, 24, 11, 18, 9]
    out = mlx_mtp.batch_generate(
        model, tokenizer, PROMPTS, max_tokens=limits, return_token_ids=True,
        draft_max=4, adaptive_draft=False, draft_source="mtp",
    )  # fmt: skip
    for prompt, limit, got in zip(PROMPTS, limits, out.token_ids):
        assert got == until_eos(reference_greedy(reference, prompt, limit))
    assert sum(s.accepted for s in out.mtp_stats) > 0
    assert sum(s.drafted - s.accepted for s in out.mtp_stats) > 0


def test_eight_concurrent_requests_in_the_server(pair):
    model, tokenizer, _, _ = pair
    config = ServeConfig(max_batch=8, drafts=DraftSettings(draft_max=5, adaptive=False))
    server = LiveServer(model, tokenizer, "dflash", config)

    def ask_all(draft_max):
        results = {}

        def ask(i):
            body = {"prompt": PROMPTS[i], "max_tokens": 12, "temperature": 0,
                    "draft_source": "mtp", "draft_max": draft_max}  # fmt: skip
            status, data = server.post("/v1/completions", json.dumps(body).encode())
            results[i] = (status, json.loads(data))

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert all(status == 200 for status, _ in results.values())
        return [results[i][1] for i in range(8)]

    try:
        plain = ask_all(0)
        drafted = ask_all(5)
        assert server.engine.decoder.peak > 1
    finally:
        server.close()
    for a, b in zip(plain, drafted):
        assert b["choices"][0]["text"] == a["choices"][0]["text"]
    assert sum(b["usage"]["mtp"]["accepted"] for b in drafted) > 0


# --- exact sampling -----------------------------------------------------------


def chi2_critical(df: int, alpha_z: float = 3.0902) -> float:
    """The chi-square critical value at alpha = 1e-3 (Wilson-Hilferty)."""
    c = 2.0 / (9 * df)
    return df * (1 - c + alpha_z * math.sqrt(c)) ** 3


def chi2_passes(samples, p, n) -> bool:
    """Pearson's statistic over cells with expected count >= 5 (the rest
    pooled) within the 1e-3 critical value."""
    counts = np.bincount(samples, minlength=p.size).astype(float)
    big = p * n >= 5
    observed = list(counts[big]) + [counts[~big].sum()]
    expected = list(p[big] * n) + [p[~big].sum() * n]
    cells = [(o, e) for o, e in zip(observed, expected) if e > 0]
    stat = sum((o - e) ** 2 / e for o, e in cells)
    return stat < chi2_critical(len(cells) - 1)


@pytest.mark.parametrize("mode", ["greedy", "sample"])
def test_sampling_is_exact_with_drafts_made_and_partly_kept(pair, mode):
    """The first two tokens of seeded runs with 3 drafts a round follow
    mlx-lm's model sampled alone (temperature 0.5, top-k 4)."""
    model, _, reference, _ = pair
    prompt, temp, top_k, n = PROMPTS[1], 0.5, 4, 300

    def p_next(tokens):
        logits = reference(mx.array(tokens)[None])[0, -1:]
        logp = apply_top_k(logits - mx.logsumexp(logits, keepdims=True), top_k)
        return np.array(mx.softmax(logp / temp, axis=-1))[0].astype(np.float64)

    p0 = p_next(prompt)
    p1 = sum(p0[t] * p_next(prompt + [int(t)]) for t in np.flatnonzero(p0))
    runs = []
    for seed in range(n):
        config = SamplingConfig(temp=temp, top_k=top_k, seed=seed, draft_sampling=mode)
        runs.append(run(model, prompt, 3, 2, make_verifier(config)))
    for i, p in enumerate([p0, p1]):
        assert chi2_passes(np.array([tokens[i] for tokens, _ in runs]), p, n)
    # the check has power: the second tokens are not the first's distribution
    assert not chi2_passes(np.array([tokens[1] for tokens, _ in runs]), p0, n)
    accepted = sum(s.accepted for _, s in runs)
    drafted = sum(s.drafted for _, s in runs)
    assert n / 4 < accepted < drafted  # the second token was often a kept draft


# --- acceptance as the numpy drafter predicts ---------------------------------


def simulate(model, folder, prompt, generated, k, max_tokens):
    """Each round's accepted count, from the numpy drafter: the trunk has read
    the sequence up to position ``p - 1``; the block is ``[s_p, MASK x k_r]``
    with ``k_r = min(k, tokens left - 1)``; drafts are kept while they equal
    the tokens that follow."""
    ref = NumpyDFlash(
        folder,
        np.array(model.target.embed_tokens.weight),
        np.array(output_head(model.target.model).weight),
    )
    seq = prompt + generated
    _, taps = model.target.forward(mx.array([seq]), model.target.make_cache())
    features = np.concatenate([np.array(taps.layers[i][0]) for i in ref.layer_ids], -1)
    p, done, counts = len(prompt) - 1, 0, []
    while done < max_tokens:
        k_r = min(k, max_tokens - done - 1)
        a = 0
        if k_r:
            block = [seq[p]] + [ref.mask_token_id] * k_r
            drafts = ref.logits(features[:p], block).argmax(-1)
            while a < k_r and drafts[a] == seq[p + 1 + a]:
                a += 1
        counts.append(a)
        p, done = p + a + 1, done + a + 1
    return counts


@pytest.mark.parametrize("k", [2, 5, 7])
def test_accepted_per_round_is_the_numpy_drafters(pair, k):
    model, _, _, folder = pair
    kept = 0
    for prompt in PROMPTS[:3]:
        got, stats = run(model, prompt, k, max_tokens=20, trace=True)
        want = simulate(model, folder, prompt, got, k, 20)
        assert [r.accepted for r in stats.trace] == want
        kept += sum(want)
    assert kept > 0


def test_the_prompt_cache_keeps_the_drafters_caches(pair):
    """A request that continues an earlier one starts from the cached target
    and drafter caches (cut back where the prompts part) and answers as
    plain decoding does."""
    model, tokenizer, reference, _ = pair
    config = ServeConfig(max_batch=2, drafts=DraftSettings(draft_max=4, adaptive=False))
    server = LiveServer(model, tokenizer, "dflash", config)
    prompt = PROMPTS[7]
    try:
        answers = []
        for tail in ([], [65, 66, 67]):
            body = {"prompt": prompt + tail, "max_tokens": 10, "temperature": 0,
                    "draft_source": "dflash"}  # fmt: skip
            status, data = server.post("/v1/completions", json.dumps(body).encode())
            assert status == 200
            answers.append(json.loads(data))
    finally:
        server.close()
    assert answers[1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert answers[1]["usage"]["mtp"]["by_source"]["dflash"]["drafted"] > 0
    want = until_eos(reference_greedy(reference, prompt + [65, 66, 67], 10))
    assert answers[1]["choices"][0]["text"] == tokenizer.decode(want)
