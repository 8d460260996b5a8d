"""Draft acceptance at temperature 0, 0.6 and 1.0: greedy vs sampled drafts, side by side.

Runs the tiny random models of tests/tiny.py (no download), every setting on
the same prompts and seeds, and prints llama.cpp-style counts; then fixed vs
cost-aware draft count. Two variants of the model: as the tests build it
(near-uniform next-token distributions: top probability about 1.5%) and
"sharp", with both output heads scaled so distributions are peaked like a real
language model's. Counts need no clock; tok/s on this CPU is noise-prone.
``--model PATH`` runs a real MLX folder with an MTP head on a few chat prompts.

    python scripts/experiments/acceptance_by_temperature.py [--family deepseek_v3] [--tokens 64]
    python scripts/experiments/acceptance_by_temperature.py --model PATH
"""

import argparse
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

import tiny  # noqa: E402

import mlx_mtp  # noqa: E402
from mlx_mtp.adaptive import CostAwareDraft, prior_costs  # noqa: E402
from mlx_mtp.sampling import SamplingConfig, make_verifier  # noqa: E402
from mlx_mtp.speculative import speculative_generate_step  # noqa: E402
from mlx_mtp.stats import MTPStats  # noqa: E402

HEADS = ("lm_head.weight", "shared_head.head.weight")
CHAT_PROMPTS = [
    "Write a short poem about the sea.",
    "Explain how a hash map works.",
    "List five fruits and their colours.",
    "Write a Python function that reverses a string.",
    "What causes the seasons on Earth?",
    "Summarise the plot of Romeo and Juliet.",
]


def build(root: Path, family: str, sharpen: float) -> Path:
    config, trunk_w, mtp_w = tiny.build_weights(family)
    for weights in (trunk_w, mtp_w):
        for name in weights:
            if name.endswith(HEADS):
                weights[name] = weights[name] * sharpen
    return tiny.save_folder(root / f"{family}-x{sharpen:g}", config, trunk_w, mtp_w)


def run(model, prompts, tokens, draft_max, adaptive=False, **sampling):
    """One MTPStats over all prompts (each with its own seed)."""
    stats = MTPStats()
    tic = time.perf_counter()
    for i, prompt in enumerate(prompts):
        verifier = make_verifier(SamplingConfig(seed=i, **sampling))
        policy = CostAwareDraft(draft_max, prior_costs()) if adaptive else None
        for _ in speculative_generate_step(
            prompt, model, max_tokens=tokens,
            verifier=verifier, drafts=policy, stats=stats,
        ):
            pass
    return stats, time.perf_counter() - tic


def real_model(path: str, n: int):
    model, tokenizer = mlx_mtp.load(path)
    prompts = []
    for text in CHAT_PROMPTS[:n]:
        messages = [{"role": "user", "content": text}]
        prompts.append(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    return model, prompts


def report(model, prompts, tokens):
    print(HEADER)
    for temp in (0.0, 0.6, 1.0):
        for mode in ("greedy", "sample"):
            stats, s = run(model, prompts, tokens, 3, temp=temp, draft_sampling=mode)
            print(row(f"temp {temp:<4} {mode} drafts", stats, s))
    print("\nfixed vs cost-aware draft count (greedy drafts, prior costs)")
    print(HEADER)
    for temp in (0.0, 0.6):
        for draft_max, adaptive in ((3, False), (6, False), (6, True)):
            stats, s = run(model, prompts, tokens, draft_max, adaptive, temp=temp)
            label = f"temp {temp:<4} max {draft_max}{' adaptive' if adaptive else ''}"
            print(row(label, stats, s))


def row(label, stats, seconds):
    per_pos = ", ".join(f"{a:.2f}" for a in stats.per_position_acceptance)
    return (
        f"{label:<28} {stats.acceptance_rate:6.3f} {stats.accepted:5d}/{stats.drafted:<5d}"
        f" {stats.mean_accepted_length:5.2f}  {stats.drafted / stats.generation_tokens:5.2f}"
        f"  {stats.generation_tokens / seconds:7.1f}  ({per_pos})"
    )


HEADER = (
    f"{'setting':<28} {'accept':>6} {'acc/drafted':>11} {'len':>5}  {'d/tok':>5}"
    f"  {'tok/s':>7}  per position"
)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="deepseek_v3", choices=sorted(tiny.CONFIGS))
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--model", help="a real MLX folder with an MTP head")
    args = parser.parse_args()
    name = args.model or args.family
    print(f"{name}, {args.prompts} prompts x {args.tokens} tokens, draft-max 3")
    print("len = mean accepted length (tokens per verify); d/tok = drafts per token")
    if args.model:
        report(*real_model(args.model, args.prompts), args.tokens)
        return
    prompts = [tiny.random_prompt(24, seed) for seed in range(args.prompts)]
    root = Path(tempfile.mkdtemp())
    for sharpen in (1.0, 8.0):
        print(f"\nmodel: output heads x{sharpen:g}")
        report(mlx_mtp.load_model(build(root, args.family, sharpen)), prompts, args.tokens)
        mx.clear_cache()


if __name__ == "__main__":
    main()
