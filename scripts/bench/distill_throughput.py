"""Self-distillation throughput at batch 1 and at larger batches, side by side.

Greedy answers to the same generated training prompts through mlx-lm's
``BatchGenerator`` (``mlx_mtp.training.data.self_distill``), batch sizes
interleaved, repeated; prints answer tokens per second (prefill included) and
the median per batch size.

    python scripts/bench/distill_throughput.py MODEL --batch 1 32 64 --prompts 64 \
        --tokens 48 --repeats 2
"""

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from mlx_lm import load

from mlx_mtp.training.data import self_distill
from mlx_mtp.training.prompts import training_prompts


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--prompts", type=int, default=64, help="per batch size >1")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    model, tokenizer = load(args.model)
    prompts = training_prompts(args.prompts, seed=12345)
    rates = {b: [] for b in args.batch}
    for r in range(args.repeats):
        for b in args.batch:
            # batch 1 is slow: fewer prompts, the same kind of work
            ps = prompts[: max(b, 8)] if b == 1 else prompts[: max(b, args.prompts)]
            with tempfile.TemporaryDirectory() as tmp:
                tic = time.perf_counter()
                seqs = self_distill(
                    model, tokenizer, ps, args.tokens, Path(tmp) / "d.jsonl", b
                )
                dt = time.perf_counter() - tic
            n = sum(len(t) - p for t, p in seqs)
            rates[b].append(n / dt)
            print(
                f"repeat {r} batch {b}: {n} answer tokens in {dt:.1f} s, "
                f"{n / dt:.1f} tok/s",
                flush=True,
            )
    for b, v in rates.items():
        print(f"batch {b}: median {statistics.median(v):.1f} tok/s over {len(v)} runs")


if __name__ == "__main__":
    main()
