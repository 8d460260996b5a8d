"""Draft-vocabulary size against its cost and its coverage.

For each size K: the share of validation targets (the trunk's greedy answer
tokens) that lie in the K most frequent training targets, which caps the
first-draft acceptance, and the time of one chained head call relative to a
plain one-token step of the trunk (as ``train-head``'s costs are measured).

    python scripts/experiments/vocab_cost.py MODEL RUN --sizes 1024 2048 4096 8192 0
"""

import argparse
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlx_mtp.loader import load
from mlx_mtp.training.evaluate import measure_costs
from mlx_mtp.training.head import init_head
from mlx_mtp.training.shards import ShardSet, target_mask


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("run", type=Path, help="a train-head OUT folder with shards")
    ap.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 0])
    args = ap.parse_args()
    model, tokenizer = load(args.model)
    vocab_size = model.config["vocab_size"]
    train = ShardSet(args.run / "work" / "shards-train")
    val = ShardSet(args.run / "work" / "shards-validation")
    counts = train.target_counts(vocab_size)
    order = np.argsort(-counts, kind="stable")
    targets = np.concatenate(
        [sh["greedy"][:, 1:][target_mask(sh["meta"], val.seq_len)] for sh in val.shards]
    )
    prompt = tokenizer.encode("Tell me about the history of the bicycle. " * 8)
    print(f"{int((counts > 0).sum())} distinct training targets")
    print("| draft vocabulary | validation targets covered | chained head call |")
    print("| --- | --- | --- |")
    for k in args.sizes:
        model.head = init_head(model, "hidden")
        keep = order[: k or vocab_size]
        if k:
            model.head.draft_vocab = mx.array(keep.astype(np.int32))
        covered = np.isin(targets, keep).mean()
        cost = measure_costs(model, prompt, 1, repeats=15)["head"]
        name = k or f"all {vocab_size}"
        print(f"| {name} | {covered:.1%} | {cost:.3f} of a plain step |", flush=True)


if __name__ == "__main__":
    main()
