"""The KV cache flags (``--kv-bits``, ``--kv-group-size``,
``--quantized-kv-start``, ``--max-kv-size``) reach the caches of ``generate``,
``chat``, ``bench`` and ``serve``; a bad value is one line and exit 1."""

import json
from types import SimpleNamespace

import pytest
from mlx_mtp.cli.app import run_app
from mlx_mtp.kv import KVSettings
from test_cli_serve import Served


@pytest.fixture(scope="module")
def narrow(tiny_folders):
    """Heads 16 wide: no quantization group fits them."""
    return tiny_folders("mimo")[0]


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    import tiny

    root = tmp_path_factory.mktemp("cli-kv")
    return tiny.build_folder(root / "mimo", "mimo", num_attention_heads=2)[0]


@pytest.fixture
def run(capsys, monkeypatch):
    """``run(*args, input=...)``: the command's exit code, stdout and stderr."""

    def go(*args, input=None):
        if input is not None:
            monkeypatch.setattr("sys.stdin", __import__("io").StringIO(input))
        code = run_app([str(a) for a in args])
        out = capsys.readouterr()
        return SimpleNamespace(exit_code=code, stdout=out.out, output=out.err)

    return go


def one_line_error(result, needle):
    assert result.exit_code == 1, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], result.output


@pytest.fixture
def generate(run):
    def go(model, *args):
        return run("generate", "-m", model, "-p", "hello there", "-n", "12",
                   "--json", "--no-chat-template", *args)  # fmt: skip

    return go


def test_generate_takes_each_flag(generate, narrow, wide, monkeypatch):
    # --kv-bits and --kv-group-size reach the cache: these groups do not fit
    now = ("--quantized-kv-start", 0)
    one_line_error(
        generate(narrow, "--kv-bits", 8, *now),
        "16 wide, not a multiple of the group size 64",
    )
    one_line_error(
        generate(narrow, "--kv-bits", 4, "--kv-group-size", 32, *now),
        "16 wide, not a multiple of the group size 32",
    )
    # --quantized-kv-start reaches the request's settings
    seen = []
    check = KVSettings.check_model
    monkeypatch.setattr(
        KVSettings, "check_model", lambda kv, m: seen.append(kv) or check(kv, m)
    )
    late = generate(wide, "--kv-bits", 8, "--kv-group-size", 32,
                    "--quantized-kv-start", 1000)  # fmt: skip
    assert late.exit_code == 0, late.output
    assert seen[-1] == KVSettings(8, 32, 1000, None)
    full = generate(wide)
    quantized = generate(wide, "--kv-bits", 8, "--kv-group-size", 32,
                         "--quantized-kv-start", 0)  # fmt: skip
    assert quantized.exit_code == 0, quantized.output
    assert json.loads(quantized.stdout)["tokens"] == json.loads(full.stdout)["tokens"]
    bounded = generate(wide, "--max-kv-size", 8, "-n", 40)
    assert bounded.exit_code == 0, bounded.output


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--kv-bits", 7], "kv_bits must be one of"),
        (["--kv-bits", 8, "--kv-group-size", 48], "kv_group_size must be one of"),
        (["--max-kv-size", 3], "max_kv_size must be more than 4"),
        (["--kv-bits", 8, "--max-kv-size", 64], "choose one"),
    ],
)
def test_bad_values_are_one_line(generate, wide, flags, needle):
    one_line_error(generate(wide, *flags), needle)


def test_chat_and_bench_take_them(run, narrow):
    now = ("--kv-bits", 8, "--quantized-kv-start", 0)
    chat = run("chat", "-m", narrow, *now, input="hi\n")
    # the chat says so in one line and goes on
    assert "error: cannot quantize" in chat.stdout
    assert "the group size 64" in chat.stdout
    bench = run("bench", "-m", narrow, *now, "-n", 20, "-r", 1, "--json")
    assert bench.exit_code == 1 and "the group size 64" in bench.output


def test_bench_runs_mlx_lm_at_the_same_settings(run, wide, tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello there\n")
    r = run("bench", "-m", wide, "--prompts", prompts, "-n", 20, "-r", 1, "--json",
            "--draft-max", 1, "--kv-bits", 4, "--kv-group-size", 32)  # fmt: skip
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["regime"]["kv_cache"].startswith("4-bit keys and values")
    runs = {m["config"]: m["tokens"] for m in out["runs"]}
    assert runs["mlx-lm"] == runs["no-mtp"] == runs["mtp k=1"]


def test_serve_says_how_it_holds_caches(wide):
    args = ["--model", wide, "--kv-bits", "4", "--kv-group-size", "32"]
    with Served(*args, "--max-tokens", "6") as s:
        assert "KV cache: 4-bit keys and values" in s.log
        assert "turns quantized at token 5000" in s.log
        assert s.complete()["usage"]["completion_tokens"] == 6
        assert s.get("/health")["batched"]
    with Served("--model", wide, "--max-kv-size", "64") as s:
        assert "decoded one at a time" in s.log
        assert not s.get("/health")["batched"]
