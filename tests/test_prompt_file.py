"""Prompt caches on disk: ``cache-prompt`` writes a prompt's cache (trunk,
head, drafters) in mlx-lm's format; ``generate`` and ``chat
--prompt-cache-file`` continue from it with the output of reading the whole
prompt; a damaged or foreign file is one line, and writes are atomic."""

import json
import re

import mlx.core as mx
import mlx_lm
import pytest
import tiny
import tiny_hybrid
from mlx_lm.models.cache import QuantizedKVCache, load_prompt_cache
from mlx_mtp.cli.app import run_app

import mlx_mtp
from mlx_mtp import prompt_file
from mlx_mtp.chat import ChatSession
from mlx_mtp.errors import MTPError
from mlx_mtp.kv import KVSettings

DOC = "The quick brown fox jumps over the lazy dog. " * 8
QUESTION = " What did the fox do?"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("prompt-file")
    wide = {"num_attention_heads": 2, "head_dim": 32}
    return {
        "glm4_moe": tiny.build_folder(root / "glm", "glm4_moe", **wide)[0],
        "qwen3_next": tiny_hybrid.build_folder(root / "q3n", "qwen3_next", head_dim=32)[
            0
        ],
        "other": tiny.build_folder(root / "other", "glm4_moe", seed=1, **wide)[0],
    }


@pytest.fixture
def cli(capsys):
    def go(*args):
        code = run_app([str(a) for a in args])
        out = capsys.readouterr()
        return code, out.out, out.err

    return go


def one_line(result, needle):
    code, _, err = result
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 1 and needle in lines[0], err


def test_generate_continues_with_the_whole_prompts_output(folders, cli, tmp_path):
    folder, file = folders["glm4_moe"], tmp_path / "doc.safetensors"
    code, _, err = cli(
        "cache-prompt", "-m", folder, "-p", DOC, "--prompt-cache-file", file
    )
    assert code == 0 and "cached" in err, err
    args = ["generate", "-m", folder, "-n", 24, "--json", "--draft-max", 2]
    code, out, err = cli(*args, "-p", DOC + QUESTION)
    assert code == 0, err
    whole = json.loads(out)
    code, out, err = cli(*args, "-p", QUESTION, "--prompt-cache-file", file)
    assert code == 0, err
    resumed = json.loads(out)
    assert resumed["tokens"] == whole["tokens"]
    # only the rest of the prompt is read: the time to the first token shows it
    assert resumed["stats"]["prompt_tokens"] < whole["stats"]["prompt_tokens"] / 4
    assert resumed["stats"]["drafted"] > 0


@pytest.mark.parametrize("family", ["glm4_moe", "qwen3_next"])
@pytest.mark.parametrize("bits", [None, 8])
def test_the_api_round_trip(folders, tmp_path, family, bits):
    model, tokenizer = mlx_mtp.load(folders[family])
    kv = KVSettings(bits, 32, 0)
    file = tmp_path / "c.safetensors"
    n = mlx_mtp.cache_prompt(model, tokenizer, DOC, file, kv=kv)
    cached = prompt_file.load(file, model)
    assert len(cached.tokens) == n and cached.cache.offset == n
    todo, have, cache = prompt_file.continue_from(cached, model, tokenizer, QUESTION)
    mine = dict(draft_max=2, adaptive_draft=False, kv_bits=bits, kv_group_size=32,
                quantized_kv_start=0)  # fmt: skip
    got = mlx_mtp.generate(model, tokenizer, todo, max_tokens=24, prompt_cache=cache,
                           cached_tokens=have, **mine)  # fmt: skip
    assert got == mlx_mtp.generate(model, tokenizer, have + todo, max_tokens=24, **mine)
    # mlx-lm reads the file: the trunk's caches first, in its own classes
    caches, meta = load_prompt_cache(str(file), return_metadata=True)
    if bits:
        assert isinstance(caches[-2], QuantizedKVCache) and caches[-2].bits == 8
    assert meta["model"] == str(folders[family])


def test_the_head_goes_on_where_it_stood(folders, tmp_path):
    model, tokenizer = mlx_mtp.load(folders["glm4_moe"])
    file = tmp_path / "c.safetensors"
    mlx_mtp.cache_prompt(model, tokenizer, DOC, file)
    cached = prompt_file.load(file, model)
    state = cached.cache.drafts["mtp"]
    assert state.follows(state.caches, cached.cache.offset)
    assert state.pending[0].size == 1 and state.start[0] == 0


def test_chat_starts_from_the_file(folders, tmp_path):
    model, tokenizer = mlx_mtp.load(folders["glm4_moe"])
    file = tmp_path / "c.safetensors"
    mlx_mtp.cache_prompt(model, tokenizer, DOC, file)
    cached = prompt_file.load(file, model)
    resumed = ChatSession(model, tokenizer, max_tokens=16)
    resumed.resume(cached.cache, cached.tokens, cached.prompt)
    fresh = ChatSession(model, tokenizer, max_tokens=16)
    a = "".join(r.text for r in resumed.send(QUESTION))
    assert a == "".join(r.text for r in fresh.send(DOC + QUESTION))
    assert resumed.last.reused_tokens >= len(cached.tokens) - 1


def test_a_file_of_another_model_is_one_line(folders, cli, tmp_path):
    file = tmp_path / "c.safetensors"
    assert cli("cache-prompt", "-m", folders["other"], "-p", DOC,
               "--prompt-cache-file", file)[0] == 0  # fmt: skip
    one_line(
        cli(
            "generate",
            "-m",
            folders["glm4_moe"],
            "-p",
            "x",
            "--prompt-cache-file",
            file,
        ),
        "a prompt cache of another model",
    )


def test_damaged_and_foreign_files_are_one_line(folders, cli, tmp_path):
    good = tmp_path / "good.safetensors"
    model, tokenizer = mlx_mtp.load(folders["glm4_moe"])
    mlx_mtp.cache_prompt(model, tokenizer, DOC, good)
    data = good.read_bytes()
    cases = {
        "truncated": (data[: len(data) // 2], "truncated"),
        "garbage": (b"\x00" * 64, "not a valid safetensors file"),
    }
    mx.save_safetensors(str(tmp_path / "w.safetensors"), {"a": mx.zeros(3)})
    cases["weights"] = ((tmp_path / "w.safetensors").read_bytes(), "not a prompt cache")
    reference = mlx_lm.load(str(folders["glm4_moe"]))[0]
    lm = mlx_lm.models.cache.make_prompt_cache(reference)
    reference(mx.array([[1, 2, 3]]), cache=lm)
    mlx_lm.models.cache.save_prompt_cache(str(tmp_path / "lm.safetensors"), lm)
    cases["mlx-lm"] = ((tmp_path / "lm.safetensors").read_bytes(), "mlx-lm wrote")
    for name, (content, needle) in cases.items():
        bad = tmp_path / f"{name}.safetensors"
        bad.write_bytes(content)
        one_line(
            cli(
                "generate",
                "-m",
                tmp_path / "nope",
                "-p",
                "x",
                "--prompt-cache-file",
                bad,
            ),
            needle,  # before the model loads (the folder does not exist)
        )
    one_line(
        cli("generate", "-m", folders["glm4_moe"], "-p", "x", "--prompt-cache-file",
            tmp_path / "missing.safetensors"),
        "no such prompt cache file",
    )  # fmt: skip
    eight = tmp_path / "eight.safetensors"
    mlx_mtp.cache_prompt(model, tokenizer, DOC, eight, kv=KVSettings(8, 32, 0))
    one_line(
        cli("generate", "-m", folders["glm4_moe"], "-p", "x", "--kv-bits", 4,
            "--kv-group-size", 32, "--prompt-cache-file", eight),
        "holds 8-bit keys and values",
    )  # fmt: skip


def test_writes_are_atomic_and_spare_other_files(folders, tmp_path, monkeypatch):
    model, tokenizer = mlx_mtp.load(folders["glm4_moe"])
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    with pytest.raises(MTPError, match="not a prompt cache: not overwritten"):
        mlx_mtp.cache_prompt(model, tokenizer, DOC, notes)
    assert notes.read_text() == "mine"
    file = tmp_path / "c.safetensors"
    mlx_mtp.cache_prompt(model, tokenizer, DOC, file)
    before = file.read_bytes()

    def fails(path, *a, **k):
        open(path, "wb").write(b"half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(prompt_file, "save_prompt_cache", fails)
    with pytest.raises(MTPError, match="No space left"):
        mlx_mtp.cache_prompt(model, tokenizer, DOC + "more", file)
    assert file.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.safetensors", "notes.txt"]


def _damage_in_place(path, size=4096):
    """Change ``size`` bytes in the middle of the arrays; size and header kept."""
    raw = bytearray(path.read_bytes())
    data = 8 + int.from_bytes(raw[:8], "little")
    at = data + (len(raw) - data - size) // 2
    raw[at : at + size] = bytes((b + 1) % 256 for b in raw[at : at + size])
    path.write_bytes(bytes(raw))


def test_a_file_damaged_in_place_is_refused_and_kept(folders, cli, tmp_path):
    folder, file = folders["glm4_moe"], tmp_path / "doc.safetensors"
    assert cli("cache-prompt", "-m", folder, "-p", DOC,
               "--prompt-cache-file", file)[0] == 0  # fmt: skip
    model, _ = mlx_mtp.load(folder)
    prompt_file.load(file, model)  # whole, it reads
    _damage_in_place(file)
    damaged = file.read_bytes()
    prompt_file.check(file)  # its header is intact: only the checksum tells
    with pytest.raises(prompt_file.Damaged, match="checksum does not match"):
        prompt_file.load(file, model)
    args = ["generate", "-m", folder, "-n", 8, "-p", QUESTION]
    one_line(cli(*args, "--prompt-cache-file", file), "checksum does not match")
    assert file.read_bytes() == damaged  # a user's file: refused, never removed
    # made again, it serves the whole prompt's answer (a cold read's)
    assert cli("cache-prompt", "-m", folder, "-p", DOC,
               "--prompt-cache-file", file)[0] == 0  # fmt: skip
    code, resumed, err = cli(*args, "--prompt-cache-file", file, "--json")
    assert code == 0, err
    code, whole, err = cli(*args[:-1], DOC + QUESTION, "--json")
    assert json.loads(resumed)["tokens"] == json.loads(whole)["tokens"]


def test_a_file_without_a_checksum_is_one_line(folders, cli, tmp_path):
    """An older version's file cannot be verified: refused before loading."""
    file = tmp_path / "old.safetensors"
    assert cli("cache-prompt", "-m", folders["glm4_moe"], "-p", DOC,
               "--prompt-cache-file", file)[0] == 0  # fmt: skip
    raw = file.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = re.sub(rb'"0\.mlx_mtp\.checksum":"[^"]*",?', b"", raw[8 : 8 + n])
    file.write_bytes(raw[:8] + header.ljust(n) + raw[8 + n :])
    result = cli("generate", "-m", folders["glm4_moe"], "-p", "x",
                 "--prompt-cache-file", file)  # fmt: skip
    one_line(result, "written by an older version of mlx-mtp")
    assert "make it again" in result[2] and file.exists()


def test_the_checksum_covers_what_mlx_lm_reads(folders, tmp_path):
    """mlx-lm still reads the file, and its checksum is its own bytes'."""
    model, tokenizer = mlx_mtp.load(folders["glm4_moe"])
    file = tmp_path / "c.safetensors"
    mlx_mtp.cache_prompt(model, tokenizer, DOC, file)
    _, meta = load_prompt_cache(str(file), return_metadata=True)
    assert meta["mlx_mtp"]["checksum"].startswith("sha256:")
    with open(file, "rb") as f:
        prompt_file.verify(f, file)
    raw = bytearray(file.read_bytes())
    raw[-1] ^= 1  # the very last byte
    file.write_bytes(bytes(raw))
    with open(file, "rb") as f, pytest.raises(prompt_file.Damaged):
        prompt_file.verify(f, file)
