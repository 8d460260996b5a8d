"""Total tokens/s at 1, 2, 4, 8 concurrent streams: mlx-lm's batch generation
without MTP against ``mlx-mtp serve`` with MTP, on the same model (not a test).

The server runs in a subprocess (``python -m mlx_mtp serve``, prompt cache
off); N clients send one greedy completion each at the same moment and the
clock stops when the last answer is in. mlx-lm's side is ``batch_generate``
over the same N prompts in this process. Both clocks include reading the
prompts. Runs are interleaved (mlx-lm, server without drafts, server with
MTP, for each N, then again), and the table shows medians. On a shared
machine wall-clock numbers swing with other processes' load, so the table
also shows tokens per CPU-second of the process that generates (the server
process, or this one for mlx-lm; Linux only), which such load hardly moves.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        python scripts/bench/bench_serve.py [--model PATH] [--max-tokens 64] [--repeats 3]

Without ``--model``, the default model. For the memory-bound regime on a CPU,
preload OpenBLAS and use float32 weights (e.g. ``scripts/bench/build_bench_model.py``).
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a bicycle stays upright.",
    "List ten uses for a paperclip, with a sentence each.",
    "Describe the water cycle to a ten-year-old.",
    "What makes a good cup of tea? Give step by step advice.",
    "Summarise the plot of a heist film you invent.",
    "Teach me the rules of chess in plain words.",
    "Write a letter from a cat to its owner.",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: Path, port: int, args, checkout=None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "mlx_mtp", "serve", "--model", str(model.resolve())]
    cmd += ["--port", str(port), "--max-batch", str(max(args.streams))]
    cmd += ["--prompt-cache-entries", "0", "--draft-max", str(args.draft_max)]
    if args.fixed_draft:
        cmd.append("--fixed-draft")
    if args.draft is not None and checkout is None:
        cmd += ["--draft", str(args.draft.resolve())]
    # not from a checkout, whose mlx_mtp/ would shadow the installed package
    # (or the one ``checkout`` names)
    env = dict(os.environ)
    if checkout is not None:
        env["PYTHONPATH"] = str(Path(checkout).resolve())
    server = subprocess.Popen(
        cmd, stderr=subprocess.PIPE, text=True, cwd=tempfile.gettempdir(), env=env
    )
    for _ in range(1200):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
            return server
        except OSError:
            if server.poll() is not None:
                sys.exit(f"error: the server did not start:\n{server.stderr.read()}")
            time.sleep(0.1)
    server.kill()
    sys.exit("error: the server did not start in 120 s")


def ask(port: int, tokens, max_tokens: int, draft_max: int) -> dict:
    body = {"prompt": tokens, "max_tokens": max_tokens, "temperature": 0.0,
            "draft_max": draft_max}  # fmt: skip
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=3600) as r:
        return json.loads(r.read())["usage"]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` (0 where /proc is missing)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_server(server, port, prompts, max_tokens, draft_max):
    """(tokens/s, tokens per CPU-second, usages) for ``prompts`` sent at once."""
    usages = [None] * len(prompts)

    def one(i):
        usages[i] = ask(port, prompts[i], max_tokens, draft_max)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    cpu, tic = cpu_seconds(server.pid), time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - tic
    cpu = cpu_seconds(server.pid) - cpu
    tokens = sum(u["completion_tokens"] for u in usages)
    return tokens / seconds, tokens / cpu if cpu else 0.0, usages


def run_mlx_lm(model, tokenizer, prompts, max_tokens):
    """(tokens/s, tokens per CPU-second) of mlx-lm's batch generation."""
    from mlx_lm.generate import batch_generate

    n = len(prompts)
    cpu, tic = time.process_time(), time.perf_counter()
    r = batch_generate(
        model, tokenizer, prompts, max_tokens=max_tokens,
        completion_batch_size=n, prefill_batch_size=n,
    )  # fmt: skip
    seconds, cpu = time.perf_counter() - tic, time.process_time() - cpu
    tokens = r.stats.generation_tokens
    return tokens / seconds, tokens / cpu


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path)
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--draft-max", type=int, default=3)
    ap.add_argument("--fixed-draft", action="store_true", help="serve --fixed-draft")
    ap.add_argument(
        "--draft",
        type=Path,
        help="serve --draft FOLDER: its drafts against plain (a drafter that never "
        "agrees: scripts/bench/bench_drafters.py --keep)",
    )
    ap.add_argument("--json", type=Path, help="write every run here")
    ap.add_argument(
        "--baseline",
        type=Path,
        help="another checkout of mlx-mtp: its server runs too, interleaved, "
        "and a second table compares the two",
    )
    args = ap.parse_args()

    import mlx_mtp
    from mlx_mtp.convert.default_model import default_model_path

    path = args.model or default_model_path(print)
    loaded, tokenizer = mlx_mtp.load(path)
    model = loaded.target.model  # mlx-lm's own model object
    templated = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
        )
        if getattr(tokenizer, "chat_template", None)
        else p
        for p in PROMPTS
    ]
    prompts = [tokenizer.encode(t) for t in templated]
    prompts = (prompts * (1 + max(args.streams) // len(prompts)))[: max(args.streams)]

    port = free_port()
    server = start_server(path, port, args)
    old = old_port = None
    if args.baseline is not None:
        old_port = free_port()
        old = start_server(path, old_port, args, args.baseline)
    runs = []
    try:
        # warm both sides up (kernels, allocator, the server's draft timings)
        run_mlx_lm(model, tokenizer, prompts[:2], 8)
        for n in args.streams:
            run_server(server, port, prompts[:n], 8, args.draft_max)
            if old is not None:
                run_server(old, old_port, prompts[:n], 8, args.draft_max)
        for rep in range(args.repeats):
            for n in args.streams:
                sub = prompts[:n]
                base, base_cpu = run_mlx_lm(model, tokenizer, sub, args.max_tokens)
                plain, plain_cpu, _ = run_server(server, port, sub, args.max_tokens, 0)
                mtp, mtp_cpu, usages = run_server(
                    server, port, sub, args.max_tokens, args.draft_max
                )
                drafted = sum(u["mtp"]["drafted"] for u in usages)
                accepted = sum(u["mtp"]["accepted"] for u in usages)
                tokens = sum(u["completion_tokens"] for u in usages)
                rounds = sum(u["mtp"]["rounds"] for u in usages)
                runs.append(dict(rep=rep, streams=n, mlx_lm=base, serve_plain=plain,
                                 serve_mtp=mtp, mlx_lm_cpu=base_cpu,
                                 serve_plain_cpu=plain_cpu, serve_mtp_cpu=mtp_cpu,
                                 drafted=drafted, accepted=accepted, tokens=tokens,
                                 rounds=rounds))  # fmt: skip
                if old is not None:
                    runs[-1]["old_plain"], runs[-1]["old_plain_cpu"], _ = run_server(
                        old, old_port, sub, args.max_tokens, 0
                    )
                    runs[-1]["old_mtp"], runs[-1]["old_mtp_cpu"], _ = run_server(
                        old, old_port, sub, args.max_tokens, args.draft_max
                    )
                print(
                    f"rep {rep} streams {n}: mlx-lm {base:.1f}, serve k=0 {plain:.1f}, "
                    f"serve MTP {mtp:.1f} tok/s; per CPU-second {base_cpu:.1f}, "
                    f"{plain_cpu:.1f}, {mtp_cpu:.1f}",
                    file=sys.stderr,
                    flush=True,
                )
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health") as r:
            lengths = json.loads(r.read())["draft_lengths"]
        print(f"server rounds per draft length: {lengths}", file=sys.stderr)
    finally:
        for s in (server, old):
            if s is not None:
                s.terminate()
                s.wait()
    if args.json:
        args.json.write_text(json.dumps(runs, indent=1))

    blas = (
        "OpenBLAS preloaded"
        if "openblas" in os.environ.get("LD_PRELOAD", "")
        else ("stock BLAS")
    )
    print(f"model: {path}, {args.max_tokens} tokens per stream, draft_max "
          f"{args.draft_max}{' (fixed)' if args.fixed_draft else ''}, {blas}, "
          f"medians of {args.repeats}")  # fmt: skip
    print("| streams | tok/s: mlx-lm batch | serve, no drafts | serve, MTP | "
          "MTP / mlx-lm | per CPU-s: mlx-lm | serve, no drafts | serve, MTP | "
          "MTP / mlx-lm | acceptance | tokens per round |")  # fmt: skip
    print("|" + " --- |" * 11)
    for n in args.streams:
        rs = [r for r in runs if r["streams"] == n]

        def med(key):
            return statistics.median(r[key] for r in rs)

        ratio = statistics.median(r["serve_mtp"] / r["mlx_lm"] for r in rs)
        cpu_ratio = statistics.median(
            r["serve_mtp_cpu"] / r["mlx_lm_cpu"] if r["mlx_lm_cpu"] else 0 for r in rs
        )
        acc = sum(r["accepted"] for r in rs) / max(1, sum(r["drafted"] for r in rs))
        per_round = sum(r["tokens"] for r in rs) / max(1, sum(r["rounds"] for r in rs))
        print(f"| {n} | {med('mlx_lm'):.1f} | {med('serve_plain'):.1f} | "
              f"{med('serve_mtp'):.1f} | {ratio:.2f} | {med('mlx_lm_cpu'):.1f} | "
              f"{med('serve_plain_cpu'):.1f} | {med('serve_mtp_cpu'):.1f} | "
              f"{cpu_ratio:.2f} | {acc:.2f} | {per_round:.2f} |")  # fmt: skip
    if args.baseline is not None:
        compare(runs, args.streams, args.baseline)


def compare(runs, streams, baseline):
    """This checkout's server against the baseline's, medians of paired ratios."""
    print(f"\nthis checkout against {baseline} (paired within each repetition)")
    print("| streams | no drafts: before | after | after / before | "
          "MTP: before | after | after / before | per CPU-s, MTP: after / before |")
    print("|" + " --- |" * 8)
    for n in streams:
        rs = [r for r in runs if r["streams"] == n]

        def med(f):
            return statistics.median(f(r) for r in rs)

        print(f"| {n} | {med(lambda r: r['old_plain']):.1f} | "
              f"{med(lambda r: r['serve_plain']):.1f} | "
              f"{med(lambda r: r['serve_plain'] / r['old_plain']):.3f} | "
              f"{med(lambda r: r['old_mtp']):.1f} | {med(lambda r: r['serve_mtp']):.1f} | "
              f"{med(lambda r: r['serve_mtp'] / r['old_mtp']):.3f} | "
              f"{med(lambda r: r['serve_mtp_cpu'] / max(r['old_mtp_cpu'], 1e-9)):.3f} |")  # fmt: skip


if __name__ == "__main__":
    main()
