"""Prompt-lookup (n-gram) drafts: the index's rules, greedy output identical to
mlx-lm's on every family (stop tokens and max_tokens inside a lookup draft
included), and sampling that stays exact."""

import time

import mlx.core as mx
import numpy as np
import pytest
import tiny_recurrent
from conftest import DRAFT_FAMILIES, MULTI_LAYER_FAMILIES, OWN_LAYOUT_FAMILIES
from mlx_lm.generate import generate_step
from mlx_lm.utils import load_model as mlx_lm_load_model
from test_sampling import first_two_tokens, seeded_first_two

import mlx_mtp
from mlx_mtp.adaptive import CostAwareDraft, FixedDraft, prior_costs
from mlx_mtp.drafts import AutoDrafts, ModelDrafts, LookupDrafts
from mlx_mtp.ngram import MATCH_CAP, MATCH_PRIORS, NgramIndex, PromptLookup
from mlx_mtp.sampling import SamplingConfig, make_verifier
from mlx_mtp.speculative import speculative_generate_step
from mlx_mtp.stats import MTPStats

# -- the index ------------------------------------------------------------------


def index(tokens, **kwargs):
    x = NgramIndex(**kwargs)
    x.extend(tokens)
    return x


def test_longest_suffix_wins_then_the_latest_occurrence():
    # (2, 3) continues with 9 at its latest occurrence, (1, 2, 3) with 4
    assert index([1, 2, 3, 4, 5, 2, 3, 9, 1, 2, 3]).propose(2) == [4, 5]
    assert index([7, 2, 3, 4, 5, 2, 3, 9, 1, 2, 3]).propose(2) == [9, 1]
    assert index([5, 6, 1, 5, 6, 2, 5, 6]).propose(1) == [2]  # the latest


def test_no_proposal_without_an_earlier_occurrence():
    assert index([1, 2, 3, 4]).propose(4) == []
    assert index([7, 8, 7]).propose(4) == []  # a 1-token match is not enough
    assert index([1, 2, 1, 2]).propose(0) == []
    assert index([1, 2, 1, 2]).propose(5) == [1, 2]  # up to the end


def test_appends_move_the_proposal():
    x = index([1, 2, 3, 4, 1, 2])
    assert x.propose(2) == [3, 4]
    x.append(3)
    assert x.propose(3) == [4, 1, 2]
    x.append(8)
    assert x.propose(3) == []


def test_match_counts_how_far_the_context_agrees_with_the_source():
    # [1, 2, 3] matches; the token before differs (8 vs 9): agreement 3
    assert index([9, 1, 2, 3, 4, 5, 8, 1, 2, 3]).match(2) == ([4, 5], 3)
    run = list(range(20))
    assert index(run + [99] + run).match(1) == ([99], 20)  # past n_max
    assert index(list(range(40)) * 2).match(1) == ([0], MATCH_CAP)
    assert index(list(range(40)) * 2).match(1, cap=6) == ([0], 6)
    assert index([1, 2, 3, 4]).match(3) == ([], 0)


def test_a_longer_agreement_drafts_more():
    # fresh estimates: a proposal after a 2-token agreement starts at
    # MATCH_PRIORS[0], one after 16 or more at MATCH_PRIORS[-1]
    short = PromptLookup(prior_costs())
    short.sync([5, 1, 2, 3, 4, 5, 6, 7, 8, 9, 6, 1, 2])
    long = PromptLookup(prior_costs())
    run = list(range(100, 120))
    long.sync(run + list(range(20)) + [99] + run)
    assert len(short.drafts(8)) == 1
    assert len(long.drafts(8)) >= 4
    assert long.estimate is long.estimates[-1]
    long.update(6, 0)  # learning in one class leaves the others alone
    assert long.estimates[-1].rates[0] < MATCH_PRIORS[-1]
    assert short.estimates[-1].rates[0] == MATCH_PRIORS[-1]


def test_a_long_history_stays_fast():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 500, 100_000).tolist()
    tic = time.perf_counter()
    x = index(tokens)
    for t in tokens[:10_000]:
        x.propose(8)
        x.append(t)
    assert time.perf_counter() - tic < 2.0  # no scan of the history per call


def test_lookup_source_syncs_and_starts_over_on_a_shorter_history():
    lookup = PromptLookup(prior_costs())
    lookup.sync([1, 2, 3, 1, 2])
    assert lookup.index.propose(1) == [3]
    lookup.sync([1, 2, 3, 1, 2, 3])
    assert len(lookup.index) == 6
    lookup.sync([4, 5])  # another conversation state
    assert lookup.index.tokens == [4, 5]


def test_a_compute_bound_machine_never_checks_a_proposal():
    # a verify over t tokens costs t plain steps: no proposal can pay
    lookup = PromptLookup(prior_costs(compute_bound=True), prior=[0.9])
    lookup.sync([1, 2, 3, 4, 1, 2])
    assert lookup.drafts(4) == [] and lookup.proposed == 1


# -- the loop -------------------------------------------------------------------

REPEATING = list(range(20, 44)) * 2 + list(range(20, 30))  # lookups hit at once


def reference_greedy(reference, prompt, max_tokens, stop=()):
    out = []
    for tok, _ in generate_step(
        mx.array(prompt), reference, max_tokens=max_tokens, sampler=lambda x: mx.argmax(x, -1)
    ):
        out.append(int(tok))
        if out[-1] in stop:
            break
    return out


def run(model, prompt, max_tokens, policy, mode="ngram", stop=(), config=None):
    stats = MTPStats()
    lookup = PromptLookup(prior_costs(), prior=[0.9])
    source = (
        AutoDrafts([ModelDrafts(policy)], lookup) if mode == "auto" else LookupDrafts(lookup)
    )
    verifier = make_verifier(config) if config is not None else None
    steps = speculative_generate_step(
        prompt, model, max_tokens=max_tokens, drafts=source,
        stop_tokens=stop, stats=stats, verifier=verifier,
    )  # fmt: skip
    return [t for t, _ in steps], stats


FAMILIES = DRAFT_FAMILIES + OWN_LAYOUT_FAMILIES + MULTI_LAYER_FAMILIES
RECURRENT = list(tiny_recurrent.MODEL_TYPES)  # recurrent states roll back too


@pytest.fixture(scope="module")
def folders(tiny_folders, tmp_path_factory):
    root = tmp_path_factory.mktemp("recurrent")

    def get(family):
        if family in RECURRENT:
            return tiny_recurrent.build_folder(root / family, family)
        return tiny_folders(family)

    return get


@pytest.mark.parametrize("family", FAMILIES + RECURRENT)
def test_greedy_identical_with_lookup_drafts(folders, family):
    full, trunk = folders(family)
    model, reference = mlx_mtp.load_model(full), mlx_lm_load_model(trunk)[0]
    expected = reference_greedy(reference, REPEATING, 24)
    for mode, policy in (
        ("ngram", FixedDraft(0)),  # lookup drafts alone (MTP off)
        ("auto", FixedDraft(2)),
        ("auto", CostAwareDraft(3, prior_costs(), prior=[0.5])),
    ):
        got, stats = run(model, REPEATING, 24, policy, mode)
        assert got == expected, (mode, policy)
        if mode == "ngram":
            assert stats.lookup_drafted > 0


def test_stops_and_limits_inside_a_lookup_draft(tiny_folders):
    full, trunk = tiny_folders("deepseek_v3")
    model, reference = mlx_mtp.load_model(full), mlx_lm_load_model(trunk)[0]
    free, stats = run(model, REPEATING, 30, FixedDraft(0))
    assert stats.lookup_accepted > 0
    for max_tokens in range(1, 12):  # limits at every offset of the first drafts
        assert run(model, REPEATING, max_tokens, FixedDraft(0))[0] == free[:max_tokens]
    for stop in sorted(set(free[:12])):
        expected = reference_greedy(reference, REPEATING, 30, {stop})
        got, _ = run(model, REPEATING, 30, FixedDraft(0), stop={stop})
        assert got == expected and got[-1] == stop


def test_a_model_without_a_head_drafts_by_lookup(tiny_folders):
    _, trunk = tiny_folders("mimo")
    model, reference = mlx_mtp.load_model(trunk), mlx_lm_load_model(trunk)[0]
    assert model.head is None
    got, stats = run(model, REPEATING, 20, FixedDraft(0))
    assert got == reference_greedy(reference, REPEATING, 20)
    assert stats.lookup_drafted > 0


def test_sampling_with_lookup_drafts_is_exact(tiny_folders):
    """Seeded generations whose first token is checked against a lookup draft:
    the first two tokens follow mlx-lm's model sampled alone."""
    full, trunk = tiny_folders("deepseek_v3")
    model, reference = mlx_mtp.load_model(full), mlx_lm_load_model(trunk)[0]
    prompt, temp, top_k, n = REPEATING, 0.5, 4, 300
    p = first_two_tokens(reference, prompt, temp, top_k)
    for draft_sampling in ("greedy", "sample"):

        def generate(seed):
            config = SamplingConfig(
                temp=temp, top_k=top_k, seed=seed, draft_sampling=draft_sampling
            )
            return run(model, prompt, 2, FixedDraft(0), config=config)

        stats = seeded_first_two(p, n, generate)
        # every generation checked a lookup draft first
        assert sum(s.lookup_drafted for s in stats) >= n


def test_no_lookup_source_where_it_cannot_pay(tiny_folders, monkeypatch):
    """On a compute-bound machine the source is left out altogether, so plain
    steps keep running one ahead (a lookup that may come disables that)."""
    from mlx_mtp import config
    from mlx_mtp.drafts import NoDrafts, make_source

    model = mlx_mtp.load_model(tiny_folders("mimo")[0])
    # the pinned memory-bound guess
    assert isinstance(make_source(model, "auto", 0), LookupDrafts)
    assert isinstance(make_source(model, "mtp", 0), NoDrafts)
    monkeypatch.setattr(config, "compute_bound", lambda: True)
    assert isinstance(make_source(model, "auto", 0), NoDrafts)
