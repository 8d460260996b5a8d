"""Muse Glimmer's assistant (``muse_glimmer_assistant``) attached with
``--draft`` to a Muse Glimmer target (mlx-lm's ``muse_glimmer``): its
teacher-forced block logits against mlx-vlm 0.7.10's
``MuseGlimmerAssistantDraftModel`` on the same weights and target features
(mlx-vlm's own Muse Glimmer language model), within and past the sliding
window; greedy output with drafts accepted equal to mlx-lm's plain greedy
output; and one-line refusals where the assistant does not fit."""

import json

import mlx.core as mx
import numpy as np
import pytest
import tiny
import tiny_dflash as td
import tiny_muse as tm
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache, RotatingKVCache
from mlx_lm.utils import load_model as mlx_lm_load_model

import mlx_mtp
from mlx_mtp.adaptive import FixedDraft
from mlx_mtp.cache import can_rollback
from mlx_mtp.drafters import kind_of
from mlx_mtp.drafts import ModelDrafts
from mlx_mtp.errors import MTPError
from mlx_mtp.speculative import speculative_generate_step

pytest.importorskip("mlx_vlm")

LAYERS = [1, 4, 6]  # of the target's 8


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return tm.build_target(tmp_path_factory.mktemp("muse") / "target", agreeable=False)


def vlm_block_logits(lm, ref, tokens, block_size):
    """mlx-vlm's logits for the block after ``tokens``: its target's
    captured layers over ``tokens[:-1]`` through its assistant, fresh caches."""
    ids = list(ref.config.target_layer_ids)
    if len(tokens) > 1:
        out = lm(mx.array([tokens[:-1]]), capture_layer_ids=ids)
        hidden = mx.concatenate(out.hidden_states, axis=-1)
    else:
        hidden = mx.zeros((1, 0, tm.HIDDEN * len(ids)))
    block = mx.array([[tokens[-1]] + [tm.MASK] * (block_size - 1)])
    return np.array(ref(block, hidden, ref.make_cache())[0, 1:])


@pytest.mark.parametrize("window", [5, 64])
def test_block_logits_match_mlx_vlm(target, tmp_path, window):
    """Window 5: most contexts are past it (mlx-vlm keeps the last 5, the
    block's query j sees 5 - j of them); 64: all within."""
    folder = tm.build_assistant(tmp_path / "a", LAYERS, layers=3, window=window)
    model = mlx_mtp.load_model(target, draft=folder)
    drafter = model.drafters[-1]
    assert (drafter.name, drafter.block_size, drafter.max_drafts) == ("muse_glimmer", 8, 7)
    assert drafter.reads.layers == tuple(LAYERS)
    lm, ref = tm.vlm_reference(target, folder)
    for seed, length in enumerate([1, 3, 6, 7, 19]):
        tokens = tiny.random_prompt(length, seed=seed)
        got = np.array(mlx_mtp.draft_logits(model, tokens))
        want = vlm_block_logits(lm, ref, tokens, 8)
        assert got.shape == want.shape == (7, tiny.VOCAB)
        np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))
        top = np.argsort(-want, axis=-1)[:, :5]
        np.testing.assert_allclose(
            np.take_along_axis(got, top, -1), np.take_along_axis(want, top, -1),
            atol=1e-4,
        )  # fmt: skip
        np.testing.assert_allclose(got, want, atol=1e-4)


def test_the_window_reaches_both_ways_inclusively(target, tmp_path):
    """The mask is ``|q - k| <= sliding_window``: with a window one short of
    the block, the block's first and last positions see each other only at
    its full length; the logits still match mlx-vlm's."""
    folder = tm.build_assistant(tmp_path / "a", LAYERS, layers=3, window=7)
    model = mlx_mtp.load_model(target, draft=folder)
    lm, ref = tm.vlm_reference(target, folder)
    tokens = tiny.random_prompt(4, seed=9)
    np.testing.assert_allclose(
        np.array(mlx_mtp.draft_logits(model, tokens)),
        vlm_block_logits(lm, ref, tokens, 8), atol=1e-4,
    )  # fmt: skip
    # one shorter (DFlash's own rule, |q - k| < 7) would differ
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "sliding_window": 6}))
    short = mlx_mtp.load_model(target, draft=folder)
    assert not np.allclose(
        np.array(mlx_mtp.draft_logits(short, tokens)),
        vlm_block_logits(lm, ref, tokens, 8), atol=1e-4,
    )  # fmt: skip


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("muse-pair")
    target = tm.build_target(root / "target", agreeable=True)
    folder = tm.build_assistant(root / "a", LAYERS, layers=3, window=5, agreeable=True)
    return mlx_mtp.load_model(target, draft=folder), mlx_lm_load_model(target)[0]


def test_greedy_with_drafts_is_plain_greedy(pair):
    model, reference = pair
    kept = 0
    for k in (1, 2, 3, 7):
        for seed in range(2):
            prompt = tiny.random_prompt(9 + 8 * seed, seed=seed)
            stats = mlx_mtp.MTPStats()
            got = [t for t, _ in speculative_generate_step(
                prompt, model, max_tokens=24, stats=stats,
                drafts=ModelDrafts(FixedDraft(k), "muse_glimmer"),
            )]  # fmt: skip
            want = generate_step(
                mx.array(prompt), reference, max_tokens=24,
                sampler=lambda x: mx.argmax(x, -1),
            )  # fmt: skip
            assert got == [int(t) for t, _ in want]
            assert stats.drafted > 0
            kept += stats.accepted
    assert kept > 0


def greedy_at_every_limit(model, reference, source, limits=range(1, 25), ks=(1, 2, 3)):
    """Each generation of ``max_tokens`` in ``limits`` at ``k`` drafts a
    round is plain greedy's first tokens: one that ends on the token after a
    round with a rejected draft reads the trunk's caches one token at a time
    there. Returns the drafts drafted and accepted over them."""
    prompt = tiny.random_prompt(12, seed=1)
    want = [int(t) for t, _ in generate_step(
        mx.array(prompt), reference, max_tokens=max(limits),
        sampler=lambda x: mx.argmax(x, -1),
    )]  # fmt: skip
    stats = mlx_mtp.MTPStats()
    for k in ks:
        for n in limits:
            got = [t for t, _ in speculative_generate_step(
                prompt, model, max_tokens=n, stats=stats,
                drafts=ModelDrafts(FixedDraft(k), source),
            )]  # fmt: skip
            assert got == want[:n], (k, n)
    return stats.drafted, stats.accepted


def test_greedy_ends_as_plain_greedy_at_every_limit(pair):
    """The target's sliding layers (mlx-lm's ``RotatingKVCache``, a window
    of 6) are given plain caches: a wrapped rotating cache trims by moving
    its index and keeps the rejected drafts' keys, which the next one-token
    step attends to (each generation's last token was wrong)."""
    model, reference = pair
    drafted, accepted = greedy_at_every_limit(model, reference, "muse_glimmer")
    assert drafted > accepted > 0  # some rounds rejected a draft
    assert not any(isinstance(c, RotatingKVCache) for c in model.make_cache().trunk)


def test_a_dflash_drafter_on_the_target_ends_as_plain_greedy(pair, tmp_path):
    """The same for z-lab's DFlash on this target: the cause was the loop's
    (whether a trunk's caches roll back), not the assistant's."""
    target = pair[0].path
    folder = td.build_drafter(tmp_path / "d", LAYERS, 8, agreeable=True)
    model = mlx_mtp.load_model(target, draft=folder)
    drafted, accepted = greedy_at_every_limit(model, pair[1], "dflash", ks=(2,))
    assert drafted > accepted > 0


def test_a_rotating_cache_does_not_count_as_rolling_back():
    """Fresh, it says it trims (``is_trimmable``); once wrapped it cannot."""
    fresh = RotatingKVCache(max_size=6)
    assert fresh.is_trimmable()
    assert not can_rollback([fresh])
    assert can_rollback([KVCache()])


def test_the_kind_is_found_by_its_config(tmp_path):
    config = tm.assistant_config(LAYERS, layers=3)
    assert kind_of(config) == "muse_glimmer"
    assert kind_of({"model_type": "muse_glimmer_assistant"}) == "muse_glimmer"


def refusal(target, folder) -> str:
    with pytest.raises(MTPError) as e:
        mlx_mtp.load_model(target, draft=folder)
    message = str(e.value)
    assert "\n" not in message
    return message


def test_refuses_a_target_it_was_not_made_for(tmp_path):
    qwen = td.build_target(tmp_path / "qwen3", "qwen3", 8)
    folder = tm.build_assistant(tmp_path / "a", LAYERS, layers=3)
    message = refusal(qwen, folder)
    assert "made for Muse Glimmer (muse_glimmer), the model is qwen3" in message


def test_refuses_what_does_not_fit(target, tmp_path):
    past = tm.build_assistant(tmp_path / "past", [1, 4, 9], layers=3)
    assert "target_layer_ids [9] past the model's 8 layers" in refusal(target, past)
    wide = tm.assistant_config(LAYERS, layers=3, hidden_size=32)
    assert "hidden size 32, the model's is 64" in refusal(
        target, tm.save_assistant(tmp_path / "wide", wide, {})
    )
    other = tm.build_assistant(tmp_path / "other", LAYERS, layers=3, num_target_layers=52)
    assert "made for a target of 52 layers, the model has 8" in refusal(target, other)
    full = tm.build_assistant(
        tmp_path / "full", LAYERS, layers=3,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    )  # fmt: skip
    assert "the assistant's layers are all sliding_attention" in refusal(target, full)


def invoke(*args):
    from typer.testing import CliRunner

    from mlx_mtp.cli import app

    result = CliRunner().invoke(app, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    return result


def test_the_cli_drafts_with_it_describes_it_and_converts_it(tmp_path):
    target = tm.build_target(tmp_path / "target", agreeable=True)
    folder = tm.build_assistant(tmp_path / "a", LAYERS, layers=3, window=5, agreeable=True)

    def generate(*args):
        out = invoke("generate", "-m", target, "-p", "hello there", "-n", 16, "--json",
                     "--fixed-draft", "--draft-max", 3, *args)  # fmt: skip
        return json.loads(out.stdout)

    bare = generate()
    alone = generate("--draft", folder, "--draft-source", "muse_glimmer")
    assert set(alone["stats"]["by_source"]) == {"muse_glimmer"}
    assert alone["stats"]["by_source"]["muse_glimmer"]["drafted"] > 0
    assert alone["tokens"] == bare["tokens"]
    shown = invoke("info", folder).stdout
    assert "MuseGlimmerAssistantModel (Muse Glimmer's DFlash assistant (Meta))" in shown
    info = json.loads(invoke("info", folder, "--json").stdout)
    assert info["drafter"]["sliding_window"] == 5
    assert info["drafter"]["target_layer_ids"] == LAYERS
    out = tmp_path / "q8"
    invoke("convert", folder, out, "-q", "--q-bits", "8")
    tokens = tiny.random_prompt(12, seed=1)
    got = np.array(mlx_mtp.draft_logits(mlx_mtp.load_model(target, draft=out), tokens))
    want = np.array(mlx_mtp.draft_logits(mlx_mtp.load_model(target, draft=folder), tokens))
    # the same drafter, at a coarser grid
    assert np.corrcoef(got.ravel(), want.ravel())[0, 1] > 0.95
