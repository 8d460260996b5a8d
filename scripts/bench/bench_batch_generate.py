"""``mlx_mtp.batch_generate`` against ``mlx_lm.batch_generate`` (not a test).

Greedy answers to the shipped bench prompts (chat template, cycled to each
batch size), ``--tokens`` each, by three runs of every batch size in every
repetition, in a rotating order: mlx-lm's ``batch_generate`` on mlx-lm's own
model of the folder, and mlx-mtp's on the loaded model with drafts (the
request's default source, each round's draft length chosen by measured time)
and without (``mtp=False``: the same engine, no drafts). Throughput is the
tokens generated over the call's wall time (prompt reading included); also
this process's CPU time, which another job on the machine does not stretch.
Per batch size: medians, and the median of the ratios paired within a
repetition. The outputs are checked to be mlx-lm's token for token.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
    python scripts/bench/bench_batch_generate.py [MODEL] [--sizes 1 4 8 16]
        [--tokens 48] [--repeats 3] [--json]

Without MODEL: the default model (float32 on Linux: the memory-bound regime
of docs/performance.md when OpenBLAS is preloaded).
"""

import argparse
import json
import statistics
import time

import mlx.core as mx
import mlx_lm

import mlx_mtp
from mlx_mtp.prompts import encoded_prompts, load_prompts

RUNS = ("mlx-lm", "mtp off", "mtp")


def timed(run, model, reference, tokenizer, prompts, tokens):
    """(generated token ids per prompt, wall seconds, CPU seconds, stats)."""
    kw = {"max_tokens": tokens, "return_token_ids": True}
    mx.clear_cache()
    wall, cpu = time.perf_counter(), time.process_time()
    if run == "mlx-lm":
        r = mlx_lm.batch_generate(reference, tokenizer, prompts, **kw)
    else:
        r = mlx_mtp.batch_generate(model, tokenizer, prompts, mtp=(run == "mtp"), **kw)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return r.token_ids, wall, cpu, getattr(r, "mtp_stats", None)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?")
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    model, tokenizer = mlx_mtp.load(args.model)
    reference, _ = mlx_lm.load(str(model.path))
    shipped = encoded_prompts(tokenizer, load_prompts())
    batches = {n: [shipped[i % len(shipped)] for i in range(n)] for n in args.sizes}
    # one warm-up of each, so that no run pays for first-use compilation
    for run in RUNS:
        timed(run, model, reference, tokenizer, batches[args.sizes[0]], 8)
    rows = {(n, run): [] for n in args.sizes for run in RUNS}
    turn = 0
    for rep in range(args.repeats):
        for n in args.sizes:
            order = RUNS[turn % 3 :] + RUNS[: turn % 3]
            turn += 1
            outputs = {}
            for run in order:
                ids, wall, cpu, stats = timed(
                    run, model, reference, tokenizer, batches[n], args.tokens
                )
                outputs[run] = ids
                generated = sum(map(len, ids))
                accepted = sum(s.accepted for s in stats) if stats else 0
                drafted = sum(s.drafted for s in stats) if stats else 0
                rows[n, run].append(
                    (generated / wall, generated / cpu, drafted, accepted)
                )
            if not all(outputs[r] == outputs["mlx-lm"] for r in RUNS):
                raise SystemExit(f"batch {n}: outputs differ from mlx-lm's")
    report(args, rows)


def report(args, rows):
    out = []
    for n in args.sizes:
        base = rows[n, "mlx-lm"]
        entry = {"batch": n}
        for run in RUNS:
            mine = rows[n, run]
            entry[run] = {
                "tok_s": statistics.median(r[0] for r in mine),
                "cpu_tok_s": statistics.median(r[1] for r in mine),
                "vs_mlx_lm": statistics.median(m[0] / b[0] for m, b in zip(mine, base)),
                "cpu_vs_mlx_lm": statistics.median(
                    m[1] / b[1] for m, b in zip(mine, base)
                ),
                "drafted": mine[-1][2],
                "accepted": mine[-1][3],
            }
        out.append(entry)
    if args.json:
        print(json.dumps(out, indent=1))
        return
    print(f"greedy, {args.tokens} tokens per prompt, {args.repeats} repetitions")
    print(
        "batch | run     | tok/s (wall) | x mlx-lm | tok/s (cpu) | x mlx-lm | acc/draft"
    )
    for e in out:
        for run in RUNS:
            r = e[run]
            print(
                f"{e['batch']:5d} | {run:7s} | {r['tok_s']:12.1f}"
                f" | {r['vs_mlx_lm']:8.2f}"
                f" | {r['cpu_tok_s']:11.1f} | {r['cpu_vs_mlx_lm']:8.2f}"
                f" | {r['accepted']}/{r['drafted']}"
            )


if __name__ == "__main__":
    main()
