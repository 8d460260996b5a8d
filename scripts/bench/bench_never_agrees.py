"""A drafter that never agrees against plain decoding (not a test).

``generate``: decode tok/s of ``stream_generate`` with ``draft_source`` the
drafter (cost-aware, ``--draft-max``) against ``mtp=False``, alternating, over
the shipped chat prompts (each as one user message). The ratio is of the
totals, every prompt's tokens over every prompt's decode time (an answer of
one token weighs one token), from one process: ``--fresh`` runs each
generation in a process of its own instead (the first generation after
loading, as a user's ``mlx-mtp generate`` is; which side runs first, cold,
alternates from prompt to prompt). ``--remember``: the drafted side keeps
the drafter's history across runs, as ``mlx-mtp generate`` does
(``remembered``; delete ``$XDG_CACHE_HOME/mlx-mtp/acceptance.json`` first
to include the first contact).

``--serve``: one ``mlx-mtp serve --draft DIR --draft-source SOURCE`` process
(prompt cache and lookup memory off), asked the same chats streamed, greedy,
``--tokens`` each, one at a time (``--streams 1``) or several at once,
alternating requests with ``draft_max`` 0 (plain) and without (the drafter);
tokens over wall time of each side, medians of the paired ratios per
repetition and their median, and the geometric mean and median of every
pair (the steadier figure where one request's speed varies by 20%).

    python scripts/bench/bench_drafters.py --keep DIR   # random drafters
    python scripts/bench/bench_never_agrees.py DIR/DFlashDraftModel
        [--model M] [--source dflash] [--tokens 128] [--repeats 2] [--fresh]
        [--remember] [--costs-dir DIR]
        [--serve [--streams 1 4]]

Without a drafter (``-``), the model's own sources: ``--source mtp ngram
auto`` (each against plain in turn), e.g. on a tiny GLM whose random head
never agrees (``build_bench_model.py OUT --family glm4_moe --hidden 64
--layers 2 --disagreeable``). ``--costs-dir DIR`` keeps the probe's costs,
the rounds' corrections and the drafters' histories in ``DIR/mlx-mtp`` (as
``XDG_CACHE_HOME``): an empty folder is a first run on this machine (the
first generation probes, its rounds correct), the same folder again a later
run. The corrections stored there are printed at the end.
"""

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def generations(args, prompt: str, first: str = "plain") -> dict:
    """Plain and drafted generations of ``prompt`` in this process, ``first``
    the side that runs first (in a fresh process, the cold one)."""
    import mlx_mtp
    from mlx_mtp.prompts import encode, user_prompt

    model, tokenizer = loaded(args)
    prompt = encode(tokenizer, user_prompt(tokenizer, prompt))
    out = {}
    sides = [
        ("plain", {"mtp": False}),
        ("drafted", {"draft_source": args.source, "draft_max": args.draft_max,
                     "remember": args.remember}),  # (lookups ignore draft_max)
    ]
    for side, kw in sides if first == "plain" else sides[::-1]:
        for r in mlx_mtp.stream_generate(model, tokenizer, prompt, args.tokens, **kw):
            last = r
        out[side] = {
            "tokens": last.generation_tokens,
            "seconds": last.generation_tokens / last.generation_tps,
            "drafted": last.stats.drafted,
            "accepted": last.stats.accepted,
        }
    return out


@functools.lru_cache(maxsize=1)
def _load(model, drafter):
    import mlx_mtp

    return mlx_mtp.load(model, draft=drafter)


def loaded(args):
    """The model and drafter, loaded once per process."""
    return _load(args.model, args.drafter)


def generate_side(args, prompts):
    rows = []
    for rep in range(args.repeats):
        for i, prompt in enumerate(prompts):
            if args.fresh:
                # the side that runs cold alternates
                first = "plain" if (rep + i) % 2 == 0 else "drafted"
                cmd = [sys.executable, __file__, args.drafter or "-", "--one", str(i),
                       "--first", first,
                       "--source", args.source, "--tokens", str(args.tokens),
                       "--draft-max", str(args.draft_max)]  # fmt: skip
                if args.remember:
                    cmd.append("--remember")
                if args.model:
                    cmd += ["--model", args.model]
                done = subprocess.run(cmd, capture_output=True, text=True, check=True)
                row = json.loads(done.stdout.strip().splitlines()[-1])
            else:
                row = generations(args, prompt)
            rows.append(row)
            p, d = row["plain"], row["drafted"]
            print(f"{rep}.{i}: plain {p['tokens']} tokens {p['tokens'] / p['seconds']:.2f}"
                  f" tok/s, {args.source} {d['tokens'] / d['seconds']:.2f} tok/s, "
                  f"drafted {d['drafted']}, accepted {d['accepted']}",
                  flush=True)  # fmt: skip
    total = {s: (sum(r[s]["tokens"] for r in rows), sum(r[s]["seconds"] for r in rows))
             for s in ("plain", "drafted")}  # fmt: skip
    speed = {s: n / t for s, (n, t) in total.items()}
    print(f"total: plain {speed['plain']:.2f} tok/s, {args.source} "
          f"{speed['drafted']:.2f} tok/s: {speed['drafted'] / speed['plain']:.3f} of plain "
          f"({total['plain'][0]} and {total['drafted'][0]} tokens, "
          f"{'fresh processes' if args.fresh else 'one process'})")  # fmt: skip


def serve_side(args, prompts):
    from bench_vs_mlx_lm_server import free_port, run, start  # the server bench's

    if args.model is None:
        from mlx_mtp.convert.default_model import default_model_path

        args.model = str(default_model_path())
    port = free_port()
    drafter = ["--draft", args.drafter] if args.drafter else []
    cmd = [sys.executable, "-m", "mlx_mtp", "serve", "--model", args.model,
           *drafter, "--draft-source", args.source,
           "--draft-max", str(args.draft_max), "--port", str(port),
           "--prompt-cache-entries", "0", "--lookup-memory-mb", "0",
           "--max-batch", str(max(args.streams))]  # fmt: skip
    server = start(cmd, port)
    sides = {"plain": {"draft_max": 0}, "drafted": {}}
    ratios = {n: [] for n in args.streams}
    pairs = {n: [] for n in args.streams}  # every group's drafted / plain
    try:
        for side in sides:  # warm up
            run(server, port, prompts[:1], 8, sides[side])
        for rep in range(args.repeats):
            for n in args.streams:
                groups = [prompts[i : i + n] for i in range(0, len(prompts), n)]
                got = {}
                order = list(sides) if rep % 2 == 0 else list(sides)[::-1]
                for group in groups:
                    for side in order:
                        speed, _ = run(server, port, group, args.tokens, sides[side])
                        got.setdefault(side, []).append(speed)
                paired = [d / p for d, p in zip(got["drafted"], got["plain"])]
                pairs[n] += paired
                ratio = statistics.median(paired)
                ratios[n].append(ratio)
                print(f"{rep}: {n} streams, plain {statistics.median(got['plain']):.2f}"
                      f" tok/s, drafted {statistics.median(got['drafted']):.2f}, "
                      f"paired {ratio:.3f}", flush=True)  # fmt: skip
    finally:
        server.send_signal(2)
        server.wait(timeout=60)
    for n, rs in ratios.items():
        every = pairs[n]
        print(f"serve, {n} streams: {args.source} / plain {statistics.median(rs):.3f} "
              f"(median of {len(rs)} repetitions); over all {len(every)} pairs: "
              f"geometric mean {statistics.geometric_mean(every):.3f}, "
              f"median {statistics.median(every):.3f}")  # fmt: skip


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("drafter", nargs="?", help="a drafter folder ('-': none)")
    ap.add_argument("--model", default=None)
    ap.add_argument("--source", nargs="+", default=None,
                    help="each against plain in turn (default: dflash with a "
                    "drafter, else mtp ngram auto)")  # fmt: skip
    ap.add_argument("--costs-dir", type=Path, default=None,
                    help="XDG_CACHE_HOME of the measured costs and histories")
    ap.add_argument("--draft-max", type=int, default=7)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--fresh", action="store_true")
    ap.add_argument("--remember", action="store_true",
                    help="as the command line's generate: each run starts from "
                    "the drafter's history the runs before left")  # fmt: skip
    ap.add_argument("--serve", action="store_true")
    ap.add_argument("--streams", type=int, nargs="+", default=[1])
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--first", default="plain", help=argparse.SUPPRESS)
    args = ap.parse_args()
    from mlx_mtp.prompts import load_prompts

    if args.drafter == "-":
        args.drafter = None
    if args.costs_dir is not None:
        if args.model is None:  # the default model stays where it was built
            from mlx_mtp.convert.default_model import default_model_path

            args.model = str(default_model_path())
        args.costs_dir.mkdir(parents=True, exist_ok=True)
        os.environ["XDG_CACHE_HOME"] = str(args.costs_dir.resolve())
    prompts = [p.prompt for p in load_prompts()]
    if args.one is not None:
        args.source = args.source[0]
        print(json.dumps(generations(args, prompts[args.one], args.first)))
        return
    sources = args.source or (["dflash"] if args.drafter else ["mtp", "ngram", "auto"])
    for source in sources:
        args.source = source
        if args.serve:
            serve_side(args, prompts)
        else:
            generate_side(args, prompts)
    if args.costs_dir is not None:
        show_corrections(args.costs_dir)


def show_corrections(folder: Path) -> None:
    """The rounds' corrections stored in ``folder``: per source and width,
    the median round cost in plain steps, beside the probe's verify."""
    try:
        entries = json.loads((folder / "mlx-mtp" / "costs.json").read_text())
    except (OSError, ValueError):
        print("no costs stored")
        return
    for e in entries:
        if e.get("context"):
            continue
        verify = (e.get("costs") or {}).get("verify")
        print(f"probe ({e['machine']['blas']}): verify {verify}")
        rounds = e.get("rounds") or {}
        for key, rows in (rounds.get("sources") or {}).items():
            widths = {}
            for w, r in rows:
                widths.setdefault(w, []).append(r)
            medians = ", ".join(f"{w}: {statistics.median(rs):.2f} ({len(rs)})"
                                for w, rs in sorted(widths.items()))  # fmt: skip
            print(f"  rounds of {key}, by width (samples): {medians}")


if __name__ == "__main__":
    main()
