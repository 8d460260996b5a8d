"""Agreement against data: heads trained on the first N text tokens of a run.

Reads the shards a ``train-head`` run left in ``RUN/work`` (text, chat,
validation), and for each N in ``--tokens`` trains a fresh head on the first
N target tokens of the text (plus all the run's chat windows at
``--chat-share`` of each step) for ``--epochs`` passes over that text (``--min-steps`` at least), then
writes it to ``CURVE/N/`` and prints one line per point: held-out
teacher-forced agreement per depth, E = 1 + a1 + a1 a2 + a1 a2 a3, steps and
seconds. Each point doubles the last, so the curve reads as gain per doubling.
``scripts/experiments/eval_head.py MODEL --mtp CURVE/N`` gives each point's
held-out acceptance table.

    python scripts/experiments/data_curve.py MODEL RUN CURVE --tokens 8192 16384 \
        32768 65536 --epochs 2 --batch-size 4
"""

import argparse
import json
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from mlx_mtp.loader import load
from mlx_mtp.training.head import init_head, save_head
from mlx_mtp.training.run import _config_dict, base_identity
from mlx_mtp.training.shards import ShardSet, target_mask
from mlx_mtp.training.trainer import (
    DEFAULT_CHAT_SHARE,
    TrainConfig,
    expected_length,
    train,
)


def rows_for_tokens(shards: ShardSet, tokens: int) -> int:
    """How many leading windows hold ``tokens`` target positions."""
    per = np.concatenate(
        [target_mask(sh["meta"], shards.seq_len).sum(axis=1) for sh in shards.shards]
    )
    return min(int(np.searchsorted(np.cumsum(per), tokens)) + 1, shards.rows)


def warm_start(head, folder: Path) -> None:
    """Load a saved head's weights (``save_head``'s names) into ``head``."""
    config = json.loads((folder / "mtp_config.json").read_text())
    own = {k for k, _ in tree_flatten(head.trainable_parameters())}
    weights = []
    for k, v in mx.load(str(folder / "mtp.safetensors")).items():
        name = k.removeprefix(config["prefix"])
        name = name if name in own else f"block.{name}"
        if name in own:  # the draft vocabulary is chosen again from the data
            weights.append((name, v.astype(mx.float32)))
    head.load_weights(weights, strict=False)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("run", type=Path, help="a train-head output folder")
    ap.add_argument("curve", type=Path, help="folder for one head per point")
    ap.add_argument("--tokens", type=int, nargs="+", required=True)
    ap.add_argument("--epochs", type=float, default=2.0)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--chat-share", type=float, default=DEFAULT_CHAT_SHARE)
    ap.add_argument("--evals", type=int, default=5, help="evaluations per point")
    ap.add_argument("--init", type=Path, help="start every point from this head")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument(
        "--min-steps",
        type=int,
        default=30,
        help="small points train at least this long (more epochs, early stopping)",
    )
    args = ap.parse_args()
    mtp_model, _ = load(args.model)
    work = args.run / "work"
    text = ShardSet(work / "shards-text")
    val = ShardSet(work / "shards-validation")
    chat = ShardSet(work / "shards-train") if (work / "shards-train").exists() else None
    for n in args.tokens:
        part = text.first(rows_for_tokens(text, n))
        share = args.chat_share if chat is not None else 0.0
        train_set = ShardSet.join([chat, part] if chat is not None else [part])
        epoch = part.rows / ((1 - share) * args.batch_size)
        steps = max(int(args.epochs * epoch), args.min_steps)
        cfg = TrainConfig(
            steps=steps,
            batch_size=args.batch_size,
            warmup=max(steps // 10, 1),
            eval_every=max(steps // args.evals, 5),
            save_every=10**6,
            patience=3,
            chat_share=share,
            lr=args.lr,
        )
        out = args.curve / str(n)
        head = init_head(
            mtp_model, cfg.eh_init, sample=part.batch([0])["tokens"][0].tolist()
        )
        if args.init:
            warm_start(head, args.init)
        tic = time.time()
        result = train(head, train_set, val, cfg, out, mtp_model.config["vocab_size"])
        if result.vocab is not None:
            head.draft_vocab = mx.array(result.vocab, dtype=mx.int32)
        point = {
            "text_tokens": part.tokens(),
            "chat_tokens": chat.tokens() if chat is not None else 0,
            "steps": result.steps,
            "best_step": result.best_step,
            "agreement": [round(a, 4) for a in result.best_agreement],
            "E": round(expected_length(result.best_agreement), 3),
            "seconds": round(time.time() - tic, 1),
        }
        info = {
            "training": {
                "base": base_identity(mtp_model.config, args.model),
                "config": _config_dict(cfg),
                **point,
            }
        }
        save_head(head, mtp_model.config, out, cfg.dtype, info)
        print(json.dumps(point), flush=True)


if __name__ == "__main__":
    main()
