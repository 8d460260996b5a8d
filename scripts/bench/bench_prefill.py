"""Prefill of a long prompt: mlx-lm's against mlx-mtp's with the head catching up (not a test).

For each prompt length: the time to the first token of mlx-lm's
``generate_step`` and of mlx-mtp with MTP on (the trunk in chunks, the head
reading each chunk's hidden states in one batched call) and off. Both use
chunks of 2048 tokens. Runs are interleaved, the order rotating; printed are
medians and the median of per-repetition ratios to mlx-lm, in wall time and in
this process's CPU time (steady on a shared CPU). The prompt is
text repeated from the shipped bench prompts (encoded with the model's
tokenizer), so the head reads real tokens.

    python scripts/bench/bench_prefill.py [--model PATH] [--lengths 4096 16384] [--reps 3]
"""

import argparse
import statistics
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.generate import generate_step

import mlx_mtp
from mlx_mtp.adaptive import FixedDraft
from mlx_mtp.prompts import load_prompts
from mlx_mtp.speculative import speculative_generate_step


def first_token_time(steps):
    """Wall and CPU seconds to the first token."""
    tic, cpu = time.perf_counter(), time.process_time()
    next(iter(steps))
    return time.perf_counter() - tic, time.process_time() - cpu


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, help="default: the default model")
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    if args.model is None:
        from mlx_mtp.convert.default_model import default_model_path

        args.model = default_model_path()
    model, tokenizer = mlx_mtp.load(args.model)
    text = " ".join(p.prompt for p in load_prompts())
    ids = tokenizer.encode(text)
    argmax = lambda x: mx.argmax(x, axis=-1)  # noqa: E731
    print(f"{args.model}: {mx.default_device()}, medians of {args.reps}")
    for n in args.lengths:
        prompt = (ids * (n // len(ids) + 1))[:n]
        configs = {
            "mlx-lm": lambda: generate_step(
                mx.array(prompt), model.target.model, max_tokens=1, sampler=argmax
            ),
            # MTP on: the head catches up in prefill; the first step drafts
            # nothing, so that both sides time the prefill and one plain step
            "mlx-mtp, MTP on": lambda: speculative_generate_step(
                prompt, model, max_tokens=1, drafts=FixedDraft(0, draft_max=3)
            ),
            "mlx-mtp, no MTP": lambda: speculative_generate_step(
                prompt, model, max_tokens=1, drafts=FixedDraft(0)
            ),
        }
        names = list(configs)
        times = {name: [] for name in names}
        for rep in range(args.reps):
            shift = rep % len(names)
            for name in names[shift:] + names[:shift]:
                mx.clear_cache()
                times[name].append(first_token_time(configs[name]()))
        base = times["mlx-lm"]
        for name in names:
            cells = []
            for col, clock in ((0, "wall"), (1, "cpu")):
                ts = [t[col] for t in times[name]]
                ratio = statistics.median(
                    t[col] / b[col] for t, b in zip(times[name], base)
                )
                cells.append(f"{clock} {statistics.median(ts):8.2f} s {ratio:.3f}x")
            print(f"{n:6d} tokens  {name:16s} " + "  ".join(cells) + "  (x mlx-lm)")


if __name__ == "__main__":
    main()
