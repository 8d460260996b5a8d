"""Overhead of the speculative loop, side by side in one run (not a test).

Per token after the first: mlx-lm's plain decode step (``generate_step``),
mlx-mtp with no drafts (exact-match and default verifiers), and mlx-mtp with
MTP on but no round drafting (what the cost-aware policy does when drafts
cannot pay: the head reads along every 32 tokens). Repetitions are
interleaved (the order rotating) and each configuration's time is divided by
mlx-lm's in the same repetition; medians and quartiles of those ratios are
printed. Goal: within 3% of plain.

    python scripts/bench/bench_overhead.py [--model PATH | --family mimo --hidden 512]
        [--tokens 64] [--reps 21]
"""

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.generate import generate_step

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
import tiny  # noqa: E402

import mlx_mtp  # noqa: E402
from mlx_mtp.adaptive import FixedDraft  # noqa: E402
from mlx_mtp.sampling import SamplingConfig, make_verifier  # noqa: E402
from mlx_mtp.speculative import speculative_generate_step  # noqa: E402


def per_token_time(tokens_iter):
    """Wall and CPU seconds per token after the first (the first carries the
    prefill)."""
    start = None
    n = 0
    for _ in tokens_iter:
        n += 1
        if n == 1:
            start = time.perf_counter(), time.process_time()
    wall, cpu = time.perf_counter() - start[0], time.process_time() - start[1]
    return wall / (n - 1), cpu / (n - 1)


def quartiles(xs):
    q = statistics.quantiles(xs, n=4)
    return q[0], statistics.median(xs), q[2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, help="a model folder (default: a tiny one)")
    ap.add_argument("--family", default="mimo")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=21)
    args = ap.parse_args()

    if args.model is None:
        with tempfile.TemporaryDirectory() as tmp:
            full, _ = tiny.build_folder(
                Path(tmp) / args.family,
                args.family,
                hidden_size=args.hidden,
                intermediate_size=3 * args.hidden,
                num_hidden_layers=args.layers,
                num_attention_heads=8,
                num_key_value_heads=4,
            )
            model = mlx_mtp.load_model(full)
        what = f"{args.family} hidden {args.hidden}, {args.layers} layers"
        prompt = tiny.random_prompt(32)
    else:
        model = mlx_mtp.load_model(args.model)
        what = str(args.model)
        prompt = [(7 * i + 3) % 256 for i in range(32)]
    reference = model.target.model
    argmax = lambda x: mx.argmax(x, axis=-1)  # noqa: E731

    def plain():
        return generate_step(
            mx.array(prompt), reference, max_tokens=args.tokens, sampler=argmax
        )

    def ours(k=0, verifier=None, policy=None):
        return speculative_generate_step(
            prompt,
            model,
            max_tokens=args.tokens,
            verifier=verifier,
            drafts=policy or FixedDraft(k),
        )

    # the verifier users get by default (the full sampler chain, at temp 0)
    default = lambda: make_verifier(SamplingConfig(), None, None)  # noqa: E731
    configs = {
        "mlx-lm plain step": plain,
        "mlx-mtp, no MTP": lambda: ours(0),
        "  same, default verifier": lambda: ours(0, default()),
    }
    configs["mlx-mtp, MTP on, 0 drafts"] = lambda: ours(
        3, default(), FixedDraft(0, draft_max=3)
    )
    names = list(configs)
    for name in names:  # warm up
        per_token_time(configs[name]())
    times = {name: [] for name in names}
    for rep in range(args.reps):
        shift = rep % len(names)
        for name in names[shift:] + names[:shift]:
            times[name].append(per_token_time(configs[name]()))
    base = times[names[0]]
    print(
        f"backend: {mx.default_device()}, model: {what}, f32, {args.tokens} tokens, "
        f"{args.reps} interleaved repetitions; wall time, then this process's CPU "
        "time (steady on a shared CPU)"
    )
    print(f"{'':28s} {'ms/token':>9s}   ratio to plain: q1 median q3   mean")
    for col, clock in ((0, "wall"), (1, "cpu")):
        for name in names:
            ratios = [t[col] / b[col] for t, b in zip(times[name], base)]
            q1, med, q3 = quartiles(ratios)
            ms = statistics.median(t[col] for t in times[name]) * 1e3
            mean = sum(t[col] for t in times[name]) / sum(b[col] for b in base)
            print(
                f"{clock} {name:23s} {ms:9.2f}   {q1:.3f} {med:.3f} {q3:.3f}   "
                f"{mean:.3f}"
            )


if __name__ == "__main__":
    main()
