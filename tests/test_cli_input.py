"""What a newcomer types: bad text, an empty prompt, too many drafts, a 1-token
prompt, Ctrl-C, and the notice on a machine where MTP cannot gain."""

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from test_cli_generate import assert_one_line_error, cli

import mlx_mtp
from mlx_mtp.errors import MTPError

OPENBLAS = Path("/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3")


@pytest.fixture(scope="module")
def full(tiny_folders):
    return tiny_folders("mimo")[0]


def test_invalid_utf8_on_stdin_is_one_line_before_loading(tmp_path):
    bad = b"caf\xe9 au lait"  # latin-1, not UTF-8
    r = subprocess.run(
        [sys.executable, "-m", "mlx_mtp", "generate", "-m", tmp_path / "absent"]
        + ["-p", "-"],
        input=bad,
        capture_output=True,
        timeout=120,
        cwd=tempfile.gettempdir(),
    )
    result = subprocess.CompletedProcess(
        r.args, r.returncode, r.stdout.decode(), r.stderr.decode()
    )
    # the model path is wrong too: the text was checked before any loading
    assert_one_line_error(result, "stdin is not UTF-8 text (byte 0xe9 at offset 3)")


def test_empty_prompt_is_refused(full):
    for prompt, stdin in (("", None), ("  \n", None), ("-", "")):
        r = cli("generate", "-m", full, "-p", prompt, stdin=stdin)
        assert_one_line_error(r, "the prompt is empty")
    model, tokenizer = mlx_mtp.load(full)
    with pytest.raises(MTPError, match="empty"):
        next(mlx_mtp.stream_generate(model, tokenizer, ""))


def test_draft_max_beyond_what_a_head_can_use(full):
    from mlx_mtp.defaults import MAX_DRAFT_MAX

    r = cli("generate", "-m", full, "-p", "hi", "--draft-max", 64)
    assert r.returncode == 2 and f"less than or equal to {MAX_DRAFT_MAX}" in r.stderr
    r = cli("generate", "-m", full, "-p", "hi", "-n", 4, "--draft-max", MAX_DRAFT_MAX)
    assert r.returncode == 0, r.stderr
    model, tokenizer = mlx_mtp.load(full)
    with pytest.raises(MTPError, match=f"draft_max must be 0 to {MAX_DRAFT_MAX}"):
        next(mlx_mtp.stream_generate(model, tokenizer, "hi", draft_max=64))


def test_no_prompt_speed_for_a_one_token_prompt(full):
    r = cli("generate", "-m", full, "-p", "x", "--no-chat-template", "-n", 4)
    assert r.returncode == 0, r.stderr
    assert "prompt: 1 token | generation: 4 tokens" in r.stderr
    r = cli("generate", "-m", full, "-p", "xy", "--no-chat-template", "-n", 4)
    assert "prompt: 2 tokens, " in r.stderr


def test_ctrl_c_ends_the_line_and_prints_the_stats_so_far(full):
    child = subprocess.Popen(
        [sys.executable, "-m", "mlx_mtp", "generate", "-m", str(full), "-p", "hi"]
        + ["-n", "100000", "--max-tokens", "100000"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=tempfile.gettempdir(),
    )
    try:
        child.stdout.read(50)  # it is generating
        child.send_signal(signal.SIGINT)
        out, err = child.communicate(timeout=60)
    finally:
        child.kill()
    err = err.decode()
    assert child.returncode == 130, err
    assert out.endswith(b"\n")
    assert "generation: " in err and "Traceback" not in err
    assert err.strip().splitlines()[-1] == "interrupted"


@pytest.mark.slow
def test_notice_where_mtp_cannot_gain(full, tmp_path):
    # asked in a fresh process: the tests pin this process's regime (conftest)
    code = "from mlx_mtp.config import cannot_gain_notice; print(cannot_gain_notice())"
    asked = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert asked.returncode == 0, asked.stderr
    expected = asked.stdout.strip()
    expected = None if expected == "None" else expected
    r = cli("generate", "-m", full, "-p", "hi", "-n", 4)
    if expected is None:  # a GPU, Accelerate or a preloaded BLAS
        assert "notice" not in r.stderr
        return
    assert r.stderr.count(f"notice: {expected}") == 1
    assert "notice" not in cli("generate", "-m", full, "-p", "hi", "--no-mtp").stderr
    chat = cli("chat", "-m", full, "-n", 4, stdin="hi\n")
    assert chat.returncode == 0 and chat.stderr.count("notice: ") == 1
    if not OPENBLAS.exists():
        return
    env = dict(os.environ, LD_PRELOAD=str(OPENBLAS))
    r = subprocess.run(
        [sys.executable, "-m", "mlx_mtp", "generate", "-m", full, "-p", "hi"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tempfile.gettempdir(),
    )
    assert r.returncode == 0 and "notice" not in r.stderr, r.stderr


def test_no_link_leaves_the_repository():
    """README and docs link only files in the repository; nothing names the
    team's private notes."""
    import re

    root = Path(__file__).parent.parent
    docs = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    for doc in docs:
        for target in re.findall(r"\]\(([^)#\s]+)", doc.read_text()):
            if "://" not in target:
                assert (doc.parent / target).exists(), (doc, target)
    private = "MEASURE" + ".md"  # the team's measuring notes, not in the repository
    folders = ("mlx_mtp", "cli", "convert", "scripts", "docs", "tests")
    files = [root / "README.md", *(f for d in folders for f in (root / d).rglob("*"))]
    for path in files:
        if path.suffix in (".py", ".md", ".json", ".toml"):
            assert private not in path.read_text(errors="ignore"), path


def test_json_keeps_its_shape(full):
    r = cli("generate", "-m", full, "-p", "hi", "-n", 3, "--json")
    out = json.loads(r.stdout)
    assert out["finish_reason"] == "length" and len(out["tokens"]) == 3


@pytest.mark.parametrize(
    "flags, needle",
    [
        # a bias id at or past the vocabulary (288) wrote past the logits: rc 139
        (["--logit-bias", "288=1"], "--logit-bias keys must be token ids below 288"),
        (["--logit-bias", "99999999=1"], "token ids below 288 (the vocabulary)"),
        (["--logit-bias=-1=1"], "--logit-bias keys must be token ids"),  # was taken
        # NaN and infinities were taken (or called out of range)
        (["--presence-penalty", "nan"], "--presence-penalty must be a finite number"),
        (["--frequency-penalty", "nan"], "--frequency-penalty must be a finite number"),
        (["--logit-bias", "5=nan"], "--logit-bias token 5's bias must be a finite"),
        (["--temp", "inf"], "--temp must be a finite number, got inf"),
        (["--temp", "nan"], "--temp must be a finite number, got nan"),
    ],
)
def test_bad_sampling_values_are_one_line(full, flags, needle):
    r = cli("generate", "-m", full, "-p", "hi", "-n", 2, *flags)
    if "below 288" not in needle:
        return assert_one_line_error(r, needle)  # refused before loading
    # found with the model's vocabulary: after its loading's own lines
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("error: ")
    assert needle in r.stderr.strip().splitlines()[-1]


def test_bad_sampling_values_in_the_python_api(full):
    model, tokenizer = mlx_mtp.load(full)
    cases = [
        (dict(logit_bias={288: 1.0}), "logit_bias keys must be token ids below 288"),
        (dict(logit_bias={-1: 1.0}), "logit_bias keys must be token ids"),
        (dict(logit_bias={5: float("nan")}), "token 5's bias must be a finite"),
        (dict(temp=float("inf")), "temp must be a finite number, got inf"),
        (dict(presence_penalty=float("nan")), "presence_penalty must be a finite"),
    ]
    for kwargs, needle in cases:
        with pytest.raises(ValueError, match=needle):
            mlx_mtp.generate(model, tokenizer, "hi", max_tokens=2, **kwargs)
        with pytest.raises(MTPError, match=needle):
            mlx_mtp.batch_generate(model, tokenizer, ["hi"], max_tokens=2, **kwargs)
# -- files that are not what their names say ----------------------------------


@pytest.fixture(scope="module")
def small_gguf(tmp_path_factory):
    import tiny_plain

    config, weights = tiny_plain.plain_weights("llama")
    path = tmp_path_factory.mktemp("gguf") / "m.gguf"
    return tiny_plain.write_gguf(path, "llama", config, weights)


def test_a_text_file_named_gguf_is_not_called_a_gguf(tmp_path, small_gguf):
    fake = tmp_path / "notgguf.gguf"
    fake.write_text("just some notes\n")
    for command in (["generate", "-m", fake, "-p", "hi"], ["convert", fake, "out"]):
        r = cli(*command)
        assert_one_line_error(
            r, f"{fake}: not a GGUF file (it does not start with GGUF's magic)"
        )
        assert "convert it first" not in r.stderr
    # a real GGUF, whatever its name, is one to convert first
    renamed = tmp_path / "model.bin"
    renamed.write_bytes(small_gguf.read_bytes())
    r = cli("generate", "-m", renamed, "-p", "hi")
    assert_one_line_error(r, f"{renamed} is a GGUF file: convert it first")


def test_convert_into_an_existing_file_says_it_is_a_file(tmp_path, small_gguf):
    target = tmp_path / "afile"
    target.write_text("keep me")
    for extra in ([], ["--force"]):
        r = cli("convert", small_gguf, target, *extra)
        assert_one_line_error(r, f"{target} is a file, not a folder")
        assert "holds files" not in r.stderr
    assert target.read_text() == "keep me"


def test_a_gguf_cut_inside_its_header_says_so(tmp_path, small_gguf):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(small_gguf.read_bytes()[:200])
    for command in (["convert", cut, tmp_path / "out"], ["info", cut]):
        r = cli(*command)
        assert_one_line_error(r, f"{cut}: cut short inside its header (200 bytes)")
        assert "buffer" not in r.stderr
    assert not (tmp_path / "out").exists()


def test_a_model_without_chat_template_is_said_once(full, tmp_path):
    import shutil

    base = tmp_path / "base"
    shutil.copytree(full, base)
    (base / "chat_template.jinja").unlink()
    said = f"{base} has no chat template: the prompt is sent as it is"
    r = cli("generate", "-m", base, "-p", "hi", "-n", 2)
    assert r.returncode == 0, r.stderr
    assert r.stderr.splitlines().count(said) == 1, r.stderr
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('"hi"\n"there"\n"again"\n')
    r = cli("generate", "-m", base, "--prompts", prompts, "-n", 2)
    assert r.returncode == 0, r.stderr
    assert r.stderr.splitlines().count(said) == 1, r.stderr  # not per prompt
    for args in (["-m", base, "--no-chat-template"], ["-m", full]):
        r = cli("generate", *args, "-p", "hi", "-n", 2)
        assert r.returncode == 0 and "no chat template" not in r.stderr, r.stderr
    # chat cannot hold turns without one: it says so, in one line
    r = cli("chat", "-m", base, stdin="hi\n")
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    # (the line before it, if any, is transformers' warning about the tiny model)
    assert r.stderr.splitlines()[-1].startswith(
        f"error: {base} has no chat template: chat needs one"
    )
