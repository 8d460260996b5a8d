"""Every flag of `generate`, `chat` and `bench` reaches the API: one effect per flag.

(mlx-lm PR #1297 parsed new flags and never forwarded them.) Runs go through
typer's runner in-process; `generate --json` and `bench --json` are read as
JSON, `chat` through its footer and `/stats` lines.
"""

import json
import re
import shutil

import mlx.core as mx
import pytest
from mlx_mtp.cli import app
from typer.testing import CliRunner


@pytest.fixture(scope="module")
def folders(tiny_folders):
    return tiny_folders("mimo")


@pytest.fixture(scope="module")
def skewed(folders, tmp_path_factory):
    """The tiny model with an uneven final norm: the pre- and post-norm taps differ."""
    path = tmp_path_factory.mktemp("skewed") / "mimo"
    shutil.copytree(folders[0], path)
    weights = mx.load(str(path / "model.safetensors"))
    mx.random.seed(1)
    shape = weights["model.norm.weight"].shape
    weights["model.norm.weight"] = mx.exp(2 * mx.random.normal(shape))
    mx.save_safetensors(str(path / "model.safetensors"), weights, {"format": "pt"})
    return path


def invoke(*args, input=None, env=None):
    result = CliRunner().invoke(app, [str(a) for a in args], input=input, env=env)
    assert result.exit_code == 0, result.output
    return result


def generate(*args, prompt="the quick brown fox jumps", model=None, input=None):
    result = invoke("generate", "-m", model, "-p", prompt, "--json", *args, input=input)
    return json.loads(result.stdout)


# -- generate ---------------------------------------------------------------


def test_generate_max_tokens(folders):
    assert len(generate("-n", 7, model=folders[0])["tokens"]) == 7
    assert (
        generate("--max-tokens", 13, model=folders[0])["stats"]["generation_tokens"]
        == 13
    )


def test_generate_draft_max(folders):
    for k in (1, 2):
        stats = generate(
            "-n", 40, "--draft-max", k, "--draft-source", "mtp", model=folders[0]
        )["stats"]  # fmt: skip
        assert len(stats["per_position_acceptance"]) <= k and stats["drafted"] > 0
        assert stats["mean_accepted_length"] <= k + 1


def test_generate_no_mtp_and_draft_p_min(folders):
    plain = generate("-n", 20, "--no-mtp", model=folders[0])
    cut = generate("-n", 20, "--draft-p-min", 1.0, "--draft-source", "mtp", model=folders[0])
    spec = generate("-n", 20, model=folders[0])
    assert plain["stats"]["drafted"] == 0 and plain["stats"]["rounds"] == 20
    assert cut["stats"]["drafted"] == 0
    assert spec["stats"]["drafted"] > 0
    assert plain["tokens"] == cut["tokens"] == spec["tokens"]


def test_generate_system_and_no_chat_template(folders):
    templated = generate("-n", 2, prompt="hi", model=folders[0])["stats"][
        "prompt_tokens"
    ]
    raw = generate("-n", 2, "--no-chat-template", prompt="hi", model=folders[0])
    system = generate("-n", 2, "--system", "be brief", prompt="hi", model=folders[0])
    assert raw["stats"]["prompt_tokens"] == 2  # "hi", bytes
    assert templated > 2
    # the system turn: "<|im_start|>system\nbe brief<|im_end|>\n"
    assert system["stats"]["prompt_tokens"] == templated + len("system\nbe brief\n") + 2


def test_generate_prompt_from_stdin(folders):
    out = generate(
        "-n", 3, "--no-chat-template", prompt="-", model=folders[0], input="hey"
    )
    assert out["stats"]["prompt_tokens"] == 3


def test_generate_mtp_attaches_a_head(folders):
    full, trunk_only = folders
    bare = generate("-n", 20, model=trunk_only)
    headed = generate("-n", 20, "--mtp", full / "model.safetensors", model=trunk_only)
    assert bare["stats"]["drafted"] == 0 and headed["stats"]["drafted"] > 0
    assert bare["tokens"] == headed["tokens"]


def test_an_explicit_head_without_mtp_tensors_is_an_error(folders, capsys):
    from mlx_mtp.cli.app import run_app

    full, trunk_only = folders
    not_a_head = trunk_only / "model.safetensors"
    for command in (["generate", "-p", "hi"], ["bench"]):
        code = run_app([*command, "-m", str(full), "--mtp", str(not_a_head)])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 1 and len(err) == 1, err
        assert err[0] == (
            f"error: --mtp {not_a_head}: no MTP tensors of a mimo head in it "
            "(their names start model.mtp_layers.0.)"
        )


def test_generate_hidden_tap(skewed):
    args = ("-n", 64, "--draft-max", 1, "--fixed-draft")
    post = generate(*args, "--hidden-tap", "post", model=skewed)
    pre = generate(*args, "--hidden-tap", "pre", model=skewed)
    assert post["tokens"] == pre["tokens"]
    assert post["stats"]["accepted"] != pre["stats"]["accepted"]


# -- chat -------------------------------------------------------------------

FOOTER = re.compile(
    r"(\d+) tokens, [\d.]+ tok/s \| prompt (\d+)(?:, \d+ tok/s)? \| "
    r"accepted (\d+)/(\d+), ([\d.]+)/pass"
)


def chat(*args, script="hello\n/stats\n", model, env=None):
    """Returns (output, footers as (tokens, prompt, accepted, drafted, mean length))."""
    out = invoke("chat", "-m", model, *args, input=script, env=env).output
    footers = [
        (int(a), int(b), int(c), int(d), float(e))
        for a, b, c, d, e in FOOTER.findall(out)
    ]
    return out, footers


def per_position(out):
    return re.search(r"acceptance rate per position = \(([^)]*)\)", out).group(1)


def test_chat_max_tokens_and_draft_max(folders):
    out, [(tokens, _, _, drafted, mean)] = chat(
        "-n", 30, "--draft-max", 1, "--draft-source", "mtp", model=folders[0]
    )
    assert tokens == 30 and drafted > 0 and mean <= 2
    assert len(per_position(out).split(",")) == 1
    out, _ = chat("-n", 30, "--draft-max", 3, "--fixed-draft", model=folders[0])
    assert len(per_position(out).split(",")) > 1


def test_chat_no_mtp_and_draft_p_min(folders):
    for flag in (["--no-mtp"], ["--draft-p-min", 1.0, "--draft-source", "mtp"]):
        _, [(tokens, _, accepted, drafted, mean)] = chat(
            "-n", 12, *flag, model=folders[0]
        )
        assert tokens == 12 and drafted == accepted == 0 and mean == 1.0


def test_chat_system(folders):
    _, [(_, plain, *_)] = chat("-n", 2, model=folders[0])
    _, [(_, system, *_)] = chat("-n", 2, "--system", "be brief", model=folders[0])
    assert system == plain + len("system\nbe brief\n") + 2


def test_chat_mtp_and_hidden_tap(folders, skewed):
    full, trunk_only = folders
    _, [bare] = chat("-n", 20, model=trunk_only)
    _, [headed] = chat("-n", 20, "--mtp", full / "model.safetensors", model=trunk_only)
    assert bare[3] == 0 and headed[3] > 0
    script = "the quick brown fox jumps\n"
    args = ("-n", 64, "--draft-max", 1, "--fixed-draft")
    _, [post] = chat(*args, "--hidden-tap", "post", script=script, model=skewed)
    _, [pre] = chat(*args, "--hidden-tap", "pre", script=script, model=skewed)
    assert post[2] != pre[2]


def answers(out):
    """The answers' text, between the input prompt and the footer (and the
    mark of an answer cut short)."""
    cut = r"(?:\[cut at \d+ tokens\]\n)?"
    return re.findall(r">>> [^\n]*\n(.*?)\n" + cut + r"(?=\d+ tokens, )", out, re.S)


def test_chat_piped_reads_as_a_transcript_with_its_stats_on_stderr(folders):
    """Piped input was not echoed (``>>> answer``), the footers went to stdout
    (generate writes its stats to stderr), and the shell's prompt landed on
    the last ``>>>`` line (now the end of the input leaves no prompt)."""
    result = invoke("chat", "-m", folders[0], "-n", 6, input="hello\nagain\n")
    lines = result.stdout.split("\n")
    assert lines[1] == ">>> hello" and ">>> again" in lines[3:]
    assert result.stdout.endswith("\n") and lines[-2] != ">>> "
    assert not FOOTER.search(result.stdout)
    assert len(FOOTER.findall(result.stderr)) == 2


@pytest.fixture(scope="module")
def greedy_answer(folders):
    out, _ = chat("-n", 16, model=folders[0])
    return answers(out)[0]


@pytest.mark.parametrize(
    "flags",
    [["--top-k", 1], ["--min-p", 1.0], ["--top-p", 0.001]],
    ids=["top-k", "min-p", "top-p"],
)
def test_chat_filters_that_leave_the_top_token(folders, greedy_answer, flags):
    """At temperature 1 each of these keeps only the top token: greedy again."""
    sampled, _ = chat("-n", 16, "--temp", 1.0, "--seed", 5, model=folders[0])
    filtered, _ = chat("-n", 16, "--temp", 1.0, "--seed", 5, *flags, model=folders[0])
    assert answers(sampled)[0] != greedy_answer
    assert answers(filtered)[0] == greedy_answer


def test_chat_temp_and_seed(folders):
    runs = [
        chat("-n", 16, "--temp", 1.0, "--seed", s, model=folders[0])[0]
        for s in (1, 1, 2)
    ]
    assert answers(runs[0]) == answers(runs[1]) != answers(runs[2])


@pytest.mark.parametrize(
    "flag", ["--repetition-penalty", "--presence-penalty", "--frequency-penalty"]
)
def test_chat_penalties(folders, flag):
    greedy, _ = chat("-n", 40, model=folders[0])  # falls into a loop: repeated tokens
    out, _ = chat("-n", 40, flag, 5.0, model=folders[0])
    assert answers(out)[0] != answers(greedy)[0]


def test_chat_logit_bias(folders):
    biased = answers(chat("-n", 8, "--logit-bias", "65=1000", model=folders[0])[0])[0]
    other = answers(chat("-n", 8, "--logit-bias", "66=1000", model=folders[0])[0])[0]
    assert len(biased) == len(other) == 8  # one byte-level token repeated
    assert len(set(biased)) == len(set(other)) == 1 and biased != other


def test_chat_draft_sampling_and_fixed_draft(folders):
    args = ("-n", 40, "--temp", 1.0, "--seed", 0)
    _, [greedy_drafts] = chat(*args, model=folders[0])
    _, [sampled_drafts] = chat(*args, "--draft-sampling", "sample", model=folders[0])
    _, [fixed] = chat(*args, "--fixed-draft", model=folders[0])
    assert sampled_drafts[2:4] != greedy_drafts[2:4]  # (accepted, drafted)
    assert fixed[2:4] != greedy_drafts[2:4]


def test_chat_show_drafts(folders):
    green = "\x1b[32m"
    env = {"FORCE_COLOR": "1", "TERM": "xterm-256color"}
    plain, _ = chat("-n", 30, "--fixed-draft", model=folders[0], env=env)
    shown, [(_, _, accepted, _, _)] = chat(
        "-n", 30, "--fixed-draft", "--show-drafts", model=folders[0], env=env
    )
    assert accepted > 0
    assert green not in plain
    assert green in shown.split(">>> ", 1)[1]  # in the answer, not just the legend


# -- bench ------------------------------------------------------------------


def bench(*args, model):
    out = invoke("bench", "-m", model, "--json", "-r", 1, *args).stdout
    return {c["config"]: c for c in json.loads(out)["configs"]}, json.loads(out)


@pytest.fixture(scope="module")
def one_prompt(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "one.txt"
    path.write_text("tell me a story\n")
    return path


def test_bench_draft_max_and_max_tokens(folders, one_prompt):
    configs, _ = bench(
        "--prompts", one_prompt, "-n", 18, "--draft-max", 2, model=folders[0]
    )
    assert list(configs) == [
        "mlx-lm", "no-mtp", "mtp k=1", "mtp k=2", "mtp auto", "ngram", "auto"
    ]  # fmt: skip
    assert all(c["tokens"] == 18 for c in configs.values())
    assert len(configs["mtp k=2"]["per_position_acceptance"]) <= 2


def test_bench_repeats_and_prompts(folders, one_prompt):
    _, out = bench(
        "--prompts", one_prompt, "-n", 18, "--draft-max", 1, model=folders[0]
    )
    assert [p["prompt"] for p in out["prompts"]] == ["tell me a story"]
    assert len(out["runs"]) == 6  # one per configuration
    out = json.loads(
        invoke(
            "bench",
            "-m",
            folders[0],
            "--json",
            "--prompts",
            one_prompt,
            "-n",
            18,
            "--draft-max",
            1,
            "--repeats",
            2,
        ).stdout
    )
    assert len(out["runs"]) == 2 * 6


def test_bench_draft_p_min(folders, one_prompt):
    configs, _ = bench(
        "--prompts",
        one_prompt,
        "-n",
        18,
        "--draft-max",
        2,
        "--draft-p-min",
        1.0,
        model=folders[0],
    )
    assert configs["mtp k=2"]["acceptance_rate"] == 0.0
    assert configs["mtp k=2"]["forwards_per_token"] == 1.0


def test_bench_mtp_and_hidden_tap(folders, one_prompt):
    full, trunk_only = folders
    _, bare = bench(
        "--prompts", one_prompt, "-n", 18, "--draft-max", 1, model=trunk_only
    )
    _, headed = bench(
        "--prompts",
        one_prompt,
        "-n",
        18,
        "--draft-max",
        1,
        "--mtp",
        full / "model.safetensors",
        "--hidden-tap",
        "pre",
        model=trunk_only,
    )
    assert not bare["regime"]["mtp_head"] and headed["regime"]["mtp_head"]
    assert (
        bare["regime"]["hidden_tap"] == "post"
        and headed["regime"]["hidden_tap"] == "pre"
    )


def test_chat_without_model_uses_the_default(folders, monkeypatch):
    import mlx_mtp.convert.default_model as default_model

    notices = []

    def default(notify):
        notify("building the default model")
        notices.append(True)
        return folders[0]

    monkeypatch.setattr(default_model, "default_model_path", default)
    result = invoke("chat", "-n", 3, input="hi\n")
    assert notices and FOOTER.search(result.output)


def one_line_error(capsys, *args):
    from mlx_mtp.cli.app import run_app

    code = run_app([str(a) for a in args])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def test_user_errors_are_one_line(folders, tmp_path, capsys):
    plain = tmp_path / "no-template"
    shutil.copytree(folders[0], plain)
    (plain / "chat_template.jinja").unlink()
    assert "no chat template" in one_line_error(capsys, "chat", "-m", plain)
    for command in ("chat", "bench"):
        err = one_line_error(capsys, command, "-m", folders[0], "--hidden-tap", "mid")
        assert "--hidden-tap must be one of post, pre" in err
    absent = one_line_error(capsys, "bench", "-m", tmp_path / "absent")
    assert "no such file or folder" in absent
