"""The model's context length: a longer prompt is refused (or truncated when
asked), generation stops at its end, and a long prefill reports progress."""

import json
import shutil

import pytest
import tiny
from mlx_mtp.cli import app
from typer.testing import CliRunner

import mlx_mtp
from mlx_mtp.errors import MTPError
from mlx_mtp.generate import generate, stream_generate

CONTEXT = 64


@pytest.fixture(scope="module")
def short(tiny_folders, tmp_path_factory):
    """The tiny MTP model, its context cut to CONTEXT tokens."""
    path = tmp_path_factory.mktemp("short") / "mimo"
    shutil.copytree(tiny_folders("mimo")[0], path)
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = CONTEXT
    (path / "config.json").write_text(json.dumps(config))
    return path, mlx_mtp.load(path)


def test_a_prompt_longer_than_the_context_is_refused(short):
    _, (model, tokenizer) = short
    prompt = tiny.random_prompt(CONTEXT + 10)
    with pytest.raises(MTPError) as e:
        next(stream_generate(model, tokenizer, prompt, 8))
    assert f"{CONTEXT + 10} tokens" in str(e.value)
    assert f"context of {CONTEXT} tokens" in str(e.value)


def test_truncation_only_when_asked(short):
    _, (model, tokenizer) = short
    prompt = tiny.random_prompt(CONTEXT + 10)
    out = list(stream_generate(model, tokenizer, prompt, 8, truncate_prompt=True))
    # the prompt keeps its last CONTEXT - 8 tokens, so the answer fits
    kept = prompt[-(CONTEXT - 8) :]
    assert [r.token for r in out] == [
        r.token for r in stream_generate(model, tokenizer, kept, 8)
    ]
    assert out[-1].prompt_tokens == CONTEXT - 8


def test_generation_stops_at_the_end_of_the_context(short):
    _, (model, tokenizer) = short
    prompt = tiny.random_prompt(CONTEXT - 4)
    for k in (0, 3):
        out = list(stream_generate(model, tokenizer, prompt, 50, draft_max=k))
        # the last token is predicted at position CONTEXT - 1
        assert len(out) == 5 and out[-1].finish_reason == "length"
    exact = tiny.random_prompt(CONTEXT)
    assert len(list(stream_generate(model, tokenizer, exact, 50))) == 1


def test_a_chat_that_outgrows_the_context_says_so(short):
    path, _ = short
    script = "a" * 40 + "\n" + "b" * 40 + "\n/quit\n"
    result = CliRunner().invoke(app, ["chat", "-m", str(path), "-n", "4"], input=script)
    assert result.exit_code == 0, result.output
    assert f"context of {CONTEXT} tokens (/reset starts afresh)" in result.output


def test_generate_cli_refuses_or_truncates(short, capsys):
    from mlx_mtp.cli.app import run_app

    path, _ = short
    args = ["generate", "-m", str(path), "-p", "x" * 100, "--json", "-n", "4"]
    assert run_app(args) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "context of 64 tokens" in err[0], err
    assert run_app(args + ["--truncate-prompt"]) == 0
    io = capsys.readouterr()
    out = json.loads(io.out)
    assert len(out["tokens"]) == 4 and out["stats"]["prompt_tokens"] == CONTEXT - 4
    import re

    dropped, total = map(int, re.search(r"dropped the oldest (\d+) of (\d+)", io.err).groups())
    assert total - dropped == CONTEXT - 4  # the templated prompt, as it was cut


def test_prefill_progress(tiny_folders):
    model, tokenizer = mlx_mtp.load(tiny_folders("mimo")[0])
    prompt = tiny.random_prompt(300)
    seen = []
    kwargs = dict(prefill_step_size=64, prefill_progress=lambda *a: seen.append(a))
    text = generate(model, tokenizer, prompt, max_tokens=8, **kwargs)
    # before each chunk of the 299 tokens read before the first round, and at the end
    assert seen == [(0, 299), (64, 299), (128, 299), (192, 299), (256, 299), (299, 299)]
    assert text == generate(model, tokenizer, prompt, max_tokens=8)
