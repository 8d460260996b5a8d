"""train-head on a tiny random llama: the loss falls, agreement rises, chains
train, shards and resumption are exact, and the head attaches."""

import json
import os
import shutil
import signal

import mlx.core as mx
import numpy as np
import pytest
import tiny
from mlx.utils import tree_flatten

from mlx_mtp.errors import MTPError
from mlx_mtp.generate import generate, mtp_logits
from mlx_mtp.loader import load
from mlx_mtp.training import (
    DataConfig,
    Hooks,
    RunConfig,
    TrainConfig,
    init_head,
    train,
    train_head,
)
from mlx_mtp.training.data import chunk_sequences, self_distill
from mlx_mtp.training.head import chain_forward
from mlx_mtp.training.shards import SHARD_WINDOWS, ShardSet, trunk_view, write_shards
from mlx_mtp.training.trainer import Vocab, agreement, chain_losses, make_batch

LLAMA = dict(
    model_type="llama",
    vocab_size=tiny.VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
    torch_dtype="float32",
    eos_token_id=tiny.VOCAB - 1,
)

TEXT = (
    "The quick brown fox jumps over the lazy dog. A stitch in time saves nine. "
    "def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(add(i, i))\n"
) * 3


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    from mlx_lm.models import llama

    mx.random.seed(3)
    model = llama.Model(llama.ModelArgs.from_dict(LLAMA))
    weights = dict(tree_flatten(model.parameters()))
    return tiny.save_folder(tmp_path_factory.mktemp("llama") / "base", LLAMA, weights)


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "text.txt"
    path.write_text(TEXT)
    return path


def _shards(model, tokenizer, folder, n=6, length=48):
    ids = tokenizer.encode(TEXT)
    windows = [(ids[i * length : (i + 1) * length], 0) for i in range(n)]
    write_shards(model.target, windows, length, folder, batch=4)
    return windows, ShardSet(folder)


def _cfg(**kw):
    base = dict(
        steps=40,
        batch_size=4,
        seq_len=48,
        lr=3e-3,
        warmup=4,
        eval_every=20,
        save_every=20,
        vocab_top=0,
        depth=1,
        chain_weights=(1.0,),
    )
    return TrainConfig(**{**base, **kw})


def _loss(head, shards, vocab, cfg):
    batch = make_batch(shards.batch(range(shards.rows)), vocab)
    return chain_losses(head, batch, vocab, cfg)[1].tolist()


def test_training_lowers_loss_and_raises_agreement(llama_folder, tmp_path):
    model, tokenizer = load(llama_folder)
    assert model.head is None
    windows, shards = _shards(model, tokenizer, tmp_path / "shards")
    head = init_head(model, sample=windows[0][0])
    cfg = _cfg()
    vocab = Vocab(head, None, tiny.VOCAB)
    before_loss, before = (
        _loss(head, shards, vocab, cfg)[0],
        agreement(head, shards, vocab, 1),
    )
    losses = []
    result = train(
        head,
        shards,
        shards,
        cfg,
        tmp_path,
        tiny.VOCAB,
        on_step=lambda s, loss, n: losses.append(loss),
    )
    assert _loss(head, shards, vocab, cfg)[0] < 0.7 * before_loss
    assert sum(losses[-5:]) < sum(losses[:5])
    assert result.best_agreement == pytest.approx(agreement(head, shards, vocab, 3))
    assert result.best_agreement[0] > before[0] + 0.2


def test_chain_forward_is_the_runtime_chain(llama_folder):
    """Depth 2 and 3 of the teacher-forced chain equal the runtime's drafts 2 and
    3 (head KV cache of true entries, then its own output fed back)."""
    model, tokenizer = load(llama_folder)
    ids = tokenizer.encode(TEXT)[:40]
    hidden = model.target(mx.array([ids]), model.target.make_cache())[1]
    head = init_head(model, sample=ids)
    head.eh_proj.weight = head.eh_proj.weight + 0.05 * mx.random.normal(
        head.eh_proj.weight.shape
    )
    tokens = mx.array([ids[1:]])
    outs = chain_forward(head, hidden[:, :-1], tokens, 3)
    for p in (0, 5, 20):
        cache = head.make_cache()
        _, h = head(hidden[:, : p + 1], tokens[:, : p + 1], cache)
        h = h[:, -1:]
        for d in (1, 2):  # draft d + 1 reads the accepted draft d = t_{p+d+1}
            _, h = head(h, tokens[:, p + d : p + d + 1], cache)
            assert mx.allclose(h[0, 0], outs[d][0, p], atol=1e-4).item(), (p, d)


def test_chain_training_lowers_depth2_loss_and_raises_depth2_agreement(
    llama_folder, tmp_path
):
    model, tokenizer = load(llama_folder)
    windows, shards = _shards(model, tokenizer, tmp_path / "shards")
    head = init_head(model, sample=windows[0][0])
    vocab = Vocab(head, None, tiny.VOCAB)
    cfg = _cfg(steps=40, depth=2, chain_weights=(1.0, 1.0))
    loss0, acc0 = _loss(head, shards, vocab, cfg)[1], agreement(head, shards, vocab, 2)
    train(head, shards, shards, cfg, tmp_path, tiny.VOCAB)
    loss1, acc1 = _loss(head, shards, vocab, cfg)[1], agreement(head, shards, vocab, 2)
    assert loss1 < 0.7 * loss0 and acc1[1] > acc0[1] + 0.2


def test_shards_read_back_equal_to_memory(llama_folder, tmp_path):
    model, tokenizer = load(llama_folder)
    ids = tokenizer.encode(TEXT * 12)
    windows = chunk_sequences([(ids, 5)], 32)
    assert 2 * SHARD_WINDOWS < len(windows) < 3 * SHARD_WINDOWS
    assert write_shards(model.target, windows, 32, tmp_path, batch=16)
    shards = ShardSet(tmp_path)
    assert shards.rows == len(windows) and len(shards.shards) == 3
    pick = [0, 3, SHARD_WINDOWS + 1, len(windows) - 1]
    direct = trunk_view(model.target, [windows[i] for i in pick], 32)
    back = shards.batch(pick)
    for name, value in direct.items():
        assert back[name].dtype == value.dtype
        assert np.array_equal(back[name], value), name
    # and the hidden states are the trunk's own, unpadded
    w = windows[SHARD_WINDOWS + 1][0]
    _, hidden = model.target(mx.array([w]), model.target.make_cache())
    got = back["hidden"][2, : len(w)].astype(np.float32)
    assert np.allclose(got, np.array(hidden[0]), atol=2e-2)
    assert isinstance(shards.shards[0]["hidden"], np.memmap)


def test_batched_self_distillation_is_one_at_a_time_greedy(llama_folder, tmp_path):
    from mlx_lm import load as lm_load
    from mlx_lm.generate import generate_step

    from mlx_mtp.training.prompts import render_prompt, training_prompts

    model, tokenizer = lm_load(str(llama_folder))
    prompts = training_prompts(10, seed=4)
    batched = self_distill(model, tokenizer, prompts, 24, tmp_path / "d.jsonl", 4)
    assert len(batched) == 10
    for p, (seq, start) in zip(prompts, batched):
        ids = render_prompt(tokenizer, p)
        assert seq[:start] == ids
        alone = []
        for t, _ in generate_step(mx.array(ids), model, max_tokens=24):
            alone.append(int(t))
            if t in tokenizer.eos_token_ids:
                break
        assert seq[start:] == alone


def test_distillation_resumes_after_an_interruption(llama_folder, tmp_path):
    from mlx_lm import load as lm_load

    from mlx_mtp.training.prompts import training_prompts

    model, tokenizer = lm_load(str(llama_folder))
    prompts = training_prompts(9, seed=1)
    whole = self_distill(model, tokenizer, prompts, 16, tmp_path / "a.jsonl", 3)
    done = []
    part = self_distill(
        model,
        tokenizer,
        prompts,
        16,
        tmp_path / "b.jsonl",
        3,
        progress=done.append,
        should_stop=lambda: sum(done) >= 4 * 16,  # tokens: 4 answers' worth
    )
    assert 0 < len(part) < 9
    with open(tmp_path / "b.jsonl", "a") as f:
        f.write('{"i": 8, "tok')  # a write torn by a kill
    assert self_distill(model, tokenizer, prompts, 16, tmp_path / "b.jsonl", 3) == whole


def _interrupt_at(step):
    def on_step(n, loss, tokens):
        if n == step:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C

    return on_step


def test_ctrl_c_then_resume_equals_an_uninterrupted_run(
    llama_folder, data_file, tmp_path
):
    cfg = TrainConfig(
        steps=12,
        batch_size=2,
        seq_len=48,
        eval_every=4,
        save_every=50,
        patience=50,
        vocab_top=24,
        depth=2,
        chain_weights=(1.0, 0.5),
    )
    args = dict(
        data=DataConfig(
            files=[data_file], self_distill=4, distill_tokens=16, validation=2
        ),
        cfg=cfg,
    )
    args["run"] = RunConfig(eval_draft_maxes=())
    whole = train_head(llama_folder, tmp_path / "whole", **args)
    assert whole["complete"] and whole["steps"] == 12

    out = tmp_path / "cut"
    first = train_head(llama_folder, out, hooks=Hooks(step=_interrupt_at(5)), **args)
    assert not first["complete"] and first["stopped_in"] == "training"
    assert json.loads((out / "checkpoint" / "state.json").read_text())["step"] == 5
    with pytest.raises(MTPError, match="--resume"):
        train_head(llama_folder, out, **args)
    shard = out / "work" / "shards-train" / "00000.hidden.npy"
    stamp = shard.stat().st_mtime_ns
    steps = []
    again = train_head(
        llama_folder,
        out,
        hooks=Hooks(step=lambda s, loss, n: steps.append(s)),
        **{**args, "run": RunConfig(resume=True, eval_draft_maxes=())},
    )
    assert steps == list(range(6, 13)) and again["complete"]
    assert shard.stat().st_mtime_ns == stamp  # the shards were reused
    assert again["agreement"] == pytest.approx(whole["agreement"], abs=1e-6)
    a = mx.load(str(tmp_path / "whole" / "mtp.safetensors"))
    b = mx.load(str(out / "mtp.safetensors"))
    assert all(mx.allclose(a[k], b[k], atol=1e-6).item() for k in a)


def test_hidden_states_resume_from_the_last_whole_shard(llama_folder, tmp_path):
    model, tokenizer = load(llama_folder)
    ids = tokenizer.encode(TEXT * 12)
    windows = chunk_sequences([(ids, 0)], 32)
    calls = []
    assert not write_shards(
        model.target,
        windows,
        32,
        tmp_path,
        batch=16,
        progress=calls.append,
        should_stop=lambda: len(calls) >= 4,
    )
    assert (tmp_path / "00000.json").exists() and not (tmp_path / "00001.json").exists()
    stamp = (tmp_path / "00000.hidden.npy").stat().st_mtime_ns
    assert write_shards(model.target, windows, 32, tmp_path, batch=16)
    assert (tmp_path / "00000.hidden.npy").stat().st_mtime_ns == stamp
    assert ShardSet(tmp_path).rows == len(windows)


def test_train_head_writes_a_head_the_runtime_attaches(
    llama_folder, data_file, tmp_path
):
    out, losses = tmp_path / "head", []
    cfg = TrainConfig(
        steps=30,
        batch_size=4,
        seq_len=48,
        lr=3e-3,
        warmup=3,
        eval_every=10,
        save_every=10,
        vocab_top=0,
    )
    report = train_head(
        llama_folder,
        out,
        DataConfig(files=[data_file], self_distill=4, distill_tokens=24, validation=2),
        cfg=cfg,
        run=RunConfig(eval_tokens=24, eval_per_kind=1),
        hooks=Hooks(step=lambda s, loss, n: losses.append(loss)),
    )
    assert sum(losses[-5:]) < sum(losses[:5])
    assert report["agreement"][0] >= report["initial_agreement"][0]
    assert set(report["acceptance"]) == {"code", "prose", "chat", "all"}
    text = (out / "mtp_config.json").read_text()
    config = json.loads(text)
    assert config["family"] == "deepseek" and config["prefix"] == "model.layers.2."
    assert config["num_nextn_predict_layers"] == 1
    assert isinstance(config["recommended_draft_max"], int)
    assert 1 <= config["recommended_draft_max"] <= 3
    assert len(config["acceptance_by_depth"]) == 3
    assert str(tmp_path) not in text and "/" not in json.dumps(
        config["training"]["base"]
    )

    model, tokenizer = load(llama_folder, mtp=out)
    assert model.head is not None and model.notice is None
    tokens = tokenizer.encode(TEXT[:60])
    assert mtp_logits(model, tokens).shape == (len(tokens) - 1, tiny.VOCAB)
    prompt = tokenizer.encode("def add(a, b):")
    with_mtp = generate(model, tokenizer, prompt, max_tokens=40, draft_max=3)
    assert with_mtp == generate(model, tokenizer, prompt, max_tokens=40, mtp=False)

    folder = tmp_path / "with-head"  # a head in the model folder attaches alone
    shutil.copytree(llama_folder, folder)
    for name in ("mtp.safetensors", "mtp_config.json"):
        shutil.copy(out / name, folder / name)
    assert load(folder)[0].head is not None


def test_vocab_subset_head_drafts_from_its_subset(llama_folder, data_file, tmp_path):
    out = tmp_path / "head"
    cfg = TrainConfig(
        steps=12,
        batch_size=4,
        seq_len=48,
        lr=3e-3,
        warmup=2,
        eval_every=6,
        vocab_top=24,
    )
    train_head(
        llama_folder,
        out,
        DataConfig(files=[data_file], validation=2, distill_tokens=16),
        cfg=cfg,
        run=RunConfig(eval_draft_maxes=()),
    )
    model, tokenizer = load(llama_folder, mtp=out)
    vocab = model.head.draft_vocab
    assert vocab.dtype == mx.int32 and 0 < vocab.shape[0] <= 24
    logits = mtp_logits(model, tokenizer.encode(TEXT[:40]))
    inside = set(vocab.tolist())
    outside = mx.array([t for t in range(tiny.VOCAB) if t not in inside])
    assert mx.all(mx.isinf(logits[:, outside])).item()
    assert mx.all(mx.isfinite(logits[:, vocab])).item()
    prompt = tokenizer.encode("for i in range(10):")
    plain = generate(model, tokenizer, prompt, max_tokens=32, mtp=False)
    assert generate(model, tokenizer, prompt, max_tokens=32, draft_max=2) == plain


def test_prompt_positions_carry_no_target():
    from mlx_mtp.training.shards import target_mask

    ids = list(range(40))
    windows = chunk_sequences([(ids, 12), (ids, 0)], 32)
    assert [s for _, s in windows] == [12, 0, 0, 0]
    meta = np.array([[len(w), s] for w, s in windows])
    mask = target_mask(meta, 32)
    # row j predicts t_{j+2}: targets before the answer start are masked
    assert not mask[0, :10].any() and mask[0, 10:31].all()
    assert mask[2].all() and mask[1, :7].all() and not mask[1, 7:].any()


@pytest.mark.parametrize(
    "content, message",
    [
        (b"", "empty file"),
        (b"  \n", "empty file"),
        (b"ab\x00\x01cd", "binary"),
        (b"caf\xe9 au lait", "not UTF-8"),
    ],
)
def test_bad_data_file_is_one_line_error_before_model_work(
    tmp_path, capsys, content, message
):
    from mlx_mtp.cli import run_app

    bad = tmp_path / "data.txt"
    bad.write_bytes(content)
    missing_model = tmp_path / "no-model"  # reached only after the data check
    code = run_app(
        ["train-head", str(missing_model), str(tmp_path / "o"), "--data", str(bad)]
    )
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1
    assert err.startswith(f"error: {bad}: ") and message in err
    assert not (tmp_path / "o").exists()


def test_train_head_cli(llama_folder, data_file, tmp_path, capsys):
    from mlx_mtp.cli import run_app

    out = tmp_path / "cli-head"
    args = [
        "train-head",
        str(llama_folder),
        str(out),
        "--data",
        str(data_file),
        "--self-distill",
        "3",
        "--distill-tokens",
        "12",
        "--validation-prompts",
        "2",
        "--steps",
        "6",
        "--batch-size",
        "2",
        "--seq-len",
        "48",
        "--eval-every",
        "3",
        "--no-acceptance",
        "--json",
        "--lr",
        "0.002",
        "--warmup",
        "0",
        "--depth",
        "2",
        "--chain-weights",
        "1,0.25",
        "--distill",
        "full",
        "--vocab-top",
        "40",
        "--eh-init",
        "embedding",
        "--dtype",
        "float16",
        "--patience",
        "9",
        "--save-every",
        "2",
        "--seed",
        "3",
    ]
    assert run_app(args) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    c = report["config"]
    assert report["steps"] == 6 and c["lr"] == 0.002 and c["warmup"] == 0
    assert c["depth"] == 2 and c["chain_weights"] == [1.0, 0.25]
    assert (c["distill"], c["vocab_top"], c["eh_init"], c["seed"]) == (
        "full",
        40,
        "embedding",
        3,
    )
    assert len(report["agreement"]) == 3  # measured to depth 3
    assert (
        mx.load(str(out / "mtp.safetensors"))["model.layers.2.eh_proj.weight"].dtype
        == mx.float16
    )
    rows = [
        json.loads(x) for x in (out / "work" / "distill.jsonl").read_text().splitlines()
    ]
    assert len(rows) == 3 and all(
        len(r["tokens"]) - r["prompt_len"] <= 12 for r in rows
    )
    assert len((out / "work" / "validation.jsonl").read_text().splitlines()) == 2
    # not a terminal: plain progress lines, no bars
    assert "training (steps): 6/6" in captured.err and "\r" not in captured.err
    assert run_app(["train-head", str(llama_folder), str(tmp_path / "x")]) == 1
    assert "no training data" in capsys.readouterr().err


def test_cli_ctrl_c_says_how_to_resume(
    llama_folder, data_file, tmp_path, capsys, monkeypatch
):
    from mlx_mtp.cli import run_app

    from mlx_mtp.training import trainer

    real = trainer.make_batch
    seen = []

    def make_batch(raw, vocab):
        seen.append(1)
        if len(seen) == 3:
            os.kill(os.getpid(), signal.SIGINT)
        return real(raw, vocab)

    monkeypatch.setattr(trainer, "make_batch", make_batch)
    out = tmp_path / "h"
    args = [
        "train-head",
        str(llama_folder),
        str(out),
        "--data",
        str(data_file),
        "--validation-prompts",
        "1",
        "--distill-tokens",
        "8",
        "--steps",
        "50",
        "--batch-size",
        "2",
        "--seq-len",
        "48",
        "--eval-every",
        "100",
        "--no-acceptance",
    ]
    assert run_app(args) == 130
    err = capsys.readouterr().err
    assert "interrupted during training" in err and "--resume" in err
    assert (out / "checkpoint" / "state.json").exists()
    assert run_app(args + ["--max-minutes", "0.0001", "--resume"]) == 75
    assert "time budget reached" in capsys.readouterr().err


def test_eh_init_help_shows_choices_and_default(capsys):
    from mlx_mtp.cli import run_app

    os.environ["COLUMNS"] = "200"
    try:
        run_app(["train-head", "--help"])
    finally:
        del os.environ["COLUMNS"]
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if "--eh-init" in x)
    assert "hidden|embedding" in line and "[default: hidden]" in line


def test_held_out_prompts_are_never_generated_for_training():
    from mlx_mtp.training.prompts import (
        EVAL_PROMPTS,
        training_prompts,
        validation_prompts,
    )

    held_out = [p for ps in EVAL_PROMPTS.values() for p in ps]
    assert len(held_out) >= 12
    for seed in range(3):
        for p in training_prompts(4000, seed) + validation_prompts(200, seed):
            for m in p.get("messages", []):
                assert all(
                    h not in m["content"] and m["content"] not in h for h in held_out
                )
    train = training_prompts(500, 0)
    val = validation_prompts(50, 0)
    assert not {str(p) for p in training_prompts(500, 0, val)} & {str(p) for p in val}
    assert training_prompts(200, 0) == train[:200]  # more prompts extend a run
    kinds = {p["kind"] for p in train}
    assert kinds == {"question", "list", "prose", "code", "advice", "multi-turn"}


def test_recommended_draft_max_weighs_acceptance_against_cost():
    from mlx_mtp.training.evaluate import expected_speedups, recommend_draft_max

    flat = {"verify": [1.0, 1.02, 1.04, 1.06], "head": 0.05}
    steep = {"verify": [1.0, 1.6, 2.2, 2.8], "head": 0.05}
    good = [0.8, 0.7, 0.6]
    assert expected_speedups(good, flat)[0] == pytest.approx(1.8 / 1.07)
    assert recommend_draft_max(good, flat) == 3
    assert recommend_draft_max(good, steep) == 1
    assert recommend_draft_max([0.7, 0.1, 0.1], flat) == 1


def test_batch_flags_reach_generation_and_the_trunk(
    llama_folder, tmp_path, capsys, monkeypatch
):
    import importlib

    from mlx_mtp.cli import run_app

    from mlx_mtp.training import shards

    lm_generate = importlib.import_module("mlx_lm.generate")  # the module

    seen = {"completion": [], "trunk": []}

    class Recording(lm_generate.BatchGenerator):
        def __init__(self, model, **kw):
            seen["completion"].append(kw["completion_batch_size"])
            super().__init__(model, **kw)

    real_view = shards.trunk_view

    def view(trunk, windows, seq_len):
        seen["trunk"].append(len(windows))
        return real_view(trunk, windows, seq_len)

    monkeypatch.setattr(lm_generate, "BatchGenerator", Recording)
    monkeypatch.setattr(shards, "trunk_view", view)
    args = [
        "train-head",
        str(llama_folder),
        str(tmp_path / "h"),
        "--self-distill",
        "5",
        "--distill-tokens",
        "8",
        "--validation-prompts",
        "1",
        "--distill-batch",
        "3",
        "--trunk-batch",
        "2",
        "--steps",
        "5",  # room for the 5 answers: data is capped by what the steps use
        "--batch-size",
        "1",
        "--seq-len",
        "48",
        "--eval-tokens",
        "9",
        "--json",
    ]
    assert run_app(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert seen["completion"] == [3, 3]  # validation, then training answers
    assert max(seen["trunk"]) == 2 and sum(seen["trunk"]) == 6
    # --eval-tokens: every held-out generation stops at 9 tokens
    per_k = report["acceptance"]["all"]["1"]
    assert per_k["rounds"] + per_k["accepted"] == 9 * 12


def test_a_missing_path_is_no_such_file_or_folder_everywhere(tmp_path, capsys):
    """One wording for a path that is not there: the OS's "no such file or
    directory" is not what the CLI says anywhere else."""
    from mlx_mtp.cli import run_app

    absent = tmp_path / "absent"
    for args in (
        ["train-head", str(absent), str(tmp_path / "o"), "--data", str(absent)],
        ["train-head", str(absent), str(tmp_path / "o"), "--text", str(absent)],
        ["info", str(absent)],
        ["generate", "-m", str(absent), "-p", "x"],
    ):
        assert run_app(args) == 1
        err = capsys.readouterr().err
        assert err == f"error: {absent}: no such file or folder\n", args
