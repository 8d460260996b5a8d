"""Two checkouts of mlx-mtp side by side, in-process workloads (not a test).

Before and after a change to the loop: each checkout runs in a worker
process of its own (``PYTHONPATH`` = the checkout), both on the same model;
the workloads are sent to them in turn, the order rotating each repetition,
so that load from other processes moves both sides alike, and the table
shows the median of the ratios (second checkout / first) paired within a
repetition, by wall and by CPU time. ``--fresh`` starts a new worker per
measurement and times its first workload after loading, as a user's first
``generate`` meets it.

Workloads (public API both checkouts share):

- ``one:K`` one stream, ``speculative_generate_step`` with ``FixedDraft(K)``
  (``K`` 0: no drafts, the head does not read along), ``--tokens`` tokens
  whatever they are (no stop token);
- ``auto`` one stream, ``stream_generate`` with its defaults (cost-aware
  drafts from the head and prompt lookup);
- ``batch:N`` ``batch_generate`` of N prompts with its defaults.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
      python scripts/bench/bench_checkouts.py BASE_CHECKOUT NEW_CHECKOUT \\
        --work one:0 one:1 one:2 batch:4 --tokens 64 --repeats 5
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

WORKER = r"""
import json, sys, time
import mlx.core as mx
import mlx_mtp
from mlx_mtp.adaptive import FixedDraft
from mlx_mtp.speculative import speculative_generate_step

model, tokenizer = mlx_mtp.load(sys.argv[1] or None)
prompts = json.loads(sys.argv[2])
# as a user's chat turn (raw text makes the model end at once: ``auto`` and
# ``batch`` stop at the end-of-sequence token, ``one`` runs on regardless)
encoded = [
    tokenizer.apply_chat_template(
        [{"role": "user", "content": p}], add_generation_prompt=True
    )
    for p in prompts
]

def run(work, n):
    kind, _, arg = work.partition(":")
    if kind == "one":
        k = int(arg)
        out = 0
        for t, _ in speculative_generate_step(  # no stop token: n tokens
            encoded[0], model, max_tokens=n, drafts=FixedDraft(k)
        ):
            out += 1
        return out
    if kind == "auto":
        return sum(1 for _ in mlx_mtp.stream_generate(model, tokenizer, encoded[0], n))
    if kind == "batch":
        r = mlx_mtp.batch_generate(model, tokenizer, encoded[: int(arg)], max_tokens=n)
        return r.stats.generation_tokens
    raise SystemExit(f"unknown workload {work}")

print("ready", flush=True)
for line in sys.stdin:
    work, n = line.split()
    wall, cpu = time.perf_counter(), time.process_time()
    tokens = run(work, int(n))
    print(json.dumps([tokens, time.perf_counter() - wall, time.process_time() - cpu]),
          flush=True)
"""

PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome, "
    "with a docstring and two examples.",
    "Explain in a short paragraph why the sky is blue.",
    "List five tips for writing clear emails at work.",
    "Summarise the plot of Romeo and Juliet in three sentences.",
    "What is the difference between a list and a tuple in Python?",
    "Describe how a bicycle gear system works.",
    "Give me a recipe for a simple tomato soup.",
    "Write a haiku about autumn leaves.",
]


class Worker:
    def __init__(self, checkout: Path, model: str):
        env = dict(os.environ, PYTHONPATH=str(checkout))
        self.p = subprocess.Popen(
            [sys.executable, "-c", WORKER, model or "", json.dumps(PROMPTS)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            cwd=tempfile.gettempdir(), env=env,
        )  # fmt: skip
        line = self.p.stdout.readline()
        if line.strip() != "ready":
            raise SystemExit(f"worker for {checkout} did not start")

    def run(self, work: str, n: int):
        self.p.stdin.write(f"{work} {n}\n")
        self.p.stdin.flush()
        return json.loads(self.p.stdout.readline())

    def close(self):
        self.p.stdin.close()
        self.p.wait()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("first", type=Path)
    ap.add_argument("second", type=Path)
    ap.add_argument("--model", default="")
    ap.add_argument("--work", nargs="+", default=["one:0", "one:1", "one:2"])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--fresh", action="store_true")
    args = ap.parse_args()
    sides = [args.first, args.second]
    workers = None
    if not args.fresh:
        workers = [Worker(c, args.model) for c in sides]
        for w in workers:  # warm up every workload once
            for work in args.work:
                w.run(work, args.tokens)
    results = {work: [[], []] for work in args.work}
    for rep in range(args.repeats):
        for work in args.work:
            order = [0, 1] if (rep + hash(work)) % 2 == 0 else [1, 0]
            for i in order:
                if workers is None:
                    w = Worker(sides[i], args.model)
                    results[work][i].append(w.run(work, args.tokens))
                    w.close()
                else:
                    results[work][i].append(workers[i].run(work, args.tokens))
    if workers is not None:
        for w in workers:
            w.close()
    blas = os.environ.get("LD_PRELOAD", "") or "stock BLAS"
    print(f"{sides[0]} -> {sides[1]}; {args.tokens} tokens; {blas}; "
          f"{'fresh processes' if args.fresh else 'warmed'}; {args.repeats} repeats")  # fmt: skip
    print(f"{'workload':10s} {'tok/s first':>12s} {'tok/s second':>13s} "
          f"{'ratio wall':>11s} {'ratio cpu':>10s}")  # fmt: skip
    table = {}
    for work, (a, b) in results.items():
        tps = [statistics.median(t / s for t, s, _ in side) for side in (a, b)]
        # speed ratios (tokens per second), second over first
        wall = statistics.median((y[0] / y[1]) / (x[0] / x[1]) for x, y in zip(a, b))
        cpu = statistics.median((y[0] / y[2]) / (x[0] / x[2]) for x, y in zip(a, b))
        table[work] = {"tps": tps, "wall": wall, "cpu": cpu, "runs": [a, b]}
        n = statistics.median(t for t, _, _ in b)
        print(f"{work:10s} {tps[0]:12.2f} {tps[1]:13.2f} {wall:11.3f} {cpu:10.3f}"
              f"   ({n:.0f} tokens, prompt time included)")  # fmt: skip
    if os.environ.get("BENCH_JSON"):
        Path(os.environ["BENCH_JSON"]).write_text(json.dumps(table, indent=1))


if __name__ == "__main__":
    main()
