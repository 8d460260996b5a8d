"""Draft vocabularies: acceptance lost against draft cost saved (not a test).

For one model: greedy answers to the shipped prompts, then per draft
vocabulary (the whole vocabulary, the head's own subset if it has one, and
the N tokens the trunk expects most over the prompts, as ``mlx-mtp tune``
picks them) the head's teacher-forced depth-1 acceptance on the answers and
the CPU time of 1..K drafts, interleaved and in plain steps. ``--cost-only``
skips the answers (for random models, whose acceptance means nothing here).

    python scripts/bench/bench_draft_vocab.py MODEL [--sizes 4096 8192 16384 32768]
        [--tokens 64] [--repeats 7] [--cost-only]
"""

import argparse
import statistics
import time

import mlx.core as mx

import mlx_mtp
from mlx_mtp.prompts import encoded_prompts, load_prompts
from mlx_mtp.tune import (
    CostTimer,
    _draft,
    depth1_hits,
    measure_acceptance,
    rank_tokens,
    subset_acceptance,
)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--sizes", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--draft-max", type=int, default=3)
    ap.add_argument("--cost-only", action="store_true")
    args = ap.parse_args()

    model, tokenizer = mlx_mtp.load(args.model)
    head = model.head.layer(0)
    own = head.draft_vocab if "draft_vocab" in head else None
    model.head.set_draft_vocab(None)
    vocab = model.target.embed_tokens.weight.shape[0]
    prompts = encoded_prompts(tokenizer, load_prompts())
    if args.cost_only:
        prompts = [[(7 * i + 3) % 256 for i in range(64)]]
        sequences = prompts
    else:
        _, sequences = measure_acceptance(
            model, prompts, 1, args.tokens, tokenizer.eos_token_ids
        )
    ranked = rank_tokens(model, prompts)
    trials = [("all", None)]
    if own is not None:
        trials.append((f"head's own ({own.size})", own))
    trials += [(str(n), mx.sort(ranked[:n])) for n in args.sizes if n < vocab]
    rows = None if args.cost_only else depth1_hits(model, sequences, map(len, prompts))
    timer = CostTimer(model, max(sequences, key=len), 1)  # the warm state, the unit
    K = args.draft_max
    times = {name: {k: [] for k in range(1, K + 1)} for name, _ in trials}
    for rep in range(args.repeats):
        timer.run_once(rep)
        shift = rep % len(trials)
        for name, v in trials[shift:] + trials[:shift]:
            model.head.set_draft_vocab(v)
            timer.state.restore()
            _draft(timer.state, 1)  # gathers the rows: not timed
            for k in range(1, K + 1):
                timer.state.restore()
                c = time.process_time()
                _draft(timer.state, k)
                times[name][k].append(time.process_time() - c)
    step = timer.costs(cpu=True)["step_seconds"]
    print(f"{args.model}: vocabulary {vocab}, plain step {step * 1e3:.1f} ms CPU")
    print(f"{'draft vocabulary':22s} {'accept@1':>9s}   drafts k=1..{K} (plain steps)")
    for name, v in trials:
        acc = "-" if rows is None else f"{subset_acceptance(rows, v):.3f}"
        cost = " ".join(
            f"{statistics.median(times[name][k]) / step:.3f}" for k in range(1, K + 1)
        )
        print(f"{name:22s} {acc:>9s}   {cost}")


if __name__ == "__main__":
    main()
