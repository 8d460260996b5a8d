"""train-head on text: files, folders and the ready corpus, read teacher-forced,
mixed with chat at a set share; on a tiny random llama."""

import json
import re
from collections import Counter

import mlx.core as mx
import numpy as np
import pytest
import tiny
from mlx.utils import tree_flatten
from test_train_head import LLAMA, TEXT

from mlx_mtp.errors import MTPError
from mlx_mtp.training import Hooks, TrainConfig, train_head
from mlx_mtp.training.corpus import (
    DOC_TOKENS,
    Cleaner,
    corpus_documents,
    read_text,
    text_files,
)
from mlx_mtp.training.prompts import EVAL_PROMPTS
from mlx_mtp.training.run import DataConfig, RunConfig
from mlx_mtp.training.trainer import _order

CODE = "\n".join(
    f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n# the value of f{i} at 3\n"
    for i in range(60)
)


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    from mlx_lm.models import llama

    mx.random.seed(3)
    model = llama.Model(llama.ModelArgs.from_dict(LLAMA))
    weights = dict(tree_flatten(model.parameters()))
    return tiny.save_folder(tmp_path_factory.mktemp("llama") / "base", LLAMA, weights)


@pytest.fixture(scope="module")
def text_folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("text")
    (root / "code.py").write_text(CODE)
    (root / "notes").mkdir()
    (root / "notes" / "prose.md").write_text(TEXT * 4)
    (root / "blob.bin").write_bytes(b"\x00\x01" * 100)  # not a text suffix
    (root / ".hidden").mkdir()
    (root / ".hidden" / "secret.txt").write_text("never read")
    return root


def _cfg(**kw):
    base = dict(
        steps=24,
        batch_size=4,
        seq_len=48,
        lr=3e-3,
        warmup=2,
        eval_every=8,
        save_every=50,
        patience=50,
        vocab_top=0,
        depth=1,
        chain_weights=(1.0,),
    )
    return TrainConfig(**{**base, **kw})


def test_text_files_takes_folders_by_suffix_and_skips_hidden(text_folder):
    files = text_files([text_folder])
    assert [f.relative_to(text_folder).as_posix() for f in files] == [
        "code.py",
        "notes/prose.md",
    ]
    with pytest.raises(MTPError, match="no such file or folder"):
        text_files([text_folder / "missing"])
    empty = text_folder / "notes" / "empty"
    empty.mkdir(exist_ok=True)
    with pytest.raises(MTPError, match="no text files"):
        text_files([empty])


def test_cleaner_drops_repeats_and_held_out_prompts():
    clean = Cleaner()
    boiler = "Licensed under the Apache License, Version 2.0 (the License)."
    prompt = EVAL_PROMPTS["chat"][1]
    first = clean(f"{boiler}\n\nshort\n\nkeep this one paragraph of real text here")
    second = clean(f"{boiler}\n\nshort\n\nWell. {prompt} Asked often.\n\nnew text")
    assert boiler in first and "short" in first
    assert boiler not in second and "short" in second  # short lines may repeat
    assert prompt not in second and "new text" in second


def test_ready_corpus_is_deduplicated_budgeted_and_never_held_out():
    tok = tiny.byte_tokenizer()
    docs = corpus_documents()
    names = [n for n, _ in docs]
    assert any(n.startswith("stdlib/") for n in names)
    assert not any("/test_" in n for n in names)  # no test suite
    seqs = read_text([], True, tok, max_tokens=60_000, seed=1)
    assert sum(len(t) for t, _ in seqs) == 60_000
    assert all(len(t) <= DOC_TOKENS and start == 0 for t, start in seqs)
    text = "\n\n".join(tok.decode(t) for t, _ in seqs)
    flat = " ".join(text.lower().split())
    for prompts in EVAL_PROMPTS.values():
        for p in prompts:
            assert " ".join(p.lower().split()) not in flat
    paragraphs = Counter(
        " ".join(p.split()) for p in re.split(r"\n\s*\n", text) if len(p) >= 200
    )
    assert max(paragraphs.values()) == 1
    again = read_text([], True, tok, max_tokens=60_000, seed=1)
    assert again == seqs  # the same on every run of this machine
    other = read_text([], True, tok, max_tokens=60_000, seed=2)
    assert other != seqs


def test_mixed_order_draws_at_the_share_and_resumes():
    order = _order([10, 90], 0.5, 3, 0)
    draws = [next(order) for _ in range(2000)]
    chat = sum(i < 10 for i in draws) / len(draws)
    assert 0.45 < chat < 0.55  # half, though chat is a tenth of the windows
    assert set(draws) == set(range(100))
    later = _order([10, 90], 0.5, 3, 700)
    assert [next(later) for _ in range(50)] == draws[700:750]
    plain = _order([10, 90], 0.0, 3, 0)
    assert sum(next(plain) < 10 for _ in range(1000)) < 150


def test_text_trains_a_head_and_resumes(llama_folder, text_folder, tmp_path):
    data = DataConfig(text=[text_folder], validation=2, distill_tokens=16)
    run = RunConfig(eval_draft_maxes=())
    losses = []
    hooks = Hooks(step=lambda s, loss, n: losses.append(loss))
    whole = train_head(llama_folder, tmp_path / "whole", data, _cfg(), run, hooks)
    assert whole["complete"] and whole["chat_tokens"] == 0
    assert whole["text_tokens"] > 1000
    assert sum(losses[-4:]) < 0.85 * sum(losses[:4])  # the trunk's top-8, learned
    assert whole["agreement"][0] >= whole["initial_agreement"][0]

    out = tmp_path / "cut"

    def cut(step, loss, n):
        if step == 10:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train_head(llama_folder, out, data, _cfg(save_every=5), run, Hooks(step=cut))
    shard = out / "work" / "shards-text" / "00000.hidden.npy"
    stamp = shard.stat().st_mtime_ns
    steps = []
    again = train_head(
        llama_folder,
        out,
        data,
        _cfg(save_every=5),
        RunConfig(resume=True, eval_draft_maxes=()),
        Hooks(step=lambda s, loss, n: steps.append(s)),
    )
    assert steps[0] == 6 and steps[-1] == 24 and again["complete"]  # from step 5
    assert shard.stat().st_mtime_ns == stamp  # the trunk's pass was kept
    assert again["text_tokens"] == whole["text_tokens"]


def test_text_and_chat_mix_from_the_cli(llama_folder, text_folder, tmp_path, capsys):
    from mlx_mtp.cli import run_app

    out = tmp_path / "mixed"
    args = ["train-head", str(llama_folder), str(out), "--text", str(text_folder)]
    args += ["--text", str(text_folder / "code.py"), "--text-tokens", "900"]
    args += ["--self-distill", "3", "--distill-tokens", "12", "--chat-share", "0.4"]
    # 10 steps of 2 x 48 tokens can use all 900 tokens of text
    args += ["--validation-prompts", "1", "--steps", "10", "--batch-size", "2"]
    args += ["--seq-len", "48", "--no-acceptance", "--json"]
    assert run_app(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["config"]["chat_share"] == 0.4
    assert 800 < report["text_tokens"] <= 900 and report["chat_tokens"] > 0
    assert report["train_tokens"] == report["text_tokens"] + report["chat_tokens"]


# newcomer fixes (issue 32): a quantized trunk, a short file, doubled lines


def test_train_head_on_a_quantized_trunk(llama_folder, tmp_path):
    """A plain convert of a quantized GGUF keeps the trunk quantized: the head's
    block is copied dequantized and trains; greedy output is unchanged."""
    from mlx_lm.models import llama
    from mlx_lm.utils import quantize_model

    from mlx_mtp.generate import generate
    from mlx_mtp.loader import load

    model = llama.Model(llama.ModelArgs.from_dict(LLAMA))
    model.load_weights(str(llama_folder / "model.safetensors"))
    model, config = quantize_model(model, dict(LLAMA), 32, 8)
    weights = dict(tree_flatten(model.parameters()))
    folder = tiny.save_folder(tmp_path / "q8", config, weights)
    out = tmp_path / "head"
    data = DataConfig(text=[tmp_path / "t.py"], validation=1, distill_tokens=8)
    (tmp_path / "t.py").write_text(CODE)
    report = train_head(
        folder, out, data, _cfg(steps=4), RunConfig(eval_draft_maxes=())
    )
    assert report["complete"]
    loaded, tokenizer = load(folder, mtp=out)
    assert loaded.head is not None
    prompt = tokenizer.encode("def f3(x):")
    plain = generate(loaded, tokenizer, prompt, max_tokens=24, mtp=False)
    assert generate(loaded, tokenizer, prompt, max_tokens=24, draft_max=2) == plain


def test_a_file_shorter_than_a_window_is_warned_about(llama_folder, tmp_path, capsys):
    from mlx_mtp.cli import run_app

    short = tmp_path / "short.txt"
    short.write_text("a few words only")
    long = tmp_path / "long.txt"
    long.write_text(CODE)
    for flag in ("--data", "--text"):
        args = ["train-head", str(llama_folder), str(tmp_path / flag.strip("-"))]
        args += [flag, str(short), flag, str(long), "--validation-prompts", "1"]
        args += ["--distill-tokens", "8", "--steps", "1", "--batch-size", "1"]
        args += ["--seq-len", "48", "--no-acceptance"]
        assert run_app(args) == 0
        err = capsys.readouterr().err
        assert (
            f"warning: {short}: " in err and "shorter than one 48-token window" in err
        )
        assert str(long) not in err


def test_plain_progress_never_prints_a_line_twice():
    import io

    from mlx_mtp.cli.train_head import _plain_hooks
    from rich.console import Console

    buf = io.StringIO()
    hooks = _plain_hooks(Console(file=buf, width=200), every=0.0)
    hooks.phase("training (steps)", 3)
    for n in (1, 2, 3):
        hooks.step(n, 1.0 / n, 10)
    hooks.phase("held-out acceptance (generations)", 2)
    hooks.advance(2)
    hooks.phase("", 0)
    lines = buf.getvalue().splitlines()
    assert len(lines) == len(set(lines)) == 4
    assert lines[-1].startswith("held-out acceptance (generations): 2/2")


def test_trunk_view_keeps_the_argmax_and_the_top8_distribution(llama_folder):
    """The trunk pass partitions the vocabulary once: its greedy token is the
    full argmax and its top-8 probabilities are the softmax's, renormalised."""
    from mlx_mtp.loader import load
    from mlx_mtp.training.shards import SOFT_TOP, trunk_view

    model, tokenizer = load(llama_folder)
    ids = tokenizer.encode(CODE)[:96]
    windows = [(ids[:48], 0), (ids[48:90], 0)]
    view = trunk_view(model.target, windows, 48)
    tokens = mx.array([w + [0] * (48 - len(w)) for w, _ in windows])
    logits, _ = model.target(tokens, model.target.make_cache())
    assert (view["greedy"] == np.array(mx.argmax(logits, axis=-1))).all()
    probs = np.array(mx.softmax(logits, axis=-1))
    top = np.take_along_axis(probs, view["soft_ids"], axis=-1)
    want = top / top.sum(-1, keepdims=True)
    assert np.allclose(view["soft_probs"], want, atol=2e-3)
    best = np.sort(probs, axis=-1)[..., -SOFT_TOP:]
    assert np.allclose(np.sort(top, axis=-1), best, atol=1e-6)



# newcomer fixes (issue 42): a tiny run says what it will do, shows its
# distillation's progress in a log, and prepares no more than its steps use


def test_a_tiny_run_says_its_plan_and_prepares_only_what_its_steps_use(
    llama_folder, tmp_path, capsys, monkeypatch
):
    from mlx_mtp.cli import run_app
    from mlx_mtp.cli import train_head as cli

    monkeypatch.setattr(cli, "LINE_EVERY", 0.0)  # every advance makes a line
    text = tmp_path / "notes.txt"
    text.write_text(CODE)  # thousands of tokens; 3 steps of 1 x 16 use 48
    out = tmp_path / "head"
    args = ["train-head", str(llama_folder), str(out), "--text", str(text)]
    args += ["--steps", "3", "--batch-size", "1", "--seq-len", "16"]
    args += ["--distill-batch", "4", "--no-acceptance", "--json"]
    assert run_app(args) == 0
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert lines[0].startswith(
        "train-head: self-distil 3 answers of up to 48 tokens (3 for validation), "
        "read up to 48 tokens of text (as much as the steps can use), "
        "train 3 steps of 1 x 16 tokens: about "
    )
    assert lines[0].endswith(" on this machine")
    # 32 validation prompts asked (the default), 3 of 48 tokens made
    rows = (out / "work" / "validation.jsonl").read_text().splitlines()
    assert len(rows) == 3
    assert all(len(r["tokens"]) - r["prompt_len"] <= 48 for r in map(json.loads, rows))
    report = json.loads(captured.out)
    assert 0 < report["text_tokens"] <= 48
    # progress while the answers are written, not only as each one ends
    distilling = [x for x in lines if x.startswith("self-distillation, validation")]
    assert len(distilling) > 3
    assert distilling[-1].startswith("self-distillation, validation (tokens): 144/144")
