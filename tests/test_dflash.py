"""DFlash drafters as z-lab publishes them: loading both config layouts,
refusing what does not fit the target, and the teacher-forced block logits
(``mlx_mtp.draft_logits``) against an independent numpy drafter
(``dflash_numpy``) on tiny (target, drafter) pairs."""

import json

import mlx.core as mx
import numpy as np
import pytest
import tiny
import tiny_dflash as td
from dflash_numpy import NumpyDFlash

import mlx_mtp
from mlx_mtp.drafters import is_drafter, kinds
from mlx_mtp.drafters.dflash import DFlashArgs, default_layer_ids
from mlx_mtp.errors import MTPError
from mlx_mtp.target import output_head

TARGET_LAYERS = {"qwen3": 6, "qwen3_5": 4}


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    root = tmp_path_factory.mktemp("dflash-targets")
    return {f: td.build_target(root / f, f, n) for f, n in TARGET_LAYERS.items()}


def reference_logits(model, folder, tokens):
    """The numpy drafter's block logits after ``tokens`` (the target's layer
    outputs over ``tokens[:-1]`` from the loaded trunk)."""
    ref = NumpyDFlash(
        folder,
        np.array(model.target.embed_tokens.weight),
        np.array(output_head(model.target.model).weight),
    )
    features = np.zeros((0, 64 * len(ref.layer_ids)))
    if len(tokens) > 1:
        context = mx.array([tokens[:-1]])
        _, taps = model.target.forward(context, model.target.make_cache())
        layers = [np.array(taps.layers[i][0]) for i in ref.layer_ids]
        features = np.concatenate(layers, -1)
    block = [tokens[-1]] + [ref.mask_token_id] * (json_block(folder) - 1)
    return ref.logits(features, block)


def json_block(folder) -> int:
    config = json.loads((folder / "config.json").read_text())
    return config.get("block_size") or config["dflash_config"]["block_size"]


CASES = {
    # family, layout, target_layer_ids (not the default spacing), drafter extras
    "qwen3-v1": ("qwen3", "v1", [4, 1, 2], {}),
    "qwen3-nested": ("qwen3", "nested", [0, 3, 5], {"rope_theta": 20_000.0}),
    "qwen3-sliding": (
        "qwen3",
        "nested",
        [1, 4],
        dict(layer_types=["sliding_attention", "full_attention"], sliding_window=6),
    ),
    "qwen3-sliding-bidirectional": (
        "qwen3",
        "v1",
        [2, 3],
        dict(layer_types=["sliding_attention"] * 2, sliding_window=5, is_causal=False),
    ),
    "qwen3-scaled-logits": (
        "qwen3",
        "nested",
        [1, 3],
        dict(output_multiplier=0.3, final_logit_softcapping=2.0),
    ),
    "qwen3_5-v1": ("qwen3_5", "v1", [0, 2], {"rope_theta": 5_000.0}),
    "qwen3_5-nested": ("qwen3_5", "nested", [3, 1, 2], {}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_block_logits_match_the_numpy_drafter(targets, tmp_path, case):
    family, layout, ids, extra = CASES[case]
    n = TARGET_LAYERS[family]
    folder = td.build_drafter(tmp_path / "d", ids, n, layout=layout, **extra)
    model = mlx_mtp.load_model(targets[family], draft=folder)
    for seed, length in enumerate([1, 9, 23]):
        tokens = tiny.random_prompt(length, seed=seed)
        got = np.array(mlx_mtp.draft_logits(model, tokens))
        want = reference_logits(model, folder, tokens)
        assert got.shape == (json_block(folder) - 1, tiny.VOCAB)
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_a_shorter_block_is_the_first_slots_of_a_causal_one(targets, tmp_path):
    """``block_size`` cuts the block: in causal layers its logits are the
    longer block's first rows (a bidirectional block sees its later masks)."""
    causal = dict(layer_types=["sliding_attention"] * 2, sliding_window=64)
    folder = td.build_drafter(tmp_path / "d", [1, 4], 6, **causal)
    model = mlx_mtp.load_model(targets["qwen3"], draft=folder)
    tokens = tiny.random_prompt(12, seed=3)
    full = np.array(mlx_mtp.draft_logits(model, tokens))
    short = np.array(mlx_mtp.draft_logits(model, tokens, block_size=4))
    assert short.shape == (3, tiny.VOCAB)
    np.testing.assert_allclose(short, full[:3], atol=1e-5)
    with pytest.raises(ValueError, match="at least 2"):
        mlx_mtp.draft_logits(model, tokens, block_size=1)


def test_both_layouts_read_alike():
    v1 = td.drafter_config([1, 5], 9, layout="v1", block_size=16, rope_theta=1e6)
    nested = td.drafter_config(
        [1, 5], 9, layout="nested", block_size=16, rope_theta=1e6
    )
    a, b = DFlashArgs.from_config(v1), DFlashArgs.from_config(nested)
    assert (a.block_size, a.rope_theta, a.target_layer_ids) == (16, 1e6, (1, 5))
    assert (b.block_size, b.rope_theta, b.mask_token_id) == (16, 1e6, td.MASK)
    assert a.layer_types == ("full_attention",) * 2 and a.is_causal is None


def test_the_published_default_taps():
    # z-lab's Qwen3-4B drafter (36 layers, 5 taps) reads 1, 9, 17, 25, 33
    assert default_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_layer_ids(28, 1) == [14]


def test_a_drafter_folder_is_recognised(tmp_path):
    folder = td.build_drafter(tmp_path / "d", [1], 6)
    assert kinds()["DFlashDraftModel"] == "dflash"
    assert is_drafter(folder)


def test_the_drafter_reads_the_target_and_drafts_per_block(targets, tmp_path):
    folder = td.build_drafter(tmp_path / "d", [4, 1], 6, block_size=6)
    model, _ = mlx_mtp.load(targets["qwen3"], draft=folder)
    drafter = model.drafters[-1]
    assert drafter.name == "dflash" and drafter.reads.layers == (4, 1)
    assert drafter.max_drafts == 5 and drafter.flat_cost
    assert drafter.prior_cost(1) == drafter.prior_cost(5) > 0
    assert model.target.tapped == (1, 4)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(hidden_size=32), "hidden size 32, the model's is 64"),
        (dict(vocab_size=1000), "vocabulary of 1000"),
        (dict(num_target_layers=36), "made for a target of 36 layers"),
        (dict(target_layer_ids=[1, 9]), r"target_layer_ids \[9\] past the model's 6"),
        (dict(mask_token_id=5000), "mask_token_id 5000 past the vocabulary"),
        (dict(block_size=1), "block_size 1 drafts nothing"),
        (dict(target_layer_ids=None), "no dflash_config.target_layer_ids"),
        (dict(layer_types=["sliding_attention"] * 2), "without a sliding_window"),
    ],
)
def test_a_drafter_that_does_not_fit_is_one_line(targets, tmp_path, change, message):
    config = td.drafter_config([1, 4], 6, layout="v1")
    for key, value in change.items():
        if key in ("target_layer_ids", "mask_token_id"):
            config["dflash_config"][key] = value
        else:
            config[key] = value
    weights = td.drafter_weights(td.drafter_config([1, 4], 6))
    folder = td.save_drafter(tmp_path / "d", config, weights)
    with pytest.raises(MTPError, match=message) as e:
        mlx_mtp.load_model(targets["qwen3"], draft=folder)
    assert "\n" not in str(e.value) and "does not fit the model" in str(e.value)


def test_a_drafter_with_wrong_tensors_is_one_line(targets, tmp_path):
    config = td.drafter_config([1, 4], 6)
    weights = td.drafter_weights(config)
    weights["fc.weight"] = weights["fc.weight"][:, :64]
    folder = td.save_drafter(tmp_path / "d", config, weights)
    with pytest.raises(MTPError, match="does not fit the model") as e:
        mlx_mtp.load_model(targets["qwen3"], draft=folder)
    assert "\n" not in str(e.value)


def test_draft_logits_needs_a_block_drafter(targets):
    model = mlx_mtp.load_model(targets["qwen3"])
    with pytest.raises(ValueError, match="no block drafter attached"):
        mlx_mtp.draft_logits(model, [1, 2, 3])
