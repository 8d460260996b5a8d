"""Held-out acceptance of an MTP head: greedy, per prompt kind and per depth.

    python scripts/eval_head.py MODEL [--mtp HEAD] [--tokens 64] [--per-kind 4] \
        [--draft-max 1 2 3]

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
from mlx_mtp.training.prompts import DEFAULT_EVAL_PER_KIND, eval_prompts


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--mtp", help="head folder (default: the model folder's own)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--per-kind", type=int, default=DEFAULT_EVAL_PER_KIND)
    ap.add_argument("--draft-max", type=int, nargs="+", default=[1, 2, 3])
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
    summary = {
        kind: {k: evaluate.summary(s) for k, s in per_k.items()}
        for kind, per_k in results.items()
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
