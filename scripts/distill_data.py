"""Generate self-distillation data for ``mlx-mtp train-head --data``.

The trunk's greedy answers to ``distill_prompts(N, SEED)``, as JSON lines of
token ids, appended batch by batch so that a stopped run resumes where it was.
Run with OpenBLAS preloaded (docs/performance.md); f32 weights.

    python scripts/distill_data.py MODEL OUT.jsonl --prompts 6000 --seed 0
"""

import argparse
import time
from pathlib import Path

from mlx_lm import load

from mlx_mtp.train_data import default_snippet_files, distill_prompts, self_distill


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("out", type=Path)
    ap.add_argument("--prompts", type=int, default=6000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=48)
    args = ap.parse_args()
    model, tokenizer = load(args.model)
    prompts = distill_prompts(args.prompts, args.seed, default_snippet_files())
    done = sum(1 for _ in open(args.out)) if args.out.exists() else 0
    start, tokens = time.time(), 0
    for i, (seq, _) in enumerate(
        self_distill(
            model, tokenizer, prompts[done:], args.max_tokens, args.batch_size, args.out
        ),
        done + 1,
    ):
        tokens += len(seq)
        if i % args.batch_size == 0:
            rate = tokens / (time.time() - start)
            print(f"{i}/{len(prompts)} sequences, {rate:.0f} tok/s", flush=True)


if __name__ == "__main__":
    main()
