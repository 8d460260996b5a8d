"""`mlx-mtp bench` on a busy machine says its figures do not hold, and which."""

from mlx_mtp.cli import app
from typer.testing import CliRunner

from mlx_mtp import bench
from mlx_mtp.bench import BASELINE, NO_MTP, BenchResult, ConfigResult, Measurement


def _row(name, k, ratio):
    return ConfigResult(
        name, k, 10.0 * ratio, ratio, 100.0, 64, None, 1.0, [], 1.0, 0.1, True
    )


def _result(speeds, verify=(1.0, 1.2)):
    """``speeds[config]``: per repeat, the tok/s on each of two prompts
    (mlx-lm runs at 10 tok/s throughout)."""
    runs = []
    for config, per_repeat in {BASELINE: [[10, 10]] * 3, **speeds}.items():
        for rep, per_prompt in enumerate(per_repeat):
            for prompt, tps in enumerate(per_prompt):
                runs.append(
                    Measurement(config, prompt, rep, [1], 4, 100.0, tps, 0.1)
                )
    configs = [_row(BASELINE, None, 1.0)] + [
        _row(name, 0 if name == NO_MTP else 1, sum(v[0]) / 20) for name, v in speeds.items()
    ]
    costs = {"verify": list(verify), "draft": [0.1], "step_seconds": 0.01}
    return BenchResult({}, [], 3, 64, configs=configs, runs=runs, costs=costs)


def test_a_steady_run_has_no_warning():
    steady = {NO_MTP: [[10, 10.2], [9.9, 10], [10.1, 9.9]], "k=1": [[12, 13]] * 3}
    assert bench.noise(_result(steady), {}) == []


def test_repeats_that_disagree_name_their_rows():
    speeds = {NO_MTP: [[10, 10]] * 3, "k=1": [[12, 13], [7, 8], [12, 13]]}
    found = bench.noise(_result(speeds), {})
    assert len(found) == 1 and "k=1" in found[0] and NO_MTP not in found[0]


def test_no_mtp_off_mlx_lm_speed_and_a_cheap_verify_are_flagged():
    speeds = {NO_MTP: [[7, 7]] * 3}
    found = bench.noise(_result(speeds, verify=(0.47, 0.9)), {})
    assert any("0.70x" in f for f in found)
    assert any("0.47" in f for f in found)


def test_the_cli_prints_one_warning_line(monkeypatch, tiny_folders):
    speeds = {NO_MTP: [[7, 7]] * 3}
    result = _result(speeds, verify=(0.47, 0.9))
    result.regime = {
        "backend": "cpu", "device": "cpu", "weights": "float32", "blas": "x",
        "cpus": 2, "mlx": "0", "mlx_lm": "0", "model_type": "llama",
        "mtp_head": False, "hidden_tap": "post",
    }  # fmt: skip
    result.noise = bench.noise(result, {})
    monkeypatch.setattr(bench, "run_bench", lambda *a, **k: result)
    out = CliRunner().invoke(app, ["bench", "-m", str(tiny_folders("mimo")[0])])
    assert out.exit_code == 0, out.output
    warnings = [line for line in out.stdout.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "too busy" in warnings[0] and "0.70x" in warnings[0]
    assert "took " in out.stdout
