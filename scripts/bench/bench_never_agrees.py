"""A drafter that never agrees against plain decoding (not a test): decode
tok/s of ``stream_generate`` with ``draft_source`` the drafter (cost-aware)
against ``mtp=False``, alternating, over the shipped chat prompts.

    python scripts/bench/bench_drafters.py --keep DIR   # random drafters
    python scripts/bench/bench_never_agrees.py DIR/DFlashDraftModel
        [--model M] [--source dflash] [--tokens 128] [--prompts 3] [--repeats 2]
"""

import argparse
import statistics

import mlx_mtp
from mlx_mtp.prompts import load_prompts


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("drafter")
    ap.add_argument("--model", default=None)
    ap.add_argument("--source", default="dflash")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    model, tokenizer = mlx_mtp.load(args.model, draft=args.drafter)
    prompts = [p.prompt for p in load_prompts()][: args.prompts]

    def run(prompt, **kw):
        for r in mlx_mtp.stream_generate(model, tokenizer, prompt, args.tokens, **kw):
            last = r
        return last.generation_tps, last.stats

    ratios = []
    for _ in range(args.repeats):
        for i, prompt in enumerate(prompts):
            plain, _ = run(prompt, mtp=False)
            drafted, stats = run(prompt, draft_source=args.source, draft_max=7)
            ratios.append(drafted / plain)
            print(f"prompt {i}: plain {plain:.2f} tok/s, {args.source} {drafted:.2f} "
                  f"({drafted / plain:.3f}), drafted {stats.drafted}, "
                  f"accepted {stats.accepted}", flush=True)  # fmt: skip
    print(f"median {args.source} / plain: {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
