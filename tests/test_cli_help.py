"""Help that answers at once and reads right, --version, bench without --model,
and the README's Python snippet."""

import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from mlx_mtp.cli import app
from mlx_mtp.cli.app import run_app
from typer.testing import CliRunner

README = Path(__file__).parent.parent / "README.md"
HEAVY = ("mlx_lm", "transformers", "torch")
# train-head's own module (not this help's) imports the trainer
LIGHT_COMMANDS = ("generate", "chat", "bench", "tune", "serve", "convert", "info")


def imported_by(*args):
    """The heavy modules a fresh process imports to run ``mlx-mtp ARGS``."""
    code = (
        "import sys\nfrom mlx_mtp.cli import run_app\n"
        f"code = run_app({list(args)!r})\n"
        f"print({HEAVY!r} and [m for m in sys.modules if m.split('.')[0] in {HEAVY!r}])"
    )
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tempfile.gettempdir(),
    )
    assert r.returncode == 0, r.stderr
    return r.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize(
    "args",
    [["--help"], ["--version"]] + [[c, "--help"] for c in LIGHT_COMMANDS],
)
def test_help_loads_neither_mlx_lm_nor_torch(args):
    # importing mlx-lm pulls in transformers and torch: seconds before any help
    assert imported_by(*args) == "[]"


def test_the_command_list_matches_the_commands():
    from mlx_mtp.cli.app import COMMANDS

    registered = {
        c.name or c.callback.__name__.replace("_", "-"): c.callback
        for c in app.registered_commands
    }
    assert set(registered) == set(COMMANDS)
    for name, (_, short) in COMMANDS.items():
        assert registered[name].__doc__.splitlines()[0] == short


def help_text(*args):
    result = CliRunner().invoke(app, [*args, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    return result.output


def row(text, flag):
    return next(line for line in text.splitlines() if f" {flag} " in line)


def test_help_shows_flags_as_flags_and_arguments_by_name():
    convert = help_text("convert")
    assert "Usage: mlx-mtp convert [OPTIONS] SRC [OUT]" in convert
    for flag in ("--force", "--quantize", "--dequantize", "--mtp-only"):
        assert "<bool>" not in row(convert, flag)
    assert "<bool>" not in help_text("generate")
    assert "Usage: mlx-mtp info [OPTIONS] [PATH]" in help_text("info")  # optional


def test_help_shows_choices_and_defaults():
    tap = row(help_text("generate"), "--hidden-tap")
    assert "post|pre" in tap and "default: (the head family's: post)" in tap
    dtype = row(help_text("convert"), "--dtype")
    assert "float16|bfloat16|float32" in dtype and "default: (the source's" in dtype
    assert "x<=16" in row(help_text("generate"), "--draft-max")


def test_version(capsys):
    from importlib import metadata

    assert run_app(["--version"]) == 0
    out = capsys.readouterr().out.strip()
    assert out == (
        f"mlx-mtp {metadata.version('mlx-mtp')} (mlx {metadata.version('mlx')}, "
        f"mlx-lm {metadata.version('mlx-lm')})"
    )


@pytest.fixture
def default_is_tiny(tiny_folders, monkeypatch):
    import mlx_mtp.convert.default_model as default_model

    folder = tiny_folders("mimo")[0]
    monkeypatch.setattr(default_model, "default_model_path", lambda notify=None: folder)
    return folder


def test_bench_without_model_uses_the_default_and_says_how_long(
    default_is_tiny, tmp_path
):
    prompts = tmp_path / "p.txt"
    prompts.write_text("tell me a story\nand another\n")
    args = ["bench", "--prompts", prompts, "-n", 18, "-r", 2, "--draft-max", 1]
    result = CliRunner().invoke(app, [str(a) for a in args] + ["--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["regime"]["mtp_head"]
    line = re.search(
        r"bench: 6 configurations x 2 prompts x 2 repeats x 18 tokens, about \d+ s",
        result.stderr,
    )
    assert line, result.stderr


def test_bench_alone_runs_the_defaults(default_is_tiny, monkeypatch):
    import mlx_mtp.bench as bench
    from mlx_mtp.bench import DEFAULT_BENCH_TOKENS, DEFAULT_REPEATS
    from mlx_mtp.prompts import load_prompts

    asked = {}

    def run_bench(model, tokenizer, prompts, draft_max, p_min, repeats, tokens, **kw):
        asked.update(prompts=len(prompts), repeats=repeats, tokens=tokens)
        raise KeyboardInterrupt  # the real run takes minutes

    monkeypatch.setattr(bench, "run_bench", run_bench)
    assert run_app(["bench"]) == 130  # not the help text
    assert asked == dict(
        prompts=len(load_prompts()),
        repeats=DEFAULT_REPEATS,
        tokens=DEFAULT_BENCH_TOKENS,
    )


def test_readme_snippet_applies_the_chat_template(default_is_tiny, capsys):
    import mlx_mtp

    snippet = re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)
    assert "apply_chat_template" in snippet
    exec(compile(snippet, "README.md", "exec"), {})
    out = capsys.readouterr().out
    model, tokenizer = mlx_mtp.load(default_is_tiny)
    messages = [{"role": "user", "content": "Write a haiku about the sea."}]
    prompt = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    expected = mlx_mtp.generate(model, tokenizer, prompt, max_tokens=64, draft_max=1)
    assert out.startswith(expected + "\n") and "mean acceptance length" in out
