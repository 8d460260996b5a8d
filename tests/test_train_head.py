"""train-head on a tiny random llama: the loss falls, agreement rises, the head attaches."""

import json
import shutil

import mlx.core as mx
import pytest
import tiny
from mlx.utils import tree_flatten

from mlx_mtp.errors import MTPError
from mlx_mtp.generate import generate, mtp_logits
from mlx_mtp.loader import load
from mlx_mtp.train_head import (
    TrainConfig,
    agreement,
    build_dataset,
    head_loss,
    init_head,
    train,
    train_head,
)

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


def _windows(tokenizer, n=6, length=48):
    ids = tokenizer.encode(TEXT)
    return [ids[i * length : (i + 1) * length] for i in range(n)]


def test_training_lowers_loss_and_raises_agreement(llama_folder, tmp_path):
    model, tokenizer = load(llama_folder)
    assert model.head is None
    windows = _windows(tokenizer)
    ds = build_dataset(model, windows, 48)
    head = init_head(model, sample=windows[0])
    before_loss = head_loss(head, ds.hidden, ds.next_tokens, ds.targets, ds.mask).item()
    before = agreement(head, ds)
    cfg = TrainConfig(
        steps=40, batch_size=4, lr=3e-3, warmup=4, eval_every=20, save_every=20
    )
    losses = []
    result = train(
        head, ds, ds, cfg, tmp_path, on_step=lambda s, loss, n: losses.append(loss)
    )
    after_loss = head_loss(head, ds.hidden, ds.next_tokens, ds.targets, ds.mask).item()
    assert after_loss < 0.7 * before_loss
    assert sum(losses[-5:]) < sum(losses[:5])
    assert result.best_agreement == pytest.approx(agreement(head, ds))
    assert result.best_agreement > before + 0.2


def test_vocab_subset_training_also_learns(llama_folder, tmp_path):
    model, tokenizer = load(llama_folder)
    windows = _windows(tokenizer)
    ds = build_dataset(model, windows, 48)
    head = init_head(model, sample=windows[0])
    before = agreement(head, ds)
    cfg = TrainConfig(
        steps=30, batch_size=4, lr=3e-3, warmup=3, eval_every=10, vocab_top=32
    )
    result = train(head, ds, ds, cfg, tmp_path)
    assert result.best_agreement > before + 0.2


def test_train_head_writes_a_head_the_runtime_attaches(
    llama_folder, data_file, tmp_path
):
    out = tmp_path / "head"
    cfg = TrainConfig(
        steps=30,
        batch_size=4,
        seq_len=48,
        lr=3e-3,
        warmup=3,
        eval_every=10,
        save_every=10,
    )
    report = train_head(
        llama_folder,
        out,
        data=[data_file],
        cfg=cfg,
        eval_tokens=24,
        eval_draft_maxes=(1, 2),
    )
    assert report["agreement"] > report["initial_agreement"]
    assert set(report["acceptance"]) == {1, 2}
    config = json.loads((out / "mtp_config.json").read_text())
    assert config["family"] == "deepseek" and config["prefix"] == "model.layers.2."

    model, tokenizer = load(llama_folder, mtp=out)
    assert model.head is not None and model.notice is None
    # the head as loaded predicts what the trained head did (bf16 round trip)
    tokens = tokenizer.encode(TEXT[:60])
    assert mtp_logits(model, tokens).shape == (len(tokens) - 1, tiny.VOCAB)
    prompt = tokenizer.encode("def add(a, b):")
    with_mtp = generate(model, tokenizer, prompt, 40, draft_max=3)
    plain = generate(model, tokenizer, prompt, 40, mtp=False)
    assert with_mtp == plain

    # a head placed in the model folder attaches without --mtp
    folder = tmp_path / "with-head"
    shutil.copytree(llama_folder, folder)
    for name in ("mtp.safetensors", "mtp_config.json"):
        shutil.copy(out / name, folder / name)
    model2, _ = load(folder)
    assert model2.head is not None


def test_resume_goes_on_from_the_checkpoint(llama_folder, data_file, tmp_path):
    out = tmp_path / "head"
    cfg = TrainConfig(
        steps=10, batch_size=2, seq_len=48, eval_every=5, save_every=5, patience=50
    )
    train_head(
        llama_folder,
        out,
        data=[data_file],
        cfg=cfg,
        eval_tokens=16,
        eval_draft_maxes=(),
    )
    with pytest.raises(MTPError, match="--resume"):
        train_head(llama_folder, out, data=[data_file], cfg=cfg, eval_draft_maxes=())
    steps = []
    more = TrainConfig(**{**cfg.__dict__, "steps": 14})
    from mlx_mtp.train_head import Hooks

    hooks = Hooks(step=lambda s, loss, n: steps.append(s))
    report = train_head(
        llama_folder,
        out,
        data=[data_file],
        cfg=more,
        resume=True,
        eval_tokens=16,
        eval_draft_maxes=(),
        hooks=hooks,
    )
    assert steps == [11, 12, 13, 14] and report["steps"] == 14


def test_train_head_cli(llama_folder, data_file, tmp_path, capsys):
    from mlx_mtp.cli import run_app

    out = tmp_path / "cli-head"
    args = [
        "train-head",
        str(llama_folder),
        str(out),
        "--data",
        str(data_file),
        "--steps",
        "6",
        "--batch-size",
        "2",
        "--seq-len",
        "48",
        "--eval-every",
        "3",
        "--eval-tokens",
        "16",
        "--no-acceptance",
        "--json",
        "--lr",
        "0.002",
    ]
    assert run_app(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["steps"] == 6 and report["config"]["lr"] == 0.002
    assert (out / "mtp.safetensors").exists()
    assert run_app(["train-head", str(llama_folder), str(tmp_path / "x")]) == 1
    assert "no training data" in capsys.readouterr().err


def test_prompt_positions_carry_no_target(llama_folder):
    from mlx_mtp.train_data import chunk_sequences

    model, tokenizer = load(llama_folder)
    ids = tokenizer.encode(TEXT)[:40]
    windows = chunk_sequences([(ids, 12), (ids, 0)], 32)
    assert [s for _, s in windows] == [12, 0, 0, 0]
    ds = build_dataset(model, windows, 32)
    # row j predicts t_{j+2}: targets before the answer start are masked
    assert not ds.mask[0, :10].any() and ds.mask[0, 10:31].all()
    assert ds.mask[2].all() and ds.mask[1, :7].all() and not ds.mask[1, 7:].any()


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
        data=[data_file],
        cfg=cfg,
        eval_tokens=16,
        eval_draft_maxes=(),
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
    plain = generate(model, tokenizer, prompt, 32, mtp=False)
    assert generate(model, tokenizer, prompt, 32, draft_max=2) == plain
