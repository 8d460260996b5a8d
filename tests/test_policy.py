"""The draft count per round: chosen by cost and acceptance, never changing the output.

The policy drafts the k that maximises E(k) / cost(k) (costs and acceptance
injected here, so every decision is known in advance); no draft when the
costs say none can pay; plain rounds run one step ahead and are undone when a
stop token ends the generation; ``tune`` stores costs the next load uses.
"""

import json
import random

import mlx.core as mx
import pytest
from mlx_mtp.cli import app
from mlx_mtp.cli.app import run_app
from test_speculative import (
    assert_cache_exact,
    assert_same_or_near_tie,
    assert_states_close,
    reference_greedy,
)
from typer.testing import CliRunner

import mlx_mtp
from mlx_mtp.adaptive import (
    CostAwareDraft,
    RAMP,
    Costs,
    FixedDraft,
    best_draft_count,
    expected_tokens,
    prior_costs,
)
from mlx_mtp.config import HEAD_CONFIG_FILE, machine, store_tuned, tuned_entry
from mlx_mtp.defaults import MAX_DRAFT_MAX
from mlx_mtp.drafts import ModelDrafts, make_policy
from mlx_mtp.probe import machine_costs
from mlx_mtp.speculative import speculative_generate_step
from mlx_mtp.stats import MTPStats
from mlx_mtp.tune import tune

# a forward over T tokens costs T steps: no draft can pay, whatever is accepted
COMPUTE_BOUND = Costs([1.0, 2.0, 3.0, 4.0], [0.05, 0.1, 0.15])
# a forward over T tokens costs 1 + 0.1 (T - 1), a draft 0.05
MEMORY_BOUND = Costs([1.0, 1.1, 1.2, 1.3], [0.05, 0.1, 0.15])


# -- decisions --------------------------------------------------------------------


def test_expected_tokens():
    assert expected_tokens([0.5, 0.5], 0) == 1
    assert expected_tokens([0.5, 0.5], 2) == pytest.approx(1 + 0.5 + 0.25)


def test_no_draft_when_the_costs_say_none_can_pay():
    for acceptance in ([1.0], [0.9, 0.9, 0.9], [0.5]):
        assert best_draft_count(acceptance, COMPUTE_BOUND, 3) == 0
    policy = CostAwareDraft(3, COMPUTE_BOUND, prior=[0.95])
    assert [policy() for _ in range(500)] == [0] * 500  # not even a probe


def test_drafts_when_they_pay():
    # E(k) / cost(k) at acceptance 0.8: 1, 1.71, 2.03, 2.19 -> k = 3
    assert best_draft_count([0.8], MEMORY_BOUND, 3) == 3
    # at acceptance 0.2: 1, 1.04, 0.94, 0.86 -> k = 1
    assert best_draft_count([0.2], MEMORY_BOUND, 3) == 1
    # at 0.1 the first draft does not pay for itself: 1.1 / 1.15
    assert best_draft_count([0.1], MEMORY_BOUND, 3) == 0
    assert CostAwareDraft(3, MEMORY_BOUND, prior=[0.8])() == 3
    assert CostAwareDraft(2, MEMORY_BOUND, prior=[0.8])() == 2  # the upper bound


def test_measured_round_costs_take_precedence():
    costs = Costs(MEMORY_BOUND.verify, MEMORY_BOUND.draft, rounds=[1.0, 2.0, 3.0])
    assert costs.round(1) == 2.0
    assert costs.round(3) == pytest.approx(3.0 + 0.1 + 0.05)  # extended by the parts
    assert best_draft_count([0.8], costs, 3) == 0  # the parts alone would say 3


def test_policy_follows_acceptance_and_probes_rarely():
    policy = CostAwareDraft(3, MEMORY_BOUND, prior=[0.5])
    # at the prior, one standard error up (0.5 over the prior's 4 tests: 0.75)
    assert policy() == 3
    rounds = []
    for _ in range(300):  # drafts are never kept
        k = policy()
        rounds.append(k)
        if k:
            policy.update(k, 0)
    # the prior weighs 4 tests: 0.5 * 4 / (4 + n), one standard error up,
    # falls below the 0.15 a first draft needs to pay for itself after 19
    # rejected rounds
    first_plain = rounds.index(0)
    assert first_plain == 19
    probes = sum(k > 0 for k in rounds[first_plain:])
    assert 1 <= probes <= 6  # a probe now and then, ever rarer
    # the text gets easy: every probe is kept, and drafting comes back
    for _ in range(200):
        k = policy()
        if k:
            policy.update(k, k)
    assert policy() == 3


def test_a_guessed_acceptance_ramps_the_draft_count_up():
    """With no measured acceptance (the default guess) a round drafts at
    most ``RAMP`` until one keeps a draft, each keeping round doubling the
    bound; a measured prior drafts its best count at once. The bound holds
    for one stream (``count``) and for a served stream (``bound``, which the
    batch's draft length is capped by); a count the user fixed has none."""
    cheap = Costs([1.0, 1.05, 1.1, 1.15, 1.2, 1.25, 1.3, 1.35], [0.01] * 7)
    measured = ModelDrafts(CostAwareDraft(7, cheap, prior=[0.5]))
    assert (measured.count(), measured.bound()) == (7, 7)
    source = ModelDrafts(CostAwareDraft(7, cheap))
    counts = []
    for _ in range(4):
        k = source.count()
        counts.append(k)
        source.update("mtp", k, k)  # every draft kept: the best count stays 7
    assert counts == [RAMP, 2 * RAMP, 7, 7]
    # rounds whose drafts are all rejected do not move the bound
    source = ModelDrafts(CostAwareDraft(7, cheap))
    source.update("mtp", 0, 0)
    source.update("mtp", RAMP, 0)
    assert source.count() == RAMP
    # a served stream: its count is the batch's; its bound ramps alike
    served = ModelDrafts(FixedDraft(7), costs=cheap, cost_aware=True)
    bounds = []
    for _ in range(3):
        bounds.append(served.bound())
        served.update("mtp", bounds[-1], 1)
    assert bounds == [RAMP, 2 * RAMP, 7] and served.draft_max == 7
    assert ModelDrafts(FixedDraft(7, prior=[0.5]), costs=cheap, cost_aware=True).bound() == 7
    assert ModelDrafts(FixedDraft(7)).bound() == 7


def test_a_history_of_earlier_generations_is_a_measured_prior():
    """A server's ``AcceptanceHistory``: per drafter and depth, the share of
    tested drafts kept (drafts after a round's first rejection are not
    tested), a prior once a depth has ``min_tests`` tests, over about the last
    ``window``; a source made with it starts there, without the ramp."""
    from mlx_mtp.adaptive import AcceptanceHistory

    history = AcceptanceHistory(min_tests=4, window=8)
    assert history.prior("mtp") is None
    for _ in range(3):
        history.record("mtp", 3, 1)  # depth 1 kept, depth 2 rejected, 3 untested
    assert history.prior("mtp") is None  # 3 tests: too few
    history.record("mtp", 2, 2)
    assert history.prior("mtp") == [1.0, 0.25]  # depth 3: one test, too few
    for _ in range(30):  # the text changed: now nothing is kept
        history.record("mtp", 3, 0)
    first, second = history.prior("mtp")
    assert 0.0 < first < 0.05 and second == 0.25  # older tests faded
    assert history.tests["mtp"][0] <= 8 + 1e-9
    assert history.priors() == {"mtp": [round(first, 4), 0.25]}
    # a source started from it: measured, so no ramp; it hears every round
    cheap = Costs([1.0, 1.05, 1.1, 1.15], [0.01] * 3)
    served = ModelDrafts(FixedDraft(3, prior=history.prior("mtp")), costs=cheap,
                         cost_aware=True, history=history)  # fmt: skip
    assert served.bound() == 3 and served.rates()[:2] == [first, 0.25]
    served.update("mtp", 1, 1)
    assert history.prior("mtp")[0] > first


def test_probes_cost_at_most_about_one_percent():
    # drafts that do not pay at the prior and are never kept, over a short
    # answer: the probes' extra cost stays within 1% of its rounds (a gap of 8
    # rounds cost a random Qwen3-Next, whose head takes half a plain step, 2.6%)
    dear = Costs([1.0, 1.34, 1.69, 1.97], [0.52, 0.92, 1.34])
    for costs, prior in ((dear, 0.4), (MEMORY_BOUND, 0.02)):
        policy = CostAwareDraft(3, costs, prior=[prior])
        assert policy() == 0
        extra = 0.0
        for _ in range(100):
            k = policy()
            if k:
                extra += costs.round(k) - 1.0
                policy.update(k, 0)
        assert 0 < extra / 100 <= 0.01 + 1e-9


def test_prior_costs_by_machine():
    assert best_draft_count([0.9], prior_costs(compute_bound=True), 4) == 0
    assert best_draft_count([0.6], prior_costs(compute_bound=False), 4) > 0


# -- output ------------------------------------------------------------------------


class RandomDraft:
    """Any count 0..draft_max, seeded: the output must not depend on it."""

    def __init__(self, draft_max, seed):
        self.rng, self.draft_max = random.Random(seed), draft_max

    def __call__(self):
        return self.rng.randint(0, self.draft_max)

    def update(self, drafted, accepted):
        pass


def run(model, prompt, max_tokens, policy, stop=()):
    cache = model.make_cache()
    stats = MTPStats(trace=[])
    out = [
        t
        for t, _ in speculative_generate_step(
            prompt,
            model,
            max_tokens=max_tokens,
            drafts=policy,
            stop_tokens=stop,
            prompt_cache=cache,
            prefill_step_size=16,
            stats=stats,
        )
    ]
    return out, stats, cache


@pytest.fixture(scope="module")
def models(tiny_folders):
    from mlx_lm.utils import load_model as mlx_lm_load_model

    full, trunk_only = tiny_folders("deepseek_v3")
    return mlx_mtp.load_model(full), mlx_lm_load_model(trunk_only)[0]


@pytest.mark.parametrize(
    "make",
    [
        lambda: FixedDraft(3),
        lambda: RandomDraft(3, 0),
        lambda: RandomDraft(3, 1),
        lambda: CostAwareDraft(3, MEMORY_BOUND, prior=[0.5]),
        lambda: CostAwareDraft(3, COMPUTE_BOUND),
        lambda: FixedDraft(0, draft_max=3),  # plain rounds, the head reading along
    ],
)
def test_greedy_output_is_the_same_under_any_policy(models, make):
    model, reference = models
    prompt = list(range(40, 90))  # pending states pass PENDING_LIMIT on plain rounds
    expected = reference_greedy(reference, prompt, 60)
    got, stats, cache = run(model, prompt, 60, make())
    assert_same_or_near_tie(reference, prompt, expected, got)
    assert_cache_exact(model, cache, prompt, got)


@pytest.mark.parametrize("draft_max", [0, 3])
def test_a_stop_token_on_a_plain_step_undoes_the_step_run_ahead(models, draft_max):
    model, reference = models
    prompt = list(range(100, 130))
    # no draft, ever; with draft_max > 0 the head reads along (MTP on)
    plain = FixedDraft(0, draft_max=draft_max)
    free, _, _ = run(model, prompt, 30, plain)
    stop = next(t for i, t in enumerate(free) if i > 3 and t not in free[:i])
    expected = reference_greedy(reference, prompt, 30, stop={stop})
    got, stats, cache = run(model, prompt, 30, plain, {stop})
    assert got == expected and got[-1] == stop
    assert stats.drafted == 0
    if draft_max:
        assert_cache_exact(model, cache, prompt, got)
    else:  # the head never ran: the trunk holds what it read
        processed = prompt + got[:-1]
        fresh = model.make_cache()
        model.target(mx.array(processed)[None], fresh.trunk)
        assert_states_close(cache.trunk, fresh.trunk)


def test_a_consumer_that_stops_reading_leaves_the_cache_exact(models):
    model, _ = models
    prompt = list(range(100, 130))
    cache = model.make_cache()
    steps = speculative_generate_step(
        prompt, model, max_tokens=30, drafts=FixedDraft(0), prompt_cache=cache
    )
    got = [next(steps)[0] for _ in range(5)]
    steps.close()  # the next step had started ahead
    assert cache.offset == len(prompt) + len(got) - 1


# -- tune -----------------------------------------------------------------------------


def test_tune_writes_a_config_the_runtime_reads(tiny_folders, tmp_path):
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(tiny_folders("mimo")[0], folder)
    model, tokenizer = mlx_mtp.load(folder)
    assert tuned_entry(model) is None
    entry = tune(model, tokenizer, draft_max=2, max_tokens=8, repeats=2)
    assert "draft_vocab_trials" not in entry  # 288 tokens: nothing to cut
    assert entry["machine"] == machine()
    assert len(entry["costs"]["verify"]) == 3 and len(entry["costs"]["draft"]) == 2
    assert len(entry["acceptance_by_depth"]) == 2
    assert len(entry["speedups"]["bound"]) == 3 and entry["speedups"]["bound"][0] == 1
    store_tuned(model, entry)
    # a stale entry, from another machine, is kept but ignored
    config = json.loads((folder / HEAD_CONFIG_FILE).read_text())
    other = dict(entry, machine=dict(entry["machine"], device="elsewhere"))
    other["costs"] = {"verify": [1, 9, 9], "draft": [9, 9], "round": [1, 9, 9]}
    config["tuned"].insert(0, other)
    (folder / HEAD_CONFIG_FILE).write_text(json.dumps(config))

    reloaded, _ = mlx_mtp.load(folder)
    assert tuned_entry(reloaded)["costs"] == entry["costs"]
    policy = make_policy(reloaded, 2, costs=machine_costs)
    assert list(policy.costs.verify) == entry["costs"]["verify"]
    assert list(policy.costs.rounds) == entry["costs"]["round"]
    assert policy.prior == entry["acceptance_by_depth"]
    assert isinstance(make_policy(reloaded, 2, adaptive=False), FixedDraft)


def test_tune_command(tiny_folders, tmp_path):
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(tiny_folders("mimo")[0], folder)
    args = ["tune", "-m", str(folder), "--draft-max", "2", "-n", "24", "-r", "3"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "predicted" in result.stdout and "verify" in result.stdout
    config = json.loads((folder / HEAD_CONFIG_FILE).read_text())
    assert len(config["tuned"]) == 1
    assert config["tuned"][0]["draft_max"] == 2
    assert config["tuned"][0]["clock"] == "wall"
    result = CliRunner().invoke(app, args + ["--clock", "cpu", "--no-store"])
    assert result.exit_code == 0, result.output
    assert json.loads((folder / HEAD_CONFIG_FILE).read_text()) == config  # unchanged
    result = CliRunner().invoke(app, args + ["--clock", "cpu", "--json"])
    assert json.loads(result.stdout)["clock"] == "cpu"
    bad = CliRunner().invoke(app, args + ["--clock", "sundial"])
    assert bad.exit_code == 1
    assert (
        bad.output.strip().splitlines()[-1] == "error: --clock must be one of wall, cpu"
    )


def test_tune_stores_no_sample_too_small_to_hold(tiny_folders, tmp_path, capsys):
    """-n 1 generated no round to check a draft in: an acceptance of 0.0 was
    stored, and later runs started from it."""
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(tiny_folders("mimo")[0], folder)
    code = run_app(["tune", "-m", str(folder), "-n", "1", "-r", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 0
    assert err[-1].startswith("notice: not stored, the sample is too small")
    assert "0 depth-1 drafts checked (at least 24)" in err[-1]
    assert "each part timed 1x (at least 3x)" in err[-1]
    assert not (folder / HEAD_CONFIG_FILE).exists()
    assert tuned_entry(mlx_mtp.load(folder)[0]) is None


def test_tune_draft_max_is_capped_like_generate_and_bench(tiny_folders, capsys):
    folder = str(tiny_folders("mimo")[0])
    for command in (["tune"], ["bench"], ["generate", "-p", "hi"]):
        code = run_app([*command, "-m", folder, "--draft-max", str(MAX_DRAFT_MAX + 1)])
        err = capsys.readouterr().err
        assert code == 2 and "'--draft-max'" in err, err
        assert f"less than or equal to {MAX_DRAFT_MAX}" in err, err


def test_recommended_draft_max_bounds_the_drafts(tiny_folders, tmp_path):
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(tiny_folders("mimo")[0], folder)
    (folder / HEAD_CONFIG_FILE).write_text(json.dumps({"recommended_draft_max": 1}))
    model, tokenizer = mlx_mtp.load(folder)
    assert model.head_config == {"recommended_draft_max": 1}
    last = None
    for last in mlx_mtp.stream_generate(model, tokenizer, "hello", 16):
        pass
    assert last.stats.draft_max == 1 and len(last.stats.drafted_at) <= 1
    for last in mlx_mtp.stream_generate(model, tokenizer, "hello", 16, draft_max=3):
        pass
    assert last.stats.draft_max == 3


def test_a_native_head_drafts_from_its_draft_vocabulary(models):
    model, reference = models
    prompt = list(range(40, 70))
    expected = reference_greedy(reference, prompt, 30)
    vocab = mx.arange(0, 288, 2)  # even tokens only
    model.head.set_draft_vocab(vocab)
    try:
        got, stats, _ = run(model, prompt, 30, FixedDraft(2))
    finally:
        model.head.set_draft_vocab(None)
    assert got == expected
    assert all(t % 2 == 0 for r in stats.trace for t in r.drafted)
    full, full_stats, _ = run(model, prompt, 30, FixedDraft(2))
    assert any(t % 2 for r in full_stats.trace for t in r.drafted)


def test_tune_tries_draft_vocabularies_and_the_loader_applies_its_choice(
    tiny_folders, tmp_path
):
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(tiny_folders("mimo")[0], folder)
    model, tokenizer = mlx_mtp.load(folder)
    entry = tune(model, tokenizer, 2, max_tokens=8, repeats=2, vocab_sizes=(64, 128))
    trials = entry["draft_vocab_trials"]
    assert [t["size"] for t in trials] == [None, 64, 128]
    assert all(0 <= t["acceptance_1"] <= 1 and len(t["draft"]) == 2 for t in trials)
    assert "draft_vocab" not in model.head  # the trial leaves the head as it was
    entry["draft_vocab"] = list(range(0, 288, 3))  # as if 96 tokens had won
    store_tuned(model, entry)
    reloaded, _ = mlx_mtp.load(folder)
    assert reloaded.head.draft_vocab.tolist() == entry["draft_vocab"]
    # on another machine the entry, and its vocabulary, are ignored
    config = json.loads((folder / HEAD_CONFIG_FILE).read_text())
    config["tuned"][0]["machine"]["device"] = "elsewhere"
    (folder / HEAD_CONFIG_FILE).write_text(json.dumps(config))
    assert "draft_vocab" not in mlx_mtp.load(folder)[0].head


# -- hybrid trunks: a plain round keeps no per-token state ------------------------


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    import tiny_hybrid
    from mlx_lm.utils import load_model as mlx_lm_load_model

    root = tmp_path_factory.mktemp("hybrid")
    full, trunk_only = tiny_hybrid.build_folder(root / "qwen3_next", "qwen3_next")
    return mlx_mtp.load_model(full), mlx_lm_load_model(trunk_only)[0]


def test_plain_rounds_keep_no_states_and_stop_exactly(hybrid, monkeypatch):
    from mlx_mtp.recurrent.keep_states import KeepStatesCache

    model, reference = hybrid
    calls = []
    start = KeepStatesCache.start_verify
    monkeypatch.setattr(
        KeepStatesCache, "start_verify", lambda self: calls.append(1) or start(self)
    )
    prompt = list(range(50, 80))
    free, _, _ = run(model, prompt, 24, RandomDraft(0, 0))
    assert calls == []  # no verify pass: mlx-lm's own step, nothing kept
    stop = next(t for i, t in enumerate(free) if i > 3 and t not in free[:i])
    expected = reference_greedy(reference, prompt, 24, stop={stop})
    got, _, cache = run(model, prompt, 24, RandomDraft(0, 0), {stop})
    assert got == expected
    # the step started ahead on the stop token was undone: the caches hold
    # what mlx-lm's hold after the same tokens (prefill chunks, then steps)
    from mlx_lm.models.cache import make_prompt_cache

    ref = make_prompt_cache(reference)
    for s in range(0, len(prompt) - 1, 16):
        reference(mx.array(prompt[s : min(s + 16, len(prompt) - 1)])[None], cache=ref)
    for t in [prompt[-1]] + got[:-1]:
        reference(mx.array([[t]]), cache=ref)
    assert cache.offset == ref[-1].offset == len(prompt) + len(got) - 1
    for c, r in zip(cache.trunk, ref):
        if hasattr(c, "verifying"):  # recurrent: conv window and state
            for a, b in zip(c.cache, r.cache):
                assert mx.allclose(a, b, atol=1e-5).item()
    run(model, prompt, 8, FixedDraft(2))
    assert calls  # drafting rounds do keep


def test_untuned_on_a_compute_bound_cpu_no_round_drafts(models, monkeypatch):
    model, _ = models
    monkeypatch.setattr("mlx_mtp.config.compute_bound", lambda: True)
    policy = make_policy(model, 3)  # no tuned entry: the machine's prior
    _, stats, _ = run(model, list(range(40, 60)), 40, policy)
    assert stats.drafted == 0
    monkeypatch.setattr("mlx_mtp.config.compute_bound", lambda: False)
    _, stats, _ = run(model, list(range(40, 60)), 40, make_policy(model, 3))
    assert stats.drafted > 0


@pytest.mark.parametrize("kept", [0.05, 0.2, 0.345, 0.7])
def test_the_cost_aware_count_comes_within_3_percent_of_the_best_fixed(kept):
    """Bernoulli acceptances against the default model's measured costs: the
    cost-aware count keeps up with the best fixed one wherever the rate lies
    (at the estimate itself, without its standard error, 0.95 at 35%)."""
    import random

    costs = Costs([1.0, 1.13, 1.26, 1.39], [0.09, 0.115, 0.14])

    def speed(policy, seed, tokens=256):
        rng, n, time = random.Random(seed), 0, 0.0
        while n < tokens:
            k = policy()
            kept_now = 0
            while kept_now < k and rng.random() < kept:
                kept_now += 1
            n, time = n + kept_now + 1, time + costs.round(k)
            if k:
                policy.update(k, kept_now)
        return n / time

    seeds = range(200)
    for k_max in (1, 3):
        auto = sum(speed(CostAwareDraft(k_max, costs, [0.29, 0.26, 0.25]), s)
                   for s in seeds)  # fmt: skip
        best = max(sum(speed(FixedDraft(k), s) for s in seeds) for k in range(k_max + 1))
        assert auto / best >= 0.97, (k_max, auto / best)
