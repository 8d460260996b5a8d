"""What the CLI says about its own settings: no counts of drafts that cannot
exist, no silently ignored flag."""

from mlx_mtp.cli import app
from typer.testing import CliRunner


def run(*args, input=None):
    result = CliRunner().invoke(app, [str(a) for a in args], input=input)
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


# newcomer fixes (issue 42)


def test_a_run_that_drafts_nothing_says_so_and_why(tiny_folders, monkeypatch):
    """Where drafts cannot pay (MLX's reference BLAS, as on Linux), the stats
    say why nothing was drafted instead of counting zeros; --fixed-draft
    drafts anyway, and the notice that drafts cannot pay is not printed."""
    monkeypatch.setattr("mlx_mtp.config.compute_bound", lambda: True)
    model = tiny_folders("mimo")[0]
    r = run("generate", "-m", model, "-p", "the quick brown fox", "-n", 6)
    assert "no drafts this run (drafts cannot pay on this machine)" in r.stderr
    assert "0 generated" not in r.stderr and "= ()" not in r.stderr
    assert r.stderr.count("notice: ") == 1
    fixed = run("generate", "-m", model, "-p", "the quick brown fox", "-n", 6,
                "--fixed-draft")  # fmt: skip
    assert "notice" not in fixed.stderr
    assert "draft acceptance" in fixed.stderr and "no drafts" not in fixed.stderr
    chat = run("chat", "-m", model, "-n", 3, "--fixed-draft", input="hi\n")
    assert "notice" not in chat.stderr


def test_no_drafts_says_why_from_python_too():
    from mlx_mtp.stats import MTPStats

    stats = MTPStats(draft_max=2, generation_tokens=3, rounds=3)
    assert stats.summary().startswith(
        "no drafts this run (none was expected to pay, or the draft source had none)"
    )
    assert stats.summary("why not").startswith("no drafts this run (why not)\n")
    assert "drafts" not in MTPStats(generation_tokens=3, rounds=3).summary()


def test_piped_chat_ends_on_a_newline_and_marks_a_cut_answer(tiny_folders):
    model = tiny_folders("mimo")[0]
    r = run("chat", "-m", model, "-n", 4, input="hello\n/stats\n")
    assert r.stdout.endswith("\n") and not r.stdout.rstrip().endswith(">>>")
    assert r.stdout.count(">>> ") == 2  # each line echoed after its prompt
    assert "[cut at 4 tokens]" in r.stderr
    g = run("generate", "-m", model, "-p", "the quick brown fox", "-n", 4)
    assert "[cut at 4 tokens]" in g.stderr
