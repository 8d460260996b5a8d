"""mlx_mtp.config: the MTP config beside a head and the tuned entries in it."""

import json
from types import SimpleNamespace

import pytest

from mlx_mtp import config
from mlx_mtp.defaults import DEFAULT_DRAFT_MAX
from mlx_mtp.errors import MTPError

ENTRY = {
    "costs": {"verify": [1.1, 1.2], "draft": [0.1], "round": [1.0, 1.3]},
    "acceptance_by_depth": [0.7],
}


def headed(head_config, path=None):
    return SimpleNamespace(
        head=object(), head_config=head_config, path=path, head_dir=path, config={}
    )


def test_read_head_config(tmp_path):
    assert config.read_head_config(tmp_path) == {}
    (tmp_path / config.HEAD_CONFIG_FILE).write_text('{"family": "deepseek"}')
    assert config.read_head_config(tmp_path) == {"family": "deepseek"}
    (tmp_path / config.HEAD_CONFIG_FILE).write_text("[1, 2]")
    with pytest.raises(MTPError, match="not a valid MTP head config"):
        config.read_head_config(tmp_path)


def test_trained_values_are_read_only_when_well_formed():
    assert config.default_draft_max(headed({"recommended_draft_max": 2})) == 2
    for bad in (True, -1, "2", None):
        model = headed({"recommended_draft_max": bad})
        assert config.default_draft_max(model) == DEFAULT_DRAFT_MAX
    assert config.trained_acceptance(headed({"acceptance_by_depth": [1, 0.5]})) == [
        1.0,
        0.5,
    ]
    for bad in ([], [True], ["0.5"], 0.5):
        assert config.trained_acceptance(headed({"acceptance_by_depth": bad})) is None


def test_a_tuned_entry_counts_only_for_this_machine_and_when_whole(monkeypatch):
    monkeypatch.setattr(config, "weights_dtype", lambda model: "float32")
    here = {"machine": config.machine(), "model": {"weights": "float32"}}
    elsewhere = dict(here, machine=dict(here["machine"], device="another"))
    assert config.tuned_entry(headed({"tuned": [{**ENTRY, **elsewhere}]})) is None
    assert config.tuned_entry(headed({"tuned": [{**ENTRY, **here}]}))["costs"]
    for costs in ({"verify": [], "draft": [0.1]}, {"verify": ["x"], "draft": [1]}, []):
        broken = {**ENTRY, **here, "costs": costs}
        assert config.tuned_entry(headed({"tuned": [broken]})) is None


def test_store_tuned_replaces_the_entry_of_the_same_machine(tmp_path, monkeypatch):
    monkeypatch.setattr(config, "weights_dtype", lambda model: "float32")
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / config.HEAD_CONFIG_FILE).write_text('{"family": "deepseek"}')
    model = headed(config.read_head_config(tmp_path), tmp_path)
    key = {"machine": config.machine(), "model": config.model_identity(model)}
    config.store_tuned(model, {**ENTRY, **key})
    config.store_tuned(model, {**ENTRY, **key, "acceptance_by_depth": [0.9]})
    stored = json.loads((tmp_path / config.HEAD_CONFIG_FILE).read_text())
    assert stored["family"] == "deepseek" and len(stored["tuned"]) == 1
    assert config.tuned_entry(model)["acceptance_by_depth"] == [0.9]
    with pytest.raises(MTPError, match="nowhere to store"):
        config.store_tuned(headed({}), ENTRY)


def test_the_identity_lists_a_head_folder_of_its_own(tmp_path, monkeypatch):
    """A head beside the model in a folder of its own, with a file of the
    same name (a Gemma 4 assistant's ``model.safetensors``): both are listed,
    the same way in every process (the costs stored under it are found)."""
    model_dir, head_dir = tmp_path / "model", tmp_path / "model-assistant"
    for folder, size in ((model_dir, 300), (head_dir, 20)):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"0" * size)
        (folder / "config.json").write_text("{}")
    model = SimpleNamespace(
        head=object(), head_config={}, path=model_dir, head_dir=head_dir, config={}
    )
    monkeypatch.setattr(config, "weights_dtype", lambda model: "float32")
    identity = config.model_identity(model)
    assert identity["files"] == {
        "model.safetensors": 300,
        "model-assistant/model.safetensors": 20,
    }
    alone = SimpleNamespace(**{**vars(model), "head_dir": model_dir})
    assert config.model_identity(alone)["files"] == {"model.safetensors": 300}


def test_the_notice_follows_the_machine(monkeypatch):
    monkeypatch.setattr(config, "compute_bound", lambda: True)
    assert "cannot gain speed" in config.cannot_gain_notice()
    monkeypatch.setattr(config, "compute_bound", lambda: False)
    assert config.cannot_gain_notice() is None
