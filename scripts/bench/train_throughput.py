"""Teacher-forced trunk pass and head training, in tokens per second.

The trunk pass is ``shards.trunk_view`` (one forward per batch of windows, the
top-8 at every position) against the earlier version kept here for
comparison (an argmax and a log-softmax over the whole vocabulary besides the
top-8), interleaved and repeated; training is ``train-head``'s step (depth 3
chained, the top-8 loss, the draft vocabulary) at the given batch sizes.

    python scripts/bench/train_throughput.py MODEL --trunk-batch 4 8 16 \
        --batch 4 8 --steps 6 --repeats 3

On a Linux CPU preload OpenBLAS and use an f32 model (see TRAINING.md).
"""

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlx_mtp.loader import load
from mlx_mtp.training.corpus import read_text
from mlx_mtp.training.data import chunk_sequences
from mlx_mtp.training.head import init_head
from mlx_mtp.training.shards import SOFT_TOP, ShardSet, trunk_view, write_shards
from mlx_mtp.training.trainer import TrainConfig, train


def trunk_view_full(trunk, windows, seq_len):
    """The trunk pass before: argmax and log-softmax over the whole vocabulary."""
    tokens = mx.array([w + [0] * (seq_len - len(w)) for w, _ in windows])
    logits, hidden = trunk(tokens, trunk.make_cache())
    greedy = mx.argmax(logits, axis=-1).astype(mx.int32)
    ids = mx.argpartition(-logits, SOFT_TOP - 1, axis=-1)[..., :SOFT_TOP]
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    probs = mx.exp(mx.take_along_axis(logp, ids, axis=-1))
    out = [hidden.astype(mx.float16), greedy, ids, probs.astype(mx.float16)]
    mx.eval(out)
    return [np.array(x) for x in out]


def trunk_rates(model, windows, batches, repeats, seq_len):
    variants = {"now": trunk_view, "before": trunk_view_full}
    rates = {(v, b): [] for v in variants for b in batches}
    for b in batches:  # warm-up: compile and allocate once per shape
        for f in variants.values():
            f(model.target, windows[:b], seq_len)
    for r in range(repeats):
        for b in batches:
            part = windows[(r + 1) * b : (r + 2) * b]
            for v, f in variants.items():
                tic = time.perf_counter()
                f(model.target, part, seq_len)
                rates[(v, b)].append(
                    sum(len(w) for w, _ in part) / (time.perf_counter() - tic)
                )
    return rates


def train_rates(model, windows, batches, steps, seq_len):
    rates = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "shards"
        write_shards(model.target, windows[:16], seq_len, folder, 8)
        shards = ShardSet(folder)
        for b in batches:
            head = init_head(model, sample=windows[0][0])
            cfg = TrainConfig(steps=steps + 1, batch_size=b, seq_len=seq_len)
            cfg.eval_every = cfg.save_every = 10**6
            times = []

            def on_step(step, loss, n, times=times):
                times.append(time.perf_counter())

            train(
                head,
                shards,
                shards,
                cfg,
                Path(tmp) / f"b{b}",
                model.config["vocab_size"],
                on_step=on_step,
            )
            per_step = np.diff(times)  # the first step (compilation) left out
            rates[b] = b * seq_len / float(np.median(per_step))
    return rates


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--trunk-batch", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--batch", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seq-len", type=int, default=256)
    args = ap.parse_args()
    model, tokenizer = load(args.model)
    need = (args.repeats + 2) * max(args.trunk_batch) * args.seq_len
    seqs = read_text([], True, tokenizer, max(need, 16 * args.seq_len), seed=7)
    windows = [
        w for w in chunk_sequences(seqs, args.seq_len) if len(w[0]) == args.seq_len
    ]
    rates = trunk_rates(model, windows, args.trunk_batch, args.repeats, args.seq_len)
    print(
        f"trunk pass, tokens/s (windows of {args.seq_len}, median of {args.repeats}):"
    )
    for b in args.trunk_batch:
        now = statistics.median(rates[("now", b)])
        before = statistics.median(rates[("before", b)])
        ratios = [n / o for n, o in zip(rates[("now", b)], rates[("before", b)])]
        print(
            f"  batch {b:3d}: now {now:6.1f}, before {before:6.1f}, "
            f"ratio {statistics.median(ratios):.2f}"
        )
    for b, r in train_rates(
        model, windows, args.batch, args.steps, args.seq_len
    ).items():
        print(
            f"training, depth 3, batch {b} x {args.seq_len}: {r:6.1f} tokens/s "
            f"({3600 * r / 1e6:.2f} M tokens/hour)"
        )


if __name__ == "__main__":
    main()
