"""DFlash 2 drafters (``DFlash2DraftModel``): the block against the numpy
drafter (convolutions around each sublayer), the candidate selector's path
against numpy's, greedy output identical to plain, exact sampling against
the selector's distribution, and each round's accepted count as a
simulation of the numpy drafter predicts."""

import mlx.core as mx
import numpy as np
import pytest
import tiny
import tiny_dflash as td
from dflash_numpy import NumpyDFlash
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import apply_top_k
from mlx_lm.utils import load_model as mlx_lm_load_model
from test_dflash_rounds import chi2_passes

import mlx_mtp
from mlx_mtp.adaptive import FixedDraft
from mlx_mtp.drafts import ModelDrafts
from mlx_mtp.sampling import SamplingConfig, make_verifier
from mlx_mtp.speculative import speculative_generate_step
from mlx_mtp.target import output_head

FAMILIES = {"qwen3": 6, "qwen3_5": 4}


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    root = tmp_path_factory.mktemp("dflash2-targets")
    return {f: td.build_target(root / f, f, n) for f, n in FAMILIES.items()}


def numpy_drafter(model, folder):
    return NumpyDFlash(
        folder,
        np.array(model.target.embed_tokens.weight),
        np.array(output_head(model.target.model).weight),
    )


def features(model, ref, tokens):
    _, taps = model.target.forward(mx.array([tokens]), model.target.make_cache())
    return np.concatenate([np.array(taps.layers[i][0]) for i in ref.layer_ids], -1)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("layout", ["v1", "nested"])
def test_the_block_and_the_path_match_numpy(targets, tmp_path, family, layout):
    n = FAMILIES[family]
    sliding = dict(layer_types=["sliding_attention"] * 2, sliding_window=7)
    folder = td.build_drafter(
        tmp_path / "d", [n - 1, 0], n, kind="dflash2", layout=layout,
        rope_theta=30_000.0, is_causal=False, **sliding,
    )  # fmt: skip
    model = mlx_mtp.load_model(targets[family], draft=folder)
    drafter = model.drafters[-1]
    assert drafter.name == "dflash2"
    ref = numpy_drafter(model, folder)
    for seed, length in enumerate([1, 14]):
        tokens = tiny.random_prompt(length, seed=seed)
        got = np.array(mlx_mtp.draft_logits(model, tokens))
        context = features(model, ref, tokens[:-1]) if length > 1 else None
        if context is None:
            context = np.zeros((0, 64 * 2))
        block = [tokens[-1]] + [td.MASK] * 7
        np.testing.assert_allclose(got, ref.logits(context, block), atol=1e-4)
        # the selector's greedy path
        hidden = ref.hidden(context, block)
        want = ref.select(hidden, ref.head(hidden), tokens[-1])
        selector = drafter.model.candidate_selector
        h = mx.array(hidden.astype(np.float32))
        cands, unary, pairs = selector.slots(
            h, drafter.model.logits(h, drafter.lm_head)
        )
        path, previous = [], mx.array([tokens[-1]])
        for j in range(7):
            best = mx.argmax(selector.scores(unary[j], pairs[j], previous))
            previous = cands[j][best].reshape(1)
            path.append(previous.item())
        assert path == want


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def pair(request, tmp_path_factory):
    family, n = request.param, FAMILIES[request.param]
    root = tmp_path_factory.mktemp(f"dflash2-{family}")
    target = td.build_target(root / "target", family, n)
    folder = td.build_drafter(root / "d", [1, n - 2], n, kind="dflash2", agreeable=True)
    model = mlx_mtp.load_model(target, draft=folder)
    return model, mlx_lm_load_model(target)[0], folder


def run(model, prompt, k, n=24, verifier=None):
    stats = mlx_mtp.MTPStats(trace=[])
    steps = speculative_generate_step(
        prompt, model, max_tokens=n, verifier=verifier, stats=stats,
        drafts=ModelDrafts(FixedDraft(k), "dflash2"),
    )  # fmt: skip
    return [t for t, _ in steps], stats


def test_greedy_is_plain(pair):
    model, reference, _ = pair
    kept = 0
    for k in (1, 4, 7):
        for seed in range(2):
            prompt = tiny.random_prompt(15 + 9 * seed, seed=seed)
            got, stats = run(model, prompt, k)
            want = generate_step(
                mx.array(prompt), reference, max_tokens=24,
                sampler=lambda x: mx.argmax(x, -1),
            )  # fmt: skip
            assert got == [int(t) for t, _ in want]
            kept += stats.accepted
    assert kept > 0


def test_sampling_against_the_selector_is_exact(pair):
    model, reference, _ = pair
    prompt, temp, top_k, n = tiny.random_prompt(17, seed=4), 0.5, 4, 300

    def p_next(tokens):
        logits = reference(mx.array(tokens)[None])[0, -1:]
        logp = apply_top_k(logits - mx.logsumexp(logits, keepdims=True), top_k)
        return np.array(mx.softmax(logp / temp, axis=-1))[0].astype(np.float64)

    p0 = p_next(prompt)
    p1 = sum(p0[t] * p_next(prompt + [int(t)]) for t in np.flatnonzero(p0))
    runs = []
    for seed in range(n):
        config = SamplingConfig(
            temp=temp, top_k=top_k, seed=seed, draft_sampling="sample"
        )
        runs.append(run(model, prompt, 3, 2, make_verifier(config)))
    for i, p in enumerate([p0, p1]):
        assert chi2_passes(np.array([tokens[i] for tokens, _ in runs]), p, n)
    accepted = sum(s.accepted for _, s in runs)
    assert n / 4 < accepted < sum(s.drafted for _, s in runs)


def test_accepted_per_round_is_the_numpy_drafters(pair):
    model, _, folder = pair
    ref = numpy_drafter(model, folder)
    for seed, k in [(0, 3), (1, 7)]:
        prompt = tiny.random_prompt(20, seed=seed)
        got, stats = run(model, prompt, k, 20)
        seq = prompt + got
        feats = features(model, ref, seq)
        p, done, want = len(prompt) - 1, 0, []
        while done < 20:
            k_r, a = min(k, 20 - done - 1), 0
            if k_r:
                hidden = ref.hidden(feats[:p], [seq[p]] + [td.MASK] * k_r)
                path = ref.select(hidden, ref.head(hidden), seq[p])
                while a < k_r and path[a] == seq[p + 1 + a]:
                    a += 1
            want.append(a)
            p, done = p + a + 1, done + a + 1
        assert [r.accepted for r in stats.trace] == want
