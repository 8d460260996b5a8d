"""`mlx-mtp bench`: every configuration measured in one run, its fields complete."""

import json
import statistics

import pytest
from mlx_mtp.cli import app
from mlx_mtp.cli.app import run_app
from mlx_mtp.cli.bench import first_positions
from typer.testing import CliRunner

from mlx_mtp.bench import AUTO, BASELINE, NO_MTP
from mlx_mtp.errors import MTPError
from mlx_mtp.prompts import load_prompts

FIELDS = {
    "config",
    "draft_max",
    "generation_tps",
    "ratio",
    "prompt_tps",
    "tokens",
    "acceptance_rate",
    "mean_accepted_length",
    "per_position_acceptance",
    "forwards_per_token",
    "peak_memory_gb",
    "same_output",
    "by_kind",
    "adaptive",
    "bound",
    "cpu_ratio",
    "cpu_bound",
    "source",
}


def bench_json(*args):
    result = CliRunner().invoke(app, ["bench", *map(str, args), "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_bench_json_fields_and_paired_ratios(tiny_folders, tmp_path):
    prompts = tmp_path / "p.json"
    kinds = ["prose", "code"]
    prompts.write_text(
        json.dumps(
            [
                {"kind": "prose", "prompt": "write a poem"},
                {"kind": "code", "prompt": "sort a list in python"},
            ]
        )
    )
    out = bench_json(
        "--model",
        tiny_folders("mimo")[0],
        "--prompts",
        prompts,
        "-n",
        18,
        "--repeats",
        2,
        "--draft-max",
        2,
    )
    assert out["regime"]["backend"] == "cpu" and out["regime"]["weights"] == "float32"
    assert "BLAS" in out["regime"]["blas"]
    configs = {c["config"]: c for c in out["configs"]}
    assert list(configs) == [BASELINE, NO_MTP, "mtp k=1", "mtp k=2", AUTO, "ngram", "auto"]
    assert all(set(c) == FIELDS for c in configs.values())
    runs = out["runs"]
    assert len(runs) == 2 * 2 * 7  # repeats x prompts x configurations
    base = {
        (r["prompt"], r["repeat"]): r["generation_tps"]
        for r in runs
        if r["config"] == BASELINE
    }
    for name, c in configs.items():
        mine = [r for r in runs if r["config"] == name]
        paired = [r["generation_tps"] / base[r["prompt"], r["repeat"]] for r in mine]
        assert c["ratio"] == pytest.approx(statistics.median(paired))
        for i, kind in enumerate(kinds):  # one prompt per kind here
            of_kind = [p for r, p in zip(mine, paired) if r["prompt"] == i]
            ratio = c["by_kind"][kind]["ratio"]
            assert ratio == pytest.approx(statistics.median(of_kind))
        assert c["generation_tps"] == pytest.approx(
            statistics.median(r["generation_tps"] for r in mine)
        )
        assert c["same_output"]  # greedy: every configuration emits mlx-lm's tokens
        assert c["peak_memory_gb"] > 0 and c["prompt_tps"] > 0
    assert configs[BASELINE]["ratio"] == 1.0
    assert configs[NO_MTP]["acceptance_rate"] is None
    assert configs[NO_MTP]["forwards_per_token"] == 1.0
    for k in (1, 2):
        c = configs[f"mtp k={k}"]
        assert 0 < c["acceptance_rate"] < 1
        assert 1 < c["mean_accepted_length"] <= k + 1
        assert len(c["per_position_acceptance"]) == k
        assert c["forwards_per_token"] == pytest.approx(1 / c["mean_accepted_length"])
        costs = out["costs"]
        parts = costs["verify"][k] + costs["draft"][k - 1]
        assert c["bound"] == pytest.approx(c["mean_accepted_length"] / parts)
    assert configs[AUTO]["adaptive"] and configs[AUTO]["draft_max"] == 2
    assert len(out["costs"]["verify"]) == 3 and len(out["costs"]["round"]) == 3


def test_bench_table(tiny_folders, tmp_path):
    prompts = tmp_path / "p.json"
    prompts.write_text(
        json.dumps(
            [{"kind": "code", "prompt": "def f(x):"}, {"kind": "chat", "prompt": "hi"}]
        )
    )
    result = CliRunner().invoke(
        app,
        [
            "bench",
            "--model",
            str(tiny_folders("mimo")[0]),
            "--prompts",
            str(prompts),
            "-n",
            "18",
            "-r",
            "1",
            "--draft-max",
            "1",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "regime: backend cpu" in result.stdout and "weights float32" in result.stdout
    for name in (
        "mlx-lm",
        "no-mtp",
        "mtp k=1",
        "vs mlx-lm",
        "per position",
        "fwd/tok",
        "by prompt kind",
    ):
        assert name in result.stdout


def test_table_shows_the_first_depths_only():
    # lookup drafts reach 8 depths: the column stays narrow, --json has them all
    assert first_positions([]) == "-"
    assert first_positions([0.5, 0.25]) == "0.50, 0.25"
    assert first_positions([0.5] * 8) == "0.50, 0.50, 0.50, 0.50, ..."


def test_shipped_prompts_cover_the_kinds():
    kinds = {p.kind for p in load_prompts()}
    assert {"code", "prose", "chat"} <= kinds


@pytest.mark.parametrize(
    "content, suffix, needle",
    [
        ("", ".txt", "no prompts"),
        ("{", ".json", "not valid JSON"),
        ('[{"text": 1}]', ".json", "each prompt"),
        ("{}", ".json", "non-empty list"),
    ],
)
def test_bad_prompt_files(tmp_path, content, suffix, needle):
    path = tmp_path / f"p{suffix}"
    path.write_text(content)
    with pytest.raises(MTPError, match=needle):
        load_prompts(path)


def test_missing_prompt_file_is_one_line(tiny_folders, tmp_path, capsys):
    missing = tmp_path / "nope.json"
    code = run_app(
        ["bench", "--model", str(tiny_folders("mimo")[0]), "--prompts", str(missing)]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and err == [
        f"error: {missing}: cannot read prompts (FileNotFoundError)"
    ]


@pytest.mark.parametrize("draft_max, least", [(None, 18), (12, 26)])
def test_too_few_tokens_to_time_are_refused_before_any_run(
    tiny_folders, monkeypatch, capsys, draft_max, least
):
    """-n 1 timed nothing after the first round: every row read 0.0 tok/s and
    the noise warning blamed the machine."""
    import mlx_mtp.bench as bench

    def never(*args, **kwargs):
        raise AssertionError("the benchmark ran")

    monkeypatch.setattr(bench, "run_once", never)
    args = ["bench", "-m", str(tiny_folders("mimo")[0]), "-n", str(least - 1)]
    if draft_max is not None:
        args += ["--draft-max", str(draft_max)]
    code = run_app(args)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1, err
    assert err[0].startswith(f"error: {least - 1} tokens per generation are too few")
    assert f"ask for {least} or more (bench -n)" in err[0]
    with pytest.raises(MTPError, match="too few to time"):
        bench.run_bench(None, None, [], 3, max_tokens=1)


def test_the_token_floor_is_shown_and_checked_before_the_model_loads(
    monkeypatch, capsys
):
    """--help said x>=1 for -n while 17 tokens and fewer were refused, and only
    once the model had loaded."""
    from mlx_mtp.cli import options

    def never(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(options, "load_model", never)
    for args, least in ((["-n", "17"], 18), (["-n", "25", "--draft-max", "12"], 26)):
        assert run_app(["bench", "-m", "/no/such/model", *args]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ")
        assert f"ask for {least} or more (bench -n)" in err[0]
    assert run_app(["bench", "--help"]) == 0
    rows = [line.strip("│ ") for line in capsys.readouterr().out.splitlines()]
    help_text = " ".join(" ".join(rows).split())
    assert "at least 18, or 2 x (--draft-max + 1) past --draft-max 8" in help_text
    row = help_text[help_text.index("--max-tokens") : help_text.index("--repeats")]
    assert "x>=1" not in row


def test_bench_shows_progress_from_the_start_and_ctrl_c_keeps_the_rows(
    tiny_folders, tmp_path
):
    """Off a terminal: the plan before the warm-up, a line per timed run; SIGINT
    after the first row prints the rows so far, "interrupted", and exits 130."""
    import re
    import signal
    import subprocess
    import sys
    import tempfile

    prompts = tmp_path / "p.txt"
    prompts.write_text("tell me a story\n")
    args = ["bench", "-m", tiny_folders("mimo")[0], "--prompts", prompts]
    args += ["-n", 18, "-r", 200, "--draft-max", 1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlx_mtp", *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tempfile.gettempdir(),
    )
    try:
        seen = []
        for line in proc.stderr:
            seen.append(line)
            if "mlx-lm: done (" in line:  # the first timed run: mlx-lm's row is in
                break
        proc.send_signal(signal.SIGINT)
        out, rest = proc.communicate(timeout=120)
    finally:
        proc.kill()
    err = "".join(seen) + rest
    start = "bench: 6 configurations x 1 prompts x 200 repeats x 18 tokens; warming up"
    planned = re.search(r"about \d+(\.\d)? (s|min) at the warm-up's speed", err)
    assert start in err and planned and err.index(start) < planned.start(), err
    assert "benchmarking: repeat 1/200, prompt 1/1, mlx-lm: done (" in err
    assert proc.returncode == 130, err
    rows = r"interrupted: \d+ of 1200 timed runs measured, the rows above"
    assert re.search(rows, err)
    assert "Traceback" not in err
    assert "mlx-lm" in out and "1 prompts (" in out  # the table, with its first row
