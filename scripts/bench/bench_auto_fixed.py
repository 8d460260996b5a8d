"""``auto`` against the fixed draft counts, each generation the first of a
fresh process (not a test).

Every generation runs in a process of its own, as a user's first request
does (no ``tune``; no warm-up): plain decoding (``mtp=False``), ``auto``
(the default source: head or prompt lookup per round, cost-aware), the
cost-aware head alone (``mtp``) and the head at fixed counts ``k = 1..K``
(``--fixed-draft``), greedy, on each prompt at each answer length. The
configurations run interleaved (repetition, prompt, length, then the
configurations in an order that rotates), and each one's decode tok/s is
its tokens after the first over their time, totalled over the prompts.
Printed per length: each configuration against plain and against the best
fixed count, the acceptance, and whether its tokens are plain's.

``--costs-dir DIR`` keeps the probe's costs, the rounds' corrections and
the drafters' histories in ``DIR/mlx-mtp`` (as ``XDG_CACHE_HOME``): an empty
folder makes the first process a first run on this machine, and every
later process reads what the ones before stored (default: a new temporary
folder, so a run starts from nothing stored). The fixed counts' rounds
are samples of the head's round costs too, so ``auto`` processes after
them start from what they measured; ``--separate-costs`` gives each
configuration a folder of its own (``DIR/CONFIG``), so that ``auto`` learns
from its own rounds alone. ``--remember`` keeps the head's history across
the processes, as ``mlx-mtp generate`` does.

    python scripts/bench/bench_auto_fixed.py [--model M] [--tokens 48 256]
        [--draft-max 3] [--repeats 2] [--prompts FILE] [--costs-dir DIR]
        [--separate-costs] [--remember]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def configs(k_max: int):
    """(name, stream_generate keywords) of every configuration."""
    out = [("plain", {"mtp": False}), ("auto", {}), ("mtp", {"draft_source": "mtp"})]
    for k in range(1, k_max + 1):
        out.append((f"k={k}", {"draft_source": "mtp", "draft_max": k,
                               "adaptive_draft": False}))  # fmt: skip
    return out


def one(args) -> dict:
    """One generation, the first of this process."""
    import mlx_mtp
    from mlx_mtp.prompts import encode, load_prompts, user_prompt

    name, index, tokens = args.one
    kw = dict(configs(args.draft_max))[name]
    model, tokenizer = mlx_mtp.load(args.model)
    prompt = load_prompts(args.prompts)[int(index)].prompt
    ids = encode(tokenizer, user_prompt(tokenizer, prompt))
    out, first, last = [], None, None
    for r in mlx_mtp.stream_generate(model, tokenizer, ids, int(tokens),
                                     remember=args.remember, **kw):  # fmt: skip
        out.append(r.token)
        if first is None:
            first = time.perf_counter()
        last = r
    seconds = time.perf_counter() - first
    return {"ids": out, "tokens": len(out) - 1, "seconds": seconds,
            "drafted": last.stats.drafted, "accepted": last.stats.accepted}  # fmt: skip


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokens", type=int, nargs="+", default=[48, 256])
    ap.add_argument("--draft-max", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--prompts", type=Path, default=None)
    ap.add_argument("--costs-dir", type=Path, default=None)
    ap.add_argument("--separate-costs", action="store_true")
    ap.add_argument("--remember", action="store_true")
    ap.add_argument("--only", nargs="+", default=None, help="these configurations")
    ap.add_argument("--one", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one is not None:
        print(json.dumps(one(args)))
        return
    if args.model is None:  # the default model stays where it was built
        from mlx_mtp.convert.default_model import default_model_path

        args.model = str(default_model_path(print))
    folder = args.costs_dir or Path(tempfile.mkdtemp(prefix="bench-auto-"))
    folder.mkdir(parents=True, exist_ok=True)

    def env(name):
        where = folder / name if args.separate_costs else folder
        where.mkdir(parents=True, exist_ok=True)
        return {**os.environ, "XDG_CACHE_HOME": str(where.resolve())}
    from mlx_mtp.prompts import load_prompts

    n_prompts = len(load_prompts(args.prompts))
    names = [n for n, _ in configs(args.draft_max)]
    if args.only:
        names = [n for n in names if n in args.only or n == "plain"]
    rows = {}  # (name, tokens) -> list of results
    for rep in range(args.repeats):
        for i in range(n_prompts):
            for n in args.tokens:
                shift = (rep * n_prompts + i) % len(names)
                for name in names[shift:] + names[:shift]:
                    cmd = [sys.executable, __file__, "--model", args.model,
                           "--draft-max", str(args.draft_max),
                           "--one", name, str(i), str(n)]  # fmt: skip
                    if args.prompts:
                        cmd += ["--prompts", str(args.prompts)]
                    if args.remember:
                        cmd.append("--remember")
                    done = subprocess.run(
                        cmd, capture_output=True, text=True, env=env(name),
                        check=False,
                    )
                    if done.returncode:
                        sys.exit(f"{name} failed: {done.stderr.strip()[-2000:]}")
                    row = json.loads(done.stdout.strip().splitlines()[-1])
                    row["prompt"] = i
                    rows.setdefault((name, n), []).append(row)
                    print(f"{rep}.{i} {n} {name}: {row['tokens'] / row['seconds']:.2f}"
                          f" tok/s, drafted {row['drafted']}, kept {row['accepted']}",
                          flush=True)  # fmt: skip
    for n in args.tokens:
        speed = {}
        for name in names:
            got = rows[name, n]
            speed[name] = sum(r["tokens"] for r in got) / sum(r["seconds"] for r in got)
        fixed = [s for name, s in speed.items() if name.startswith("k=")]
        best = max(fixed) if fixed else None
        plain = {(r["prompt"], k): r["ids"] for k, r in enumerate(rows["plain", n])}
        print(f"\n{n} tokens, {args.repeats} repetitions x {n_prompts} prompts, "
              f"each a fresh process (costs in {folder}):")  # fmt: skip
        for name in names:
            got = rows[name, n]
            same = all(r["ids"] == plain[r["prompt"], k] for k, r in enumerate(got))
            drafted = sum(r["drafted"] for r in got)
            kept = sum(r["accepted"] for r in got) / drafted if drafted else 0.0
            vs_best = f", {speed[name] / best:.3f} of the best fixed" if best else ""
            ratio = speed[name] / speed["plain"]
            print(f"  {name:6s} {speed[name]:7.2f} tok/s, {ratio:.3f}"
                  f" of plain{vs_best}; kept {kept:.2f} of {drafted} drafts; "
                  f"tokens as plain: {same}")  # fmt: skip
        if best:
            print(f"  auto / best fixed: {speed['auto'] / best:.3f} "
                  f"(median per prompt: {per_prompt(rows, n, names):.3f})")


def per_prompt(rows, n, names) -> float:
    """The median over prompts and repetitions of auto's tok/s over the best
    fixed count's on the same prompt."""
    fixed = [name for name in names if name.startswith("k=")]
    ratios = []
    for k, a in enumerate(rows["auto", n]):
        best = max(rows[f, n][k]["tokens"] / rows[f, n][k]["seconds"] for f in fixed)
        ratios.append(a["tokens"] / a["seconds"] / best)
    return statistics.median(ratios)


if __name__ == "__main__":
    main()
