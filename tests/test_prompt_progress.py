"""Reading a long prompt says how far it has got, on stderr, in generate, chat
and bench: a bar on a terminal (test_cli_terminal), plain lines elsewhere.

``--truncate-prompt`` on a 60 k-token prompt printed nothing for minutes when
stderr was not a terminal.
"""

import re

import pytest
from mlx_mtp.cli import app, progress
from mlx_mtp.cli.progress import PromptProgress
from typer.testing import CliRunner

LINE = re.compile(r"reading the prompt: (\d+)/(\d+) tokens, \d+ s")
DONE = re.compile(r"reading the prompt: all (\d+) tokens in \d+ s")


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_plain_lines_every_few_seconds_and_none_for_a_quick_prompt(capsys):
    clock = Clock()
    shown = PromptProgress(terminal=False, clock=clock)
    for done, seconds in [(0, 0), (2048, 2), (4096, 6), (6144, 8), (8192, 12)]:
        clock.now = seconds
        shown(done, 9000)
    clock.now = 13
    shown(9000, 9000)
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "reading the prompt: 4096/9000 tokens, 6 s",
        "reading the prompt: 8192/9000 tokens, 12 s",
        "reading the prompt: all 9000 tokens in 13 s",
    ]
    for done, seconds in [(0, 13), (2048, 14), (3000, 15)]:  # the next prompt
        clock.now = seconds
        shown(done, 3000)
    assert capsys.readouterr().err == ""


@pytest.fixture
def every_chunk(monkeypatch):
    """A line at each chunk of 2048 tokens, however fast this machine reads."""
    monkeypatch.setattr(progress, "LINE_EVERY", 0.0)


def lines(err):
    return [tuple(map(int, m)) for m in LINE.findall(err)], DONE.findall(err)


def test_generate_with_a_truncated_long_prompt(tiny_folders, every_chunk):
    args = ["generate", "-m", str(tiny_folders("mimo")[0]), "-p", "x" * 6000]
    result = CliRunner().invoke(app, args + ["-n", "2", "--truncate-prompt"])
    assert result.exit_code == 0, result.output
    read, done = lines(result.stderr)
    assert [d for d, _ in read] == [2048] and len(done) == 1
    assert "dropped the oldest" in result.stderr


def test_chat_and_bench_show_it_too(tiny_folders, tmp_path, every_chunk):
    model = str(tiny_folders("mimo")[0])
    chat = CliRunner().invoke(
        app, ["chat", "-m", model, "-n", "2"], input="y" * 2200 + "\n"
    )
    assert chat.exit_code == 0, chat.output
    read, done = lines(chat.stderr)
    assert [d for d, _ in read] == [2048] and len(done) == 1
    assert "reading the prompt" not in chat.stdout

    prompts = tmp_path / "long.txt"
    prompts.write_text("z" * 2200 + "\n")
    args = ["bench", "-m", model, "--prompts", str(prompts), "-r", "1"]
    bench = CliRunner().invoke(app, args + ["-n", "18", "--draft-max", "1", "--json"])
    assert bench.exit_code == 0, bench.output
    read, done = lines(bench.stderr)
    # every reading of it: the 6 configurations' warm-up and timed runs, the
    # plain run and the cost timer's context
    assert len(done) == 2 * 6 + 2 and len(read) >= len(done)
    assert "benchmarking: repeat 1/1, prompt 1/1, mlx-lm, reading the prompt: " in (
        bench.stderr
    )
