"""A new DeepSeek-style family is one module and its test.

``families/toy_mtp.py`` (a Llama trunk with an MTP layer of its own names,
the hidden state first, zero-centred norms, position 0 zeroed) is put on
``mlx_mtp.heads``'s path, where a real family's module lives, and nothing
else is touched: it is found by its model_type, ``info`` lists it, its
head computes the fuse and closing norm ``heads.wiring`` writes once (pinned
against numpy), and greedy output with its drafts is mlx-lm's.
"""

import json
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import tiny
import tiny_plain
from mlx.utils import tree_flatten
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.llama import ModelArgs, TransformerBlock
from mlx_lm.utils import load_model as mlx_lm_load_model
from test_speculative import mtp_greedy, reference_greedy

import mlx_mtp
import mlx_mtp.heads as heads
from mlx_mtp.cli.app import run_app

FOLDER = Path(__file__).resolve().parent / "families"


@pytest.fixture
def toy_family(monkeypatch):
    monkeypatch.setattr(heads, "__path__", [*heads.__path__, str(FOLDER)])
    yield
    sys.modules.pop("mlx_mtp.heads.toy_mtp", None)
    if hasattr(heads, "toy_mtp"):
        delattr(heads, "toy_mtp")


def toy_weights(seed: int = 0):
    """A tiny Llama and the toy's ``mtp.*`` tensors, zero-centred norms near 0."""
    config, trunk = tiny_plain.plain_weights("llama", seed)
    mx.random.seed(seed + 1)
    d = config["hidden_size"]
    block = TransformerBlock(ModelArgs.from_dict({**config, "model_type": "llama"}))
    mtp = {f"mtp.{k}": v for k, v in tree_flatten(block.parameters())}
    for name in ("embed_norm", "hidden_norm", "out_norm"):
        mtp[f"mtp.{name}.weight"] = 0.1 * mx.random.normal((d,))
    mtp["mtp.proj.weight"] = mx.random.normal((d, 2 * d)) / np.sqrt(2 * d)
    return config, trunk, mtp


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("toy")
    config, trunk, mtp = toy_weights()
    full = tiny.save_folder(root / "full", config, trunk, mtp)
    return full, tiny.save_folder(root / "trunk", config, trunk)


def test_a_family_is_found_only_where_its_module_is(toy_family):
    family = heads.family_for({"model_type": "llama"})
    assert family is not None and family.__name__ == "mlx_mtp.heads.toy_mtp"
    assert "llama" in heads.supported_model_types()


def test_without_the_module_llama_has_no_family():
    assert heads.family_for("llama") is None


def test_a_model_type_two_modules_claim_is_refused(monkeypatch, tmp_path):
    (tmp_path / "second_glm.py").write_text('MODEL_TYPES = {"glm4_moe": "GLM again"}\n')
    monkeypatch.setattr(heads, "__path__", [*heads.__path__, str(tmp_path)])
    with pytest.raises(ValueError, match="glm4_moe is declared by .*deepseek.py and"):
        heads.family_for("glm4_moe")


def test_info_lists_the_new_family(toy_family, capsys):
    assert run_app(["info", "--json"]) == 0
    rows = {r["model_type"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["llama"]["models"] == "a toy head on Llama (tests only)"
    assert rows["llama"]["mtp_layers"] == 1


def zc_rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * (1 + w)


def test_toy_head_matches_numpy(toy_family, folders):
    model = mlx_mtp.load_model(folders[0])
    assert type(model.head).__name__ == "ToyMTP"
    w = mx.load(str(folders[0] / "model.safetensors"))
    g = lambda name: np.array(w[name])  # noqa: E731
    eps = model.config["rms_norm_eps"]
    rng = np.random.default_rng(1)
    hidden = rng.standard_normal((6, model.config["hidden_size"])).astype(np.float32)
    tokens = rng.integers(0, 256, 6)

    e = g("model.embed_tokens.weight")[tokens]
    e[0] = 0  # the sequence's first position
    fused = (
        np.concatenate(
            [
                zc_rms(hidden, g("mtp.hidden_norm.weight"), eps),
                zc_rms(e, g("mtp.embed_norm.weight"), eps),
            ],
            -1,
        )
        @ g("mtp.proj.weight").T
    )
    own = ("embed_norm", "hidden_norm", "proj", "out_norm")
    block = TransformerBlock(ModelArgs.from_dict(model.config))
    block.load_weights(
        [
            (k[4:], v)
            for k, v in w.items()
            if k.startswith("mtp.") and k[4:].split(".")[0] not in own
        ]
    )
    x = mx.array(fused)[None]
    y = np.array(block(x, create_attention_mask(x, None, return_array=True)))[0]
    expected = zc_rms(y, g("mtp.out_norm.weight"), eps) @ g("lm_head.weight").T

    got, _ = model.head(
        mx.array(hidden)[None], mx.array(tokens)[None], model.head.make_cache()
    )
    np.testing.assert_allclose(np.array(got[0]), expected, rtol=1e-4, atol=1e-4)


def test_greedy_with_the_toy_drafts_is_mlx_lms(toy_family, folders):
    model = mlx_mtp.load_model(folders[0])
    reference, _ = mlx_lm_load_model(folders[1])
    prompt = tiny.random_prompt(12)
    expected = reference_greedy(reference, prompt, 24)
    got, stats, _ = mtp_greedy(model, prompt, 24, draft_max=2)
    assert got == expected
    assert stats.drafted > 0
