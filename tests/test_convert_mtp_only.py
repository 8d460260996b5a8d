"""``--mtp-only``: a head added to a trunk converted without it equals a full conversion.

The Hub case runs offline against a Hugging Face cache built in a temporary
folder that holds only the config, the index and the shard with the MTP
tensors: the conversion succeeding proves the trunk shards were never needed.
"""

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
import tiny
from mlx_mtp.convert import add_mtp, convert

import mlx_mtp
from mlx_mtp.errors import MTPError
from mlx_mtp.generate import mtp_logits

TOKENS = list(range(40, 72))


@pytest.mark.parametrize(
    "family",
    [
        "glm4_moe",
        "mimo",
        "glm_moe_dsa",
        "ernie4_5_moe",
        "exaone_moe",
        "longcat_flash",
        "step3p5",
        "mimo_v2_flash",
    ],
)
@pytest.mark.parametrize("quantize", [False, True])
def test_head_added_later_equals_full_conversion(
    tiny_folders, tmp_path, family, quantize
):
    full_src, trunk_src = tiny_folders(family)
    full = convert(full_src, tmp_path / "full", quantize=quantize)
    trunk = convert(trunk_src, tmp_path / "trunk", quantize=quantize)
    assert mlx_mtp.load_model(trunk).head is None
    add_mtp(full_src, trunk)
    a, b = mlx_mtp.load_model(full), mlx_mtp.load_model(trunk)
    np.testing.assert_array_equal(
        np.array(mtp_logits(a, TOKENS)), np.array(mtp_logits(b, TOKENS))
    )
    assert json.loads((trunk / "config.json").read_text()).get(
        "quantization"
    ) == json.loads((full / "config.json").read_text()).get("quantization")
    with pytest.raises(MTPError, match="exists"):
        add_mtp(full_src, trunk)
    add_mtp(full_src, trunk, force=True)


def test_mismatched_trunk_is_refused(tiny_folders, tmp_path):
    trunk = convert(tiny_folders("deepseek_v3")[1], tmp_path / "trunk")
    before = sorted(p.name for p in trunk.iterdir())
    with pytest.raises(MTPError, match="deepseek_v3 model, the head is mimo"):
        add_mtp(tiny_folders("mimo")[0], trunk)
    other = shutil.copytree(tiny_folders("deepseek_v3")[0], tmp_path / "other")
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps(dict(config, vocab_size=320)))
    with pytest.raises(MTPError, match="vocab_size 320 vs 288"):
        add_mtp(other, trunk)
    assert sorted(p.name for p in trunk.iterdir()) == before


def _fake_hub_cache(root, repo, files):
    """A Hugging Face cache holding ``files`` (name -> source path) of ``repo``."""
    commit = "0" * 40
    base = root / "hub" / f"models--{repo.replace('/', '--')}"
    (base / "refs").mkdir(parents=True)
    (base / "refs" / "main").write_text(commit)
    snap = base / "snapshots" / commit
    snap.mkdir(parents=True)
    for name, src in files.items():
        shutil.copy(src, snap / name)
    return root / "hub"


def test_hub_repo_fetches_only_mtp_shards(tiny_folders, tmp_path, monkeypatch):
    from huggingface_hub import constants

    config, trunk_w, mtp_w = tiny.build_weights("glm4_moe")
    shards = tmp_path / "shards"
    shards.mkdir()
    mx.save_safetensors(str(shards / "model-00001-of-00002.safetensors"), trunk_w)
    mx.save_safetensors(str(shards / "model-00002-of-00002.safetensors"), mtp_w)
    index = {"weight_map": {k: "model-00001-of-00002.safetensors" for k in trunk_w}}
    index["weight_map"].update({k: "model-00002-of-00002.safetensors" for k in mtp_w})
    (shards / "model.safetensors.index.json").write_text(json.dumps(index))
    (shards / "config.json").write_text(json.dumps(config))
    cache = _fake_hub_cache(
        tmp_path / "hf",
        "tiny-org/glm-mtp",
        {
            n: shards / n
            for n in (
                "config.json",
                "model.safetensors.index.json",
                "model-00002-of-00002.safetensors",
            )
        },
    )
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)

    trunk = convert(tiny_folders("glm4_moe")[1], tmp_path / "trunk")
    add_mtp("tiny-org/glm-mtp", trunk)
    full = convert(tiny_folders("glm4_moe")[0], tmp_path / "full")
    np.testing.assert_array_equal(
        np.array(mtp_logits(mlx_mtp.load_model(full), TOKENS)),
        np.array(mtp_logits(mlx_mtp.load_model(trunk), TOKENS)),
    )
    with pytest.raises(MTPError, match="tiny-org/absent"):
        add_mtp("tiny-org/absent", trunk, force=True)


def test_hub_repo_converts_from_the_cache(tiny_folders, tmp_path, monkeypatch):
    """A repo id as SRC: the snapshot comes from the (offline) cache, then converts."""
    from huggingface_hub import constants

    src = tiny_folders("mimo")[0]
    files = {p.name: p for p in src.iterdir() if p.is_file()}
    cache = _fake_hub_cache(tmp_path / "hf", "tiny-org/mimo", files)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    out = convert("tiny-org/mimo", tmp_path / "out")
    local = convert(src, tmp_path / "local")
    np.testing.assert_array_equal(
        np.array(mtp_logits(mlx_mtp.load_model(local), TOKENS)),
        np.array(mtp_logits(mlx_mtp.load_model(out), TOKENS)),
    )
    with pytest.raises(MTPError, match="tiny-org/absent"):
        convert("tiny-org/absent", tmp_path / "never")
    assert not (tmp_path / "never").exists()


def test_head_from_a_gguf(tiny_folders, tmp_path):
    """--mtp-only with a GGUF holding blk.N.nextn.*: the same head as from HF."""
    import tiny_plain
    from mlx.utils import tree_flatten
    from mlx_mtp.convert.model import head_tensors

    full = convert(tiny_folders("glm4_moe")[0], tmp_path / "full")
    model = mlx_mtp.load_model(full)
    weights = dict(tree_flatten(model.target.model.parameters()))
    weights.update(head_tensors("model.layers.2.", model.head))
    config = dict(tiny.CONFIGS["glm4_moe"], model_type="glm4_moe")
    gguf_path = tiny_plain.write_gguf(tmp_path / "glm.gguf", "glm4moe", config, weights)
    trunk = convert(tiny_folders("glm4_moe")[1], tmp_path / "trunk")
    add_mtp(gguf_path, trunk)
    a = np.array(mtp_logits(model, TOKENS))
    b = np.array(mtp_logits(mlx_mtp.load_model(trunk), TOKENS))
    np.testing.assert_allclose(a, b, atol=1e-2 * np.abs(a).max())  # GGUF matrices are F16
