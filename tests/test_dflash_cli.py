"""``--draft FOLDER`` reaches the API in every command that generates
(``generate``, ``chat``, ``bench``, ``tune``, ``serve``); ``info`` describes a
drafter folder and ``convert`` writes one, quantized or in bfloat16."""

import json
import re

import mlx.core as mx
import numpy as np
import pytest
import tiny
import tiny_dflash as td
from test_cli_serve import Served
from typer.testing import CliRunner

import mlx_mtp
from mlx_mtp.cli import app
from mlx_mtp.cli.app import run_app


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("dflash-cli")
    target = td.build_target(root / "target", "qwen3", 6)
    drafter = td.build_drafter(root / "dflash", [1, 4], 6, agreeable=True)
    return target, drafter


def invoke(*args, input=None):
    result = CliRunner().invoke(app, [str(a) for a in args], input=input)
    assert result.exit_code == 0, result.output
    return result


def generate(target, *args):
    out = invoke(
        "generate", "-m", target, "-p", "hello there", "-n", 24, "--json", *args
    )
    return json.loads(out.stdout)


def test_generate_drafts_with_the_drafter(pair):
    target, drafter = pair
    # (on a model this small the drafter costs about a plain step: the cost
    # model would not draft at all, so the rounds draft a fixed count)
    bare = generate(target, "--fixed-draft", "--draft-max", 3)
    drafted = generate(target, "--draft", drafter, "--fixed-draft", "--draft-max", 3)
    alone = generate(
        target, "--draft", drafter, "--draft-source", "dflash", "--fixed-draft",
        "--draft-max", 3,
    )  # fmt: skip
    assert "dflash" not in bare["stats"]["by_source"]  # (lookup may draft)
    assert drafted["stats"]["by_source"]["dflash"]["drafted"] > 0
    assert set(alone["stats"]["by_source"]) == {"dflash"}
    assert alone["stats"]["accepted"] > 0
    assert bare["tokens"] == drafted["tokens"] == alone["tokens"]
    # without --draft-max a block drafter drafts up to its block
    fixed = generate(target, "--draft", drafter, "--fixed-draft")
    assert len(fixed["stats"]["per_position_acceptance"]) == 7


def test_chat_drafts_with_the_drafter(pair):
    target, drafter = pair
    args = ["-m", target, "--draft", drafter, "-n", 16, "--fixed-draft"]
    out = invoke("chat", *args, input="hi\n").output
    accepted, drafted = map(int, re.search(r"accepted (\d+)/(\d+)", out).groups())
    assert 0 < accepted <= drafted


def test_bench_shows_drafter_rows(pair, tmp_path):
    target, drafter = pair
    prompts = tmp_path / "one.txt"
    prompts.write_text("tell me a story\n")
    args = ["--json", "-r", 1, "--prompts", prompts, "-n", 18, "--draft-max", 2]
    out = json.loads(invoke("bench", "-m", target, "--draft", drafter, *args).stdout)
    configs = {c["config"]: c for c in out["configs"]}
    assert list(configs) == [
        "mlx-lm", "no-mtp", "dflash k=1", "dflash k=2", "dflash auto", "ngram", "auto"
    ]  # fmt: skip
    assert configs["dflash k=2"]["acceptance_rate"] > 0
    assert all(c["same_output"] for c in configs.values())
    assert out["regime"]["drafters"] == ["dflash"]


def test_tune_measures_the_drafter(pair):
    target, drafter = pair
    args = ["--no-store", "--json", "-n", 8, "-r", 1, "--draft-max", 2]
    entry = json.loads(invoke("tune", "-m", target, "--draft", drafter, *args).stdout)
    assert len(entry["costs"]["drafters"]["dflash"]) == 2
    assert len(entry["drafters_acceptance"]["dflash"]) == 2
    shown = invoke("tune", "-m", target, "--draft", drafter, *args[:1], *args[2:])
    assert "drafter dflash" in shown.stdout


def test_serve_drafts_with_the_drafter(pair):
    target, drafter = pair
    args = ["--draft", str(drafter), "--fixed-draft", "--draft-max", "3"]
    with Served("--model", str(target), *args) as s:
        r = s.complete(max_tokens=16, temperature=0)
        assert r["usage"]["mtp"]["accepted"] > 0
        sources = s.get("/health")["acceptance_by_source"]
        assert sources["dflash"]["drafted"] > 0


def test_a_bad_drafter_is_one_line(pair, tmp_path, capsys):
    target, _ = pair
    for bad, says in [
        (tmp_path / "missing", "no such file or folder"),
        (td.build_drafter(tmp_path / "wide", [1, 9], 6), "past the model's 6 layers"),
    ]:
        code = run_app(["generate", "-m", str(target), "-p", "hi", "--draft", str(bad)])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 1 and len(err) == 1 and says in err[0], err
    code = run_app(
        ["generate", "-m", str(target), "-p", "hi", "--draft-source", "dflash"]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and "no such drafter attached" in err[-1]


def test_info_describes_a_drafter_folder(pair):
    _, drafter = pair
    out = invoke("info", drafter).stdout
    assert "DFlashDraftModel (a DFlash block drafter (z-lab))" in out
    assert "block size    8 (7 drafts)" in out
    assert "layers 1, 4 of a 6-layer target" in out
    info = json.loads(invoke("info", drafter, "--json").stdout)
    assert info["drafter"]["target_layer_ids"] == [1, 4]
    assert info["format"] == "drafter folder"


@pytest.mark.parametrize(
    "flags, label",
    [
        (["-q"], "4-bit/g64"),
        (["-q", "--q-bits", "8"], "8-bit/g64"),
        (["--dtype", "bfloat16"], "bfloat16"),
    ],
)
def test_convert_writes_a_drafter(pair, tmp_path, flags, label):
    target, drafter = pair
    out = tmp_path / "converted"
    invoke("convert", drafter, out, *flags)
    info = json.loads(invoke("info", out, "--json").stdout)
    assert label in info["trunk_precision"] and info["drafter"]["block_size"] == 8
    model = mlx_mtp.load_model(target, draft=out)
    tokens = tiny.random_prompt(12, seed=1)
    got = np.array(mlx_mtp.draft_logits(model, tokens).astype(mx.float32))
    want = np.array(
        mlx_mtp.draft_logits(mlx_mtp.load_model(target, draft=drafter), tokens)
    )
    # the same drafter, at a coarser grid
    assert np.corrcoef(got.ravel(), want.ravel())[0, 1] > 0.95


def test_convert_refuses_other_drafter_bits(pair, tmp_path, capsys):
    _, drafter = pair
    code = run_app(
        ["convert", str(drafter), str(tmp_path / "o"), "-q", "--q-bits", "3"]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and err == ["error: a drafter quantizes to 4 or 8 bits, not 3"]


def test_convert_takes_a_drafter_repo_id(pair, tmp_path, monkeypatch):
    """``mlx-mtp convert ORG/DRAFTER OUT -q``: the repo is fetched, then seen to
    be a drafter (not a model needing a tokenizer)."""
    import mlx_mtp.convert.pipeline as pipeline

    _, drafter = pair
    fetched = []
    monkeypatch.setattr(
        pipeline, "resolve", lambda repo: fetched.append(repo) or drafter
    )
    out = tmp_path / "converted"
    invoke("convert", "z-lab/some-dflash-drafter", out, "-q")
    assert fetched == ["z-lab/some-dflash-drafter"]
    info = json.loads(invoke("info", out, "--json").stdout)
    assert "4-bit/g64" in info["trunk_precision"] and info["format"] == "drafter folder"
