"""Measure what moves a trained head's held-out agreement: one flag at a time.

Every variant is ``mlx-mtp train-head BASE GRID/NAME --self-distill N ...``
with the baseline's flags plus its own, on the data of an earlier run (its
``work`` folder is hard-linked in, so no answer is generated and no shard is
recomputed twice). Prints per-depth teacher-forced agreement on the run's
validation prompts, the expected tokens per verify pass at draft-max 3
(1 + a1 + a1 a2 + a1 a2 a3) and the training time, as a markdown table.

    python scripts/experiments/recipe_grid.py BASE DATA_RUN GRID --self-distill 3000 \
        --common "--steps 300 --batch-size 4 --eval-every 50" \
        --variant baseline "" --variant depth1 "--depth 1" ...
"""

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path


def expected(per_depth):
    run = total = 1.0
    for a in per_depth:
        run *= a
        total += run
    return total


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("base")
    ap.add_argument("data_run", type=Path, help="an earlier train-head OUT folder")
    ap.add_argument("grid", type=Path)
    ap.add_argument("--self-distill", type=int, required=True)
    ap.add_argument("--common", default="")
    ap.add_argument("--variant", nargs=2, action="append", metavar=("NAME", "FLAGS"))
    args = ap.parse_args()
    rows = []
    for name, flags in args.variant:
        out = args.grid / name
        extra = shlex.split(flags)
        n = args.self_distill
        if "--self-distill" in extra:  # a data-volume variant
            n = int(extra.pop(extra.index("--self-distill") + 1))
            extra.remove("--self-distill")
        if not (out / "mtp_config.json").exists():
            (out / "work").mkdir(parents=True, exist_ok=True)
            subprocess.run(
                ["cp", "-al", "--no-clobber"]
                + [str(p) for p in (args.data_run / "work").iterdir()]
                + [str(out / "work")],
                check=True,
            )
            cmd = [
                "mlx-mtp",
                "train-head",
                args.base,
                str(out),
                "--self-distill",
                str(n),
                "--no-acceptance",
                *shlex.split(args.common),
                *extra,
            ]
            print("$", shlex.join(cmd), flush=True)
            tic = time.time()
            with open(args.grid / f"{name}.log", "w") as log:
                subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=True)
            print(f"{name}: {time.time() - tic:.0f} s", flush=True)
        report = json.loads((out / "mtp_config.json").read_text())["training"]
        acc = report["agreement"]
        rows.append(
            f"| {name} | `{flags}` | {report['train_tokens']} | "
            + ", ".join(f"{a:.1%}" for a in acc)
            + f" | {expected(acc):.2f} | {report['best_step']}/{report['steps']} | "
            f"{report['train_seconds']:.0f} s |"
        )
        print(rows[-1], flush=True)
    print(
        "| variant | flags | train tokens | agreement by depth | E[tokens/pass] "
        "| best/steps | time |"
    )
    print("| --- " * 7 + "|")
    print("\n".join(rows))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
