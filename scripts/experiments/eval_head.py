"""Held-out acceptance of an MTP head: greedy, per prompt kind and per depth.

    python scripts/experiments/eval_head.py MODEL [--mtp HEAD] [--tokens 64] [--per-kind 4] \
        [--draft-max 1 2 3] [--costs]

Prompts are ``mlx_mtp.training.prompts.EVAL_PROMPTS`` (written by hand, never
generated for training), through the chat template. Prints a markdown table
(acceptance with accepted/drafted, mean accepted length, per-depth acceptance
at the largest draft-max) for TRAINING.md, then a JSON summary on the last line.
"""

import argparse
import json
import time

from mlx_mtp.loader import load
from mlx_mtp.training import evaluate
from mlx_mtp.training.prompts import (
    DEFAULT_EVAL_PER_KIND,
    eval_prompts,
    render_prompt,
)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--mtp", help="head folder (default: the model folder's own)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--per-kind", type=int, default=DEFAULT_EVAL_PER_KIND)
    ap.add_argument("--draft-max", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument(
        "--costs",
        action="store_true",
        help="also time verify and head calls here and print the recommended "
        "draft-max (what train-head writes into mtp_config.json)",
    )
    args = ap.parse_args()
    model, tokenizer = load(args.model, mtp=args.mtp)
    if model.head is None:
        raise SystemExit(f"no MTP head: {model.notice}")
    prompts = eval_prompts(args.per_kind)
    tic = time.time()
    results = evaluate.by_kind(model, tokenizer, prompts, args.draft_max, args.tokens)
    n = sum(len(p) for p in prompts.values())
    print(
        f"{n} held-out prompts x {args.tokens} tokens, greedy, chat template "
        f"({time.time() - tic:.0f} s)"
    )
    print(evaluate.table(results))
    if args.costs:
        by_depth = results["all"][max(args.draft_max)].per_position_acceptance
        sample = render_prompt(tokenizer, prompts["chat"][0])
        costs = evaluate.measure_costs(model, sample, max(args.draft_max))
        print(f"acceptance by depth: {[round(a, 4) for a in by_depth]}")
        print(f"costs relative to a plain step: {costs}")
        speedups = evaluate.expected_speedups(by_depth, costs)
        print(f"expected speed-ups by draft-max: {[round(x, 3) for x in speedups]}")
        print("recommended_draft_max:", evaluate.recommend_draft_max(by_depth, costs))
    summary = {
        kind: {k: evaluate.summary(s) for k, s in per_k.items()}
        for kind, per_k in results.items()
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
