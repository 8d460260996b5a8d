"""Overhead of the speculative loop, side by side in one run (not a test).

Prints, for one tiny random model: mlx-lm's plain decode step time, mlx-mtp's
round time with zero drafts (the loop's overhead; goal: within 5% of plain),
and, with drafts on, main-model forward passes per emitted token. Repetitions
are interleaved and medians reported, so the machine's noise hits all alike.

    python scripts/bench_overhead.py [--family mimo] [--hidden 512] [--layers 4]
"""

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.utils import load_model as mlx_lm_load_model

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import tiny  # noqa: E402

import mlx_mtp  # noqa: E402
from mlx_mtp.sampling import SamplingConfig, make_verifier  # noqa: E402
from mlx_mtp.speculative import speculative_generate_step  # noqa: E402
from mlx_mtp.stats import MTPStats  # noqa: E402


def per_token_time(tokens_iter) -> float:
    """Seconds per token after the first (the first carries the prefill)."""
    start = None
    n = 0
    for _ in tokens_iter:
        n += 1
        if n == 1:
            start = time.perf_counter()
    return (time.perf_counter() - start) / (n - 1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--family", default="mimo")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        full, trunk_only = tiny.build_folder(
            Path(tmp) / args.family,
            args.family,
            hidden_size=args.hidden,
            intermediate_size=3 * args.hidden,
            num_hidden_layers=args.layers,
            num_attention_heads=8,
            num_key_value_heads=4,
        )
        model = mlx_mtp.load_model(full)
        reference, _ = mlx_lm_load_model(trunk_only)
    prompt = tiny.random_prompt(32)
    argmax = lambda x: mx.argmax(x, axis=-1)  # noqa: E731

    def plain():
        return generate_step(
            mx.array(prompt), reference, max_tokens=args.tokens, sampler=argmax
        )

    def ours(k, stats=None, verifier=None):
        return speculative_generate_step(
            prompt, model, max_tokens=args.tokens, draft_max=k, stats=stats,
            verifier=verifier,
        )

    # the verifier users get by default (the full sampler chain, at temp 0)
    default = lambda: make_verifier(SamplingConfig(), None, None)  # noqa: E731
    times = {
        "mlx-lm plain step": [],
        "mlx-mtp round, 0 drafts": [],
        "  same, default verifier": [],
    }
    for _ in range(args.reps):
        times["mlx-lm plain step"].append(per_token_time(plain()))
        times["mlx-mtp round, 0 drafts"].append(per_token_time(ours(0)))
        times["  same, default verifier"].append(
            per_token_time(ours(0, verifier=default()))
        )
    base = statistics.median(times["mlx-lm plain step"])
    print(f"backend: {mx.default_device()}, model: {args.family} hidden {args.hidden}, "
          f"{args.layers} layers, f32, {args.tokens} tokens, median of {args.reps}")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:28s} {med * 1e3:8.2f} ms/token  ({med / base:5.3f}x plain)")
    for k in (1, 2, 3, 4):
        stats = MTPStats()
        for _ in ours(k, stats):
            pass
        print(f"draft-max {k}: forwards/token {stats.forwards_per_token:.3f}, "
              f"mean accepted length {stats.mean_accepted_length:.2f}, "
              f"acceptance {stats.acceptance_rate:.2f}")


if __name__ == "__main__":
    main()
