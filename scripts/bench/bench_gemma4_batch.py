"""A Gemma 4 target with its assistant drafter, batched, against plain
decoding (not a test).

Greedy answers to the shipped bench prompts (chat template; their lengths
differ, so the streams sit at different positions), cycled to each batch
size, ``--tokens`` each, by every run at every batch size in every
repetition, in a rotating order:

- ``mlx-lm``: mlx-lm's ``batch_generate`` on mlx-lm's own model (the target
  alone): the plain baseline;
- ``plain``: mlx-mtp's ``batch_generate`` without drafts (``mtp=False``);
- ``assistant``: with the assistant's drafts, each round's depth chosen by
  measured time (``BatchDraftLength``), the assistant alone
  (``draft_source="mtp"``: no prompt lookup);
- ``assistant kN``: the assistant at a fixed ``--draft N`` every round;
- ``one at a time`` (batch sizes above 1): the assistant at the batch's
  policy, one stream decoding at a time (``completion_batch_size=1``): how
  the assistant was served before it batched.

Throughput is the tokens generated over the call's wall time (prompt
reading included), and over this process's CPU time (which another job on
the machine does not stretch). Per batch size: medians, and the median of
the ratios to mlx-lm paired within a repetition. Every run's tokens are
checked to be mlx-lm's.

Run it twice on a quiet machine, on the stock BLAS and with OpenBLAS
preloaded (the header says which it ran with):

    python scripts/bench/bench_gemma4_batch.py GEMMA4 ASSISTANT \\
        [--sizes 1 4 8] [--tokens 64] [--repeats 3] [--draft 3] [--json]
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
    python scripts/bench/bench_gemma4_batch.py GEMMA4 ASSISTANT ...

GEMMA4 is a Gemma 4 folder (``gemma4`` or ``gemma4_text``), ASSISTANT its
assistant's folder (``--mtp``); with the assistant kept beside the model
(``mlx-mtp convert ASSISTANT --mtp-only --into GEMMA4``) pass ``-`` for it.
A random bench-sized pair of the published layout, its assistant partly
agreeing: ``build_bench_model.py OUT --family gemma4 --hidden 1536 --layers
10`` (GEMMA4 is OUT, ASSISTANT ``OUT-assistant``; docs/performance.md).
"""

import argparse
import json
import os
import statistics
import time

import mlx.core as mx
import mlx_lm

import mlx_mtp
from mlx_mtp.prompts import encoded_prompts, load_prompts

BLAS = "OpenBLAS" if "openblas" in os.environ.get("LD_PRELOAD", "") else "stock"


def runs(draft: int):
    """Each run's name and its ``mlx_mtp.batch_generate`` keywords (None:
    mlx-lm's)."""
    assistant = {"draft_source": "mtp"}
    return {
        "mlx-lm": None,
        "plain": {"mtp": False},
        "assistant": assistant,
        f"assistant k{draft}": dict(assistant, draft_max=draft, adaptive_draft=False),
        "one at a time": dict(assistant, completion_batch_size=1),
    }


def timed(kw, model, reference, tokenizer, prompts, tokens):
    """(generated token ids per prompt, wall seconds, CPU seconds, stats)."""
    common = {"max_tokens": tokens, "return_token_ids": True}
    mx.clear_cache()
    wall, cpu = time.perf_counter(), time.process_time()
    if kw is None:
        r = mlx_lm.batch_generate(reference, tokenizer, prompts, **common)
    else:
        r = mlx_mtp.batch_generate(model, tokenizer, prompts, **common, **kw)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return r.token_ids, wall, cpu, getattr(r, "mtp_stats", None)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("assistant", help="the assistant's folder, or - (kept beside)")
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--draft", type=int, default=3, help="the fixed run's depth")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    mtp = None if args.assistant == "-" else args.assistant
    model, tokenizer = mlx_mtp.load(args.model, mtp=mtp)
    if model.head is None or "Gemma4Assistant" not in type(model.head).__name__:
        raise SystemExit(f"{args.model}: no Gemma 4 assistant drafts for it")
    reference, _ = mlx_lm.load(str(model.path))
    shipped = encoded_prompts(tokenizer, load_prompts())
    batches = {n: [shipped[i % len(shipped)] for i in range(n)] for n in args.sizes}
    table = runs(args.draft)
    names = list(table)
    # one warm-up of each, so that no run pays for first-use compilation
    for name in names:
        timed(table[name], model, reference, tokenizer, batches[args.sizes[-1]], 8)
    rows = {}
    turn = 0
    for _ in range(args.repeats):
        for n in args.sizes:
            here = [r for r in names if n > 1 or r != "one at a time"]
            order = here[turn % len(here) :] + here[: turn % len(here)]
            turn += 1
            outputs = {}
            for name in order:
                ids, wall, cpu, stats = timed(
                    table[name], model, reference, tokenizer, batches[n], args.tokens
                )
                outputs[name] = ids
                generated = sum(map(len, ids))
                drafted = sum(s.drafted for s in stats) if stats else 0
                accepted = sum(s.accepted for s in stats) if stats else 0
                rows.setdefault((n, name), []).append(
                    (generated / wall, generated / cpu, drafted, accepted)
                )
            wrong = [r for r in here if outputs[r] != outputs["mlx-lm"]]
            if wrong:
                raise SystemExit(f"batch {n}: {', '.join(wrong)} differ from mlx-lm")
    report(args, names, rows)


def report(args, names, rows):
    out = []
    for n in args.sizes:
        base = rows[n, "mlx-lm"]
        entry = {"batch": n, "blas": BLAS}
        for name in names:
            mine = rows.get((n, name))
            if mine is None:
                continue
            entry[name] = {
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
    print(
        f"Gemma 4 + assistant, greedy, {args.tokens} tokens per prompt, "
        f"{args.repeats} repetitions, BLAS: {BLAS}"
    )
    print(
        "batch | run            | tok/s (wall) | x mlx-lm | tok/s (cpu) | x mlx-lm"
        " | acc/draft"
    )
    for e in out:
        for name in names:
            r = e.get(name)
            if r is None:
                continue
            print(
                f"{e['batch']:5d} | {name:14s} | {r['tok_s']:12.1f}"
                f" | {r['vs_mlx_lm']:8.2f}"
                f" | {r['cpu_tok_s']:11.1f} | {r['cpu_vs_mlx_lm']:8.2f}"
                f" | {r['accepted']}/{r['drafted']}"
            )


if __name__ == "__main__":
    main()
