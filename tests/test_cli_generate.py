"""`mlx-mtp generate` end to end, and bad input: one line, exit 1, no traceback."""

import json
import shutil
import subprocess
import sys
import tempfile

import pytest


def cli(*args, stdin=None):
    return subprocess.run(
        [sys.executable, "-m", "mlx_mtp", *map(str, args)],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
        # not the checkout: its mlx_mtp/ would shadow the installed package
        cwd=tempfile.gettempdir(),
    )


def assert_one_line_error(result, needle):
    assert result.returncode == 1, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ") and needle in lines[0]
    assert "Traceback" not in result.stderr


def test_generate_streams_text_and_stats(tiny_folders):
    full, _ = tiny_folders("mimo")
    # --fixed-draft: drafts on any machine (where they cannot pay, the stats
    # would say "no drafts this run")
    r = cli("generate", "--model", full, "-p", "hello", "-n", "12", "--fixed-draft")
    assert r.returncode == 0, r.stderr
    assert "draft acceptance" in r.stderr and "mean acceptance length" in r.stderr
    assert "peak memory" in r.stderr and "tok/s" in r.stderr


def test_generate_json_reads_stdin(tiny_folders):
    full, _ = tiny_folders("mimo")
    r = cli("generate", "--model", full, "--prompt", "-", "-n", "9", "--json", stdin="hi")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert len(out["tokens"]) == 9 and out["stats"]["generation_tokens"] == 9
    plain = json.loads(
        cli("generate", "-m", full, "-p", "hi", "-n", "9", "--json", "--no-mtp").stdout
    )
    assert plain["tokens"] == out["tokens"] and plain["stats"]["drafted"] == 0


def test_no_config(tmp_path):
    (tmp_path / "empty").mkdir()
    assert_one_line_error(cli("generate", "-m", tmp_path / "empty", "-p", "x"), "no config.json")


def test_missing_folder(tmp_path):
    nope = cli("generate", "-m", tmp_path / "nope", "-p", "x")
    assert_one_line_error(nope, "no such file or folder")


def test_truncated_safetensors(tiny_folders, tmp_path):
    full, _ = tiny_folders("mimo")
    bad = tmp_path / "truncated"
    shutil.copytree(full, bad)
    data = (full / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) // 2])
    assert_one_line_error(cli("generate", "-m", bad, "-p", "x"), "model.safetensors")


@pytest.mark.parametrize("model_type", ["not_a_model"])
def test_unknown_model_type(tiny_folders, tmp_path, model_type):
    full, _ = tiny_folders("mimo")
    bad = tmp_path / "unknown"
    shutil.copytree(full, bad)
    config = json.loads((bad / "config.json").read_text())
    config["model_type"] = model_type
    (bad / "config.json").write_text(json.dumps(config))
    assert_one_line_error(cli("generate", "-m", bad, "-p", "x"), "unknown model_type")


def test_bad_hidden_tap(tiny_folders):
    full, _ = tiny_folders("mimo")
    assert_one_line_error(cli("generate", "-m", full, "-p", "x", "--hidden-tap", "mid"), "--hidden-tap")
