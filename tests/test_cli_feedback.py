"""What the CLI says about its own settings: no counts of drafts that cannot
exist, no silently ignored flag."""

from mlx_mtp.cli import app
from typer.testing import CliRunner


def run(*args):
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    return result


def test_no_mtp_prints_no_draft_counts(tiny_folders):
    model = tiny_folders("mimo")[0]
    plain = run("generate", "-m", model, "-p", "the quick brown fox", "-n", 6, "--no-mtp")
    assert "draft acceptance" not in plain.stderr
    assert "generation: 6 tokens" in plain.stderr
    spec = run("generate", "-m", model, "-p", "the quick brown fox", "-n", 6)
    assert "draft acceptance" in spec.stderr


def test_seed_at_temperature_zero_says_it_does_nothing(tiny_folders):
    model = tiny_folders("mimo")[0]
    greedy = run("generate", "-m", model, "-p", "abc", "-n", 2, "--seed", 3)
    assert "notice: --seed has no effect at --temp 0" in greedy.stderr
    sampled = run("generate", "-m", model, "-p", "abc", "-n", 2, "--seed", 3, "--temp", 0.7)
    assert "--seed has no effect" not in sampled.stderr
