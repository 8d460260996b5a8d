"""Sampling at temperature > 0 is lossless: MTP output has the main model's distribution.

The statistical check (``tv_bound``): for ``n`` samples of a distribution
``p``, the empirical distribution ``p_hat`` satisfies

    P( TV(p_hat, p) >= 1/2 * sum_i sqrt(p_i (1 - p_i) / n) + sqrt(ln(1/alpha) / (2n)) ) <= alpha

because E|p_hat_i - p_i| <= sqrt(Var p_hat_i) = sqrt(p_i (1 - p_i) / n) (Jensen),
and TV changes by at most 1/n when one sample changes, so McDiarmid's
inequality bounds the excess over the mean by exp(-2 n t^2). The bound holds
for any n (no asymptotics). Seeds are fixed, so the tests are deterministic;
``alpha`` is the chance that a correct sampler would fail at a random seed.
The tests also show the check has power: replacing the residual step by plain
resampling from ``p`` makes it fail.
"""

import json
import math
import sys

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import apply_top_k, make_logits_processors, make_sampler
from mlx_lm.utils import load_model as mlx_lm_load_model
from mlx_mtp.cli.app import run_app

import mlx_mtp
from mlx_mtp import sampling
from mlx_mtp.adaptive import CostAwareDraft, Costs, FixedDraft
from mlx_mtp.sampling import (
    SamplingConfig,
    SamplingVerifier,
    block_sample,
    make_verifier,
    match_sample,
    rejection_sample,
)
from mlx_mtp.speculative import speculative_generate_step
from mlx_mtp.stats import MTPStats

ALPHA = 1e-4
TRIALS = 20000  # simulated verify rounds per check
CHUNK = 5000  # rounds per vectorised batch (bounds memory)
K = 3  # drafts per round


def tv_bound(p: np.ndarray, n: int, alpha: float = ALPHA) -> float:
    return 0.5 * np.sqrt(p * (1 - p) / n).sum() + math.sqrt(math.log(1 / alpha) / (2 * n))


def tv(samples: np.ndarray, p: np.ndarray) -> float:
    counts = np.bincount(samples, minlength=p.size) / samples.size
    return 0.5 * np.abs(counts - p).sum()


def first_two_tokens(reference, prompt, temp: float, top_k: int):
    """The distributions of the first and second token that mlx-lm's model
    ``reference`` samples alone after ``prompt`` (its top-k filter and
    temperature, exactly): ``p1`` sums over every first token."""

    def p_next(tokens):
        logits = reference(mx.array(tokens)[None])[0, -1:]
        logprobs = apply_top_k(logits - mx.logsumexp(logits, keepdims=True), top_k)
        return np.array(mx.softmax(logprobs / temp, axis=-1))[0].astype(np.float64)

    p0 = p_next(prompt)
    p1 = sum(p0[t] * p_next(prompt + [int(t)]) for t in np.flatnonzero(p0))
    return p0, p1


def seeded_first_two(p, n, generate):
    """``generate(seed)`` -> ``(tokens, stats)`` for seeds ``0..n-1``: asserts
    that the first and second tokens follow ``p = first_two_tokens(...)``
    (total variation within ``tv_bound``) and returns every run's stats."""
    runs = [generate(seed) for seed in range(n)]
    for i, p_i in enumerate(p):
        samples = np.array([tokens[i] for tokens, _ in runs])
        assert tv(samples, p_i) < tv_bound(p_i, n)
    return [stats for _, stats in runs]


@pytest.fixture(scope="module")
def models(tiny_folders):
    full, trunk_only = tiny_folders("deepseek_v3")
    return mlx_mtp.load_model(full), mlx_lm_load_model(trunk_only)[0]


@pytest.fixture(scope="module")
def fixed_logits(models):
    """Main-model logits at K+1 positions and the head's logits for the same tokens."""
    model, _ = models
    tokens = list(range(40, 64))
    n = len(tokens)
    logits, _ = model.target(mx.array(tokens)[None], model.target.make_cache())
    head = mlx_mtp.mtp_logits(model, tokens)  # row i predicts tokens[i + 2]
    return logits[0, n - K - 1 :], head[n - K - 2 : n - 2]


# --- the verify step sampled many times on fixed logits ---------------------------


def simulate(logp, logq, mode: str, seed: int, block: bool = False):
    """``TRIALS`` independent rounds; returns per round (accepted, final token, drafts).

    ``mode``: ``match`` (greedy drafts, the verifier's rule), ``onehot`` (greedy
    drafts through the textbook rule: q one-hot), ``sample`` (drafts sampled from q);
    ``block``: checked by block verification rather than token by token.
    """
    V = logp.shape[-1]
    out = []
    key = mx.random.key(seed)
    for _ in range(TRIALS // CHUNK):
        key, k1, k2, k3 = mx.random.split(key, 4)
        p = mx.broadcast_to(mx.exp(logp), (CHUNK, K + 1, V))
        gumbel = mx.random.gumbel((CHUNK, K + 1, V), key=k1)
        u = mx.random.uniform(shape=(CHUNK, K), key=k2)
        if mode == "sample":
            q = mx.broadcast_to(mx.exp(logq), (CHUNK, K, V))
            drafts = mx.argmax(logq + mx.random.gumbel((CHUNK, K, V), key=k3), axis=-1)
        else:
            drafts = mx.broadcast_to(mx.argmax(logq, axis=-1), (CHUNK, K))
            q = (drafts[..., None] == mx.arange(V)).astype(mx.float32)
        if mode == "match":
            a, token = match_sample(mx.broadcast_to(logp, p.shape), drafts, gumbel)
        else:
            rule = block_sample if block else rejection_sample
            a, token = rule(p, q, drafts, u, gumbel)
        mx.eval(a, token, drafts)
        out.append((np.array(a), np.array(token), np.array(drafts)))
    return [np.concatenate(x) for x in zip(*out)]


def position_report(logp, a, token, drafts):
    """Per position j: (rounds that reached j, TV of the emitted token to p_j, bound)."""
    p = np.array(mx.exp(logp))
    rows = []
    for j in range(K + 1):
        reached = a >= j
        if j < K:  # the draft when it was kept, else the round's last token
            emitted = np.where(a > j, drafts[:, j], token)[reached]
        else:
            emitted = token[reached]
        n = int(reached.sum())
        rows.append((n, tv(emitted, p[j]), tv_bound(p[j], n) if n else float("inf")))
    return rows


CONFIGS = [
    SamplingConfig(temp=0.2),
    SamplingConfig(temp=0.3, top_p=0.95, min_p=0.02, top_k=40),
]


@pytest.mark.parametrize("config", CONFIGS, ids=["temp", "chain"])
@pytest.mark.parametrize("mode", ["match", "onehot", "sample"])
def test_verify_is_lossless_at_every_position(fixed_logits, config, mode):
    verifier = SamplingVerifier(config)
    logp, logq = (verifier.logprobs(x) for x in fixed_logits)
    a, token, drafts = simulate(logp, logq, mode, seed=1)
    report = position_report(logp, a, token, drafts)
    assert report[1][0] >= 1000, report  # drafts were accepted often enough to test
    assert (a < K).any() and (a == K).any()  # rejections and bonus tokens both ran
    for j, (n, dist, bound) in enumerate(report):
        if n >= 200:
            assert dist < bound, f"position {j}: TV {dist:.4f} >= {bound:.4f}, n={n}"


@pytest.mark.parametrize("mode", ["onehot", "sample"])
def test_plain_resampling_fails_the_check(fixed_logits, monkeypatch, mode):
    """The negative control: resampling from p instead of the residual is caught."""
    verifier = SamplingVerifier(CONFIGS[1])
    logp, logq = (verifier.logprobs(x) for x in fixed_logits)
    monkeypatch.setattr(sampling, "residual", lambda p, q: p)
    report = position_report(logp, *simulate(logp, logq, mode, seed=1))
    assert any(n >= 200 and dist >= bound for n, dist, bound in report), report


def test_filtered_distribution_is_mlx_lm_samplers(fixed_logits):
    """The p the verifier accepts against is what mlx-lm's own sampler draws from."""
    config = CONFIGS[1]
    logits = fixed_logits[0][:1]
    p = np.array(mx.exp(SamplingVerifier(config).logprobs(logits))[0])
    sampler = make_sampler(
        temp=config.temp, top_p=config.top_p, min_p=config.min_p, top_k=config.top_k
    )
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    mx.random.seed(3)
    draws = np.array(sampler(mx.broadcast_to(logprobs, (TRIALS, logits.shape[-1]))))
    assert tv(draws, p) < tv_bound(p, TRIALS)
    assert (p > 0).sum() < p.size  # the filters did cut the vocabulary


def test_penalties_see_only_the_accepted_prefix(fixed_logits):
    """Row j is processed with history + drafts[:j], exactly as mlx-lm would."""
    config = SamplingConfig(temp=0.7, repetition_penalty=1.5, frequency_penalty=0.3)
    verifier = SamplingVerifier(config)
    history = [50, 60, 61, 62]
    drafts = [verifier.draft(r[None], history, []) for r in fixed_logits[1]]
    rows = verifier._process(fixed_logits[0], history, drafts)
    processors = make_logits_processors(
        repetition_penalty=1.5, frequency_penalty=0.3
    )
    prefix = list(history)
    for j in range(K + 1):
        row = fixed_logits[0][j : j + 1]
        for proc in processors:
            row = proc(mx.array(prefix), row)
        np.testing.assert_array_equal(np.array(rows[j : j + 1]), np.array(row))
        if j < K:
            prefix.append(drafts[j].token.item())


# --- end to end through the loop ----------------------------------------------------


def run(model, prompt, max_tokens=24, draft_max=K, policy=None, **config):
    stats = MTPStats(trace=[])
    verifier = make_verifier(SamplingConfig(**config))
    steps = speculative_generate_step(
        prompt, model, max_tokens=max_tokens,
        verifier=verifier, drafts=policy or FixedDraft(draft_max), stats=stats,
    )
    return [t for t, _ in steps], stats


def reference_greedy(reference, prompt, max_tokens, processors):
    steps = generate_step(
        mx.array(prompt), reference, max_tokens=max_tokens,
        sampler=lambda x: mx.argmax(x, axis=-1), logits_processors=processors,
    )
    return [int(t) for t, _ in steps]


@pytest.mark.parametrize("penalty", [None, 1.5])
def test_temp_zero_is_plain_greedy(models, penalty):
    model, reference = models
    prompt = list(range(100, 130))
    expected = reference_greedy(
        reference, prompt, 24, make_logits_processors(repetition_penalty=penalty)
    )
    got, stats = run(model, prompt, temp=0.0, repetition_penalty=penalty)
    assert got == expected
    assert 0 < stats.accepted < stats.drafted


def test_seeded_runs_are_reproducible_with_and_without_mtp(models):
    model, _ = models
    prompt = list(range(70, 95))
    config = dict(temp=0.3, top_p=0.95, repetition_penalty=1.3, seed=7)
    plain, _ = run(model, prompt, draft_max=0, **config)
    with_mtp, stats = run(model, prompt, **config)
    assert with_mtp == plain  # greedy drafts: the same tokens as a plain seeded run
    assert 0 < stats.accepted < stats.drafted
    assert run(model, prompt, **config)[0] == with_mtp
    assert run(model, prompt, **dict(config, seed=8))[0] != with_mtp
    sampled = dict(config, draft_sampling="sample")
    first, stats = run(model, prompt, **sampled)
    assert run(model, prompt, **sampled)[0] == first and stats.accepted > 0


def test_end_to_end_distribution_with_sampled_drafts(models):
    """Seeded generations: the first two tokens follow mlx-lm's model sampled alone."""
    model, reference = models
    prompt, temp, top_k, n = list(range(10, 30)), 0.3, 4, 300
    p = first_two_tokens(reference, prompt, temp, top_k)

    def generate(seed):
        return run(model, prompt, 2, temp=temp, top_k=top_k, seed=seed,
                   draft_sampling="sample")  # fmt: skip

    stats = seeded_first_two(p, n, generate)
    # the second token was often an accepted draft
    assert sum(s.accepted for s in stats) > n / 4


# --- cost-aware draft count ----------------------------------------------------------

MEMORY_BOUND = Costs([1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6], [0.05 * k for k in range(1, 7)])


def test_cost_aware_run_is_lossless_and_drafts_less(models):
    model, reference = models
    prompt = list(range(100, 130))
    expected = reference_greedy(reference, prompt, 40, [])
    fixed, fixed_stats = run(model, prompt, 40, draft_max=6)
    policy = CostAwareDraft(6, MEMORY_BOUND, prior=[0.5])
    got, stats = run(model, prompt, 40, draft_max=6, policy=policy)
    assert got == expected == fixed
    assert {len(r.drafted) for r in stats.trace} != {6}  # the count did adapt
    assert stats.drafted / len(got) < fixed_stats.drafted / len(got)


# --- the flags reach the API ------------------------------------------------------------


def cli_tokens(capsys, folder, *flags):
    args = ["generate", "-m", str(folder), "-p", "hello", "-n", "12", "--json", *flags]
    assert run_app(args) == 0
    return json.loads(capsys.readouterr().out)


def test_every_sampling_flag_has_an_effect(tiny_folders, capsys):
    full, _ = tiny_folders("deepseek_v3")
    seeded = cli_tokens(capsys, full, "--temp", "0.1", "--seed", "1")
    assert seeded["stats"]["accepted"] > 0
    no_mtp = cli_tokens(capsys, full, "--temp", "0.1", "--seed", "1", "--no-mtp")
    assert no_mtp["tokens"] == seeded["tokens"]  # --seed: the same with and without MTP
    base = ["--temp", "0.3", "--seed", "1"]
    plain = cli_tokens(capsys, full, *base)
    assert plain["tokens"] != cli_tokens(capsys, full)["tokens"]  # --temp
    changes = [
        ["--seed", "2"],
        ["--top-k", "2"],
        ["--top-p", "0.3"],
        ["--min-p", "0.5"],
        ["--repetition-penalty", "0.2"],
        ["--presence-penalty=-3"],
        ["--frequency-penalty=-3"],
    ]
    for flag in changes:
        assert cli_tokens(capsys, full, *base, *flag)["tokens"] != plain["tokens"], flag
    forced = cli_tokens(capsys, full, *base, "--logit-bias", "65=100")
    assert set(forced["tokens"]) == {65}
    sampled = cli_tokens(capsys, full, *base, "--draft-sampling", "sample")
    assert sampled["stats"]["accepted"] != plain["stats"]["accepted"]
    adaptive = cli_tokens(capsys, full, *base, "--draft-max", "6")
    fixed = cli_tokens(capsys, full, *base, "--fixed-draft", "--draft-max", "6")
    assert adaptive["tokens"] == fixed["tokens"]  # greedy drafts: same tokens
    assert adaptive["stats"]["drafted"] != fixed["stats"]["drafted"]


def test_bad_logit_bias_is_one_line(tiny_folders, capsys):
    full, _ = tiny_folders("deepseek_v3")
    assert run_app(["generate", "-m", str(full), "-p", "x", "--logit-bias", "a=b"]) == 1
    assert capsys.readouterr().err.strip() == "error: --logit-bias wants ID=BIAS, got 'a=b'"


def test_api_sampler_and_sampling_options_conflict():
    with pytest.raises(ValueError, match="either sampler"):
        make_verifier(SamplingConfig(temp=0.5), sampler=lambda x: mx.argmax(x, -1))


# --- block verification ----------------------------------------------------------


def completed(logp, a, token, drafts, seed: int):
    """Each round's tokens at positions 0..K: the drafts it kept, its token,
    then the main model's own samples (on fixed logits, ``p_j`` whatever came
    before): what generation would emit there."""
    p = np.array(mx.exp(logp)).astype(np.float64)
    p /= p.sum(axis=-1, keepdims=True)
    rng = np.random.default_rng(seed)
    n = len(a)
    out = np.empty((n, K + 1), dtype=np.int64)
    for j in range(K + 1):
        own = rng.choice(p.shape[-1], size=n, p=p[j])
        kept = drafts[:, j] if j < K else own
        out[:, j] = np.where(a > j, kept, np.where(a == j, token, own))
    return out, p


@pytest.mark.parametrize("config", CONFIGS, ids=["temp", "chain"])
@pytest.mark.parametrize("mode", ["onehot", "sample"])
def test_block_verification_is_lossless(fixed_logits, config, mode):
    """Every position of what a round emits (completed by the main model's
    own sampling) follows ``p_j``, with drafts made and partly kept."""
    verifier = SamplingVerifier(config)
    logp, logq = (verifier.logprobs(x) for x in fixed_logits)
    a, token, drafts = simulate(logp, logq, mode, seed=2, block=True)
    assert (a < K).any() and (a == K).any() and (a > 0).mean() > 0.05
    seq, p = completed(logp, a, token, drafts, seed=3)
    for j in range(K + 1):
        dist, bound = tv(seq[:, j], p[j]), tv_bound(p[j], len(seq))
        assert dist < bound, f"position {j}: TV {dist:.4f} >= {bound:.4f}"


def test_block_verification_check_has_power(fixed_logits, monkeypatch):
    """The negative control: block verification's kept prefix with the next
    token drawn from ``p`` instead of the block residual is caught."""
    verifier = SamplingVerifier(CONFIGS[1])
    logp, logq = (verifier.logprobs(x) for x in fixed_logits)

    real = block_sample

    def from_p(p, q, drafts, u, gumbel):
        a, _ = real(p, q, drafts, u, gumbel)
        tokens = mx.argmax(mx.log(p) + gumbel, axis=-1)
        return a, mx.take_along_axis(tokens, a[..., None], axis=-1)[..., 0]

    monkeypatch.setattr(sys.modules[__name__], "block_sample", from_p)
    a, token, drafts = simulate(logp, logq, "sample", seed=2, block=True)
    seq, p = completed(logp, a, token, drafts, seed=3)
    report = [(tv(seq[:, j], p[j]), tv_bound(p[j], len(seq))) for j in range(K + 1)]
    assert any(dist >= bound for dist, bound in report), report


@pytest.mark.parametrize("temp", [0.7, 1.0])
def test_block_verification_keeps_at_least_as_many(fixed_logits, temp):
    """From the same sampled chains, block verification keeps at least as
    many drafts on average as token-wise checks (and on one-hot chains the
    same): printed for docs/performance.md."""
    config = SamplingConfig(temp=temp)
    verifier = SamplingVerifier(config)
    logp, logq = (verifier.logprobs(x) for x in fixed_logits)
    kept = {}
    for mode in ("sample", "onehot"):
        for block in (False, True):
            a, _, _ = simulate(logp, logq, mode, seed=4, block=block)
            kept[mode, block] = float(a.mean())
    print(f"temp {temp}: mean drafts kept of {K}: {kept}")
    se = 3 * K / math.sqrt(TRIALS)  # a generous bound on the sampling error
    assert kept["sample", True] >= kept["sample", False] - se
    assert abs(kept["onehot", True] - kept["onehot", False]) < se
