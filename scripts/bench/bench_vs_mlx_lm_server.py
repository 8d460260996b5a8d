"""Total tokens/s at 1, 4 and 8 concurrent streams: ``mlx_lm.server`` against
``mlx-mtp serve``, both as processes on the same model (not a test).

Each run sends N streamed chat completions (greedy, ``max_tokens`` each) at
the same moment and stops the clock when the last stream ends, so it counts
what a client sees: prompt reading, scheduling, decoding, detokenizing and
SSE framing. Servers run with their prompt caches off and are asked in
turn, the order rotating each repetition (mlx_lm.server, mlx-mtp serve with
no drafts, mlx-mtp serve with drafts); the table shows medians of the
ratios paired within a repetition, so that load from other processes on a
shared machine moves both sides alike. Tokens per CPU-second of each server
process are shown too (Linux).

    python scripts/bench/bench_vs_mlx_lm_server.py [--model PATH] [--repeats 5]
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        python scripts/bench/bench_vs_mlx_lm_server.py --model F32_MODEL

Without ``--model``, the default model. ``--py-spy PATH`` samples the
mlx-mtp server with py-spy (every thread, in its ``--format raw``, for
``flamegraph.pl`` or a quick ``sort``) while the repetitions run.

``--lookup-memory-mb N`` sets serve's lookup memory of earlier requests (0:
off; without it, serve's default). The repetitions send the same prompts, so
with the memory on, the requests after the first of each prompt can draft
their answers from it (what a client that retries gains); ``--vary-prompts``
ends every prompt with its repetition and stream, so that no request is sent
twice (answers to the same question may still share passages, which the
memory then drafts). The flag reaches this checkout's serve only: a
``--baseline`` from before the memory has none.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_serve import PROMPTS, cpu_seconds, free_port  # noqa: E402


def start(cmd, port: int, env=None) -> subprocess.Popen:
    server = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        cwd=tempfile.gettempdir(), env=env,
    )  # fmt: skip
    for _ in range(1200):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=1)
            return server
        except OSError:
            if server.poll() is not None:
                sys.exit(f"error: {cmd[2]} did not start:\n{server.stderr.read()}")
            time.sleep(0.1)
    server.kill()
    sys.exit(f"error: {cmd[2]} did not start in 120 s")


def serve(model: Path, args, checkout, memory_mb=None) -> tuple:
    """An ``mlx-mtp serve`` process (``checkout``'s mlx_mtp, else the
    installed one) and its port; ``memory_mb``: its ``--lookup-memory-mb``
    (None: its default, or a checkout from before the flag)."""
    port = free_port()
    mtp = [sys.executable, "-m", "mlx_mtp", "serve", "--model", str(model),
           "--port", str(port), "--prompt-cache-entries", "0",
           "--max-batch", str(max(args.streams)), "--draft-max",
           str(args.draft_max)]  # fmt: skip
    if memory_mb is not None:
        mtp += ["--lookup-memory-mb", str(memory_mb)]
    env = dict(os.environ)
    if checkout is not None:  # that checkout's mlx_mtp, not an installed one
        env["PYTHONPATH"] = str(checkout.resolve())
    return start(mtp, port, env), port


def servers(model: Path, args):
    """(mlx_lm.server, mlx-mtp serve) processes and their ports."""
    lm_port = free_port()
    lm = [sys.executable, "-m", "mlx_lm", "server", "--model", str(model),
          "--port", str(lm_port), "--prompt-cache-size", "0",
          "--decode-concurrency", str(max(args.streams)),
          "--log-level", "WARNING"]  # fmt: skip
    memory = args.lookup_memory_mb
    return (start(lm, lm_port), lm_port), serve(model, args, args.checkout, memory)


def stream_one(port: int, prompt: str, max_tokens: int, extra: dict) -> int:
    """Completion tokens of one streamed chat answer."""
    # no "model": mlx_lm.server would load a model of that name
    body = {"messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}, **extra}  # fmt: skip
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    tokens = 0
    with urllib.request.urlopen(request, timeout=3600) as r:
        for line in r:
            line = line.strip()
            if line.startswith(b"data: {"):
                usage = json.loads(line[6:]).get("usage")
                if usage:
                    tokens = usage["completion_tokens"]
    return tokens


def run(process, port, prompts, max_tokens, extra):
    """(tokens/s, tokens per CPU-second of the server) for ``prompts`` at once."""
    counts = [0] * len(prompts)

    def one(i):
        counts[i] = stream_one(port, prompts[i], max_tokens, extra)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    cpu, tic = cpu_seconds(process.pid), time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - tic
    cpu = cpu_seconds(process.pid) - cpu
    return sum(counts) / seconds, sum(counts) / cpu if cpu else 0.0


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path)
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--draft-max", type=int, default=3)
    ap.add_argument("--checkout", type=Path, help="run this checkout's mlx_mtp")
    ap.add_argument("--baseline", type=Path,
                    help="also serve this checkout's mlx_mtp (before a change), "
                    "its two sides interleaved with the others")  # fmt: skip
    ap.add_argument("--py-spy", type=Path, help="py-spy's raw samples of serve here")
    ap.add_argument("--json", type=Path, help="write every run here")
    ap.add_argument("--lookup-memory-mb", type=int,
                    help="serve's lookup memory of earlier requests (0: off)")
    ap.add_argument("--vary-prompts", action="store_true",
                    help="end each prompt with its repetition and stream: no "
                    "request is sent twice")  # fmt: skip
    ap.add_argument("--no-warmup", action="store_true",
                    help="no warm-up: the first repetition meets fresh servers, "
                    "as a user's first requests do (in one serve process: "
                    "the first of its two sides asked)")  # fmt: skip
    args = ap.parse_args()
    if args.model is None:
        from mlx_mtp.convert.default_model import default_model_path

        args.model = default_model_path(print)
    model = args.model.resolve()
    prompts = (PROMPTS * (1 + max(args.streams) // len(PROMPTS)))[: max(args.streams)]
    (lm, lm_port), (mtp, mtp_port) = servers(model, args)
    sides = {
        "mlx_lm.server": (lm, lm_port, {}),
        "serve, no drafts": (mtp, mtp_port, {"draft_max": 0}),
        "serve, drafts": (mtp, mtp_port, {"draft_max": args.draft_max}),
    }
    base = None
    if args.baseline is not None:
        base, base_port = serve(model, args, args.baseline)
        sides["base, no drafts"] = (base, base_port, {"draft_max": 0})
        sides["base, drafts"] = (base, base_port, {"draft_max": args.draft_max})
    names = list(sides)
    runs, spy = [], None
    try:
        for name in names if not args.no_warmup else []:
            for n in args.streams:  # warm up: kernels, allocators, draft timings
                run(*sides[name][:2], prompts[:n], 8, sides[name][2])
        if args.py_spy is not None:
            spy = subprocess.Popen(
                ["py-spy", "record", "--pid", str(mtp.pid), "--format", "raw",
                 "--output", str(args.py_spy), "--nonblocking", "--threads",
                 "--rate", "200"],
                stdout=subprocess.DEVNULL,
            )  # fmt: skip
        for rep in range(args.repeats):
            order = names[rep % len(names) :] + names[: rep % len(names)]
            for n in args.streams:
                row = {"rep": rep, "streams": n}
                for name in order:
                    process, port, extra = sides[name]
                    asked = prompts[:n]
                    if args.vary_prompts:
                        asked = [f"{p} ({name}, {rep}.{n}.{i})"
                                 for i, p in enumerate(asked)]  # fmt: skip
                    row[name], row[name + " cpu"] = run(
                        process, port, asked, args.max_tokens, extra
                    )
                runs.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
    finally:
        for process in (spy, lm, mtp, base):
            if process is None:
                continue
            process.send_signal(2)  # SIGINT: py-spy writes its samples then
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
    if args.json:
        args.json.write_text(json.dumps(runs, indent=1))
    table(runs, args, model)


def table(runs, args, model):
    blas = "OpenBLAS preloaded" if "openblas" in os.environ.get("LD_PRELOAD", "") \
        else "stock BLAS"  # fmt: skip
    memory = "default" if args.lookup_memory_mb is None else args.lookup_memory_mb
    print(f"model: {model.name}, {args.max_tokens} tokens per stream, streamed "
          f"chat, greedy, draft_max {args.draft_max}, {blas}, lookup memory "
          f"{memory} MiB{', varied prompts' if args.vary_prompts else ''}, medians "
          f"of {args.repeats} interleaved repetitions")  # fmt: skip
    print("| streams | mlx_lm.server tok/s | serve, no drafts | serve, drafts | "
          "no drafts / mlx_lm | drafts / mlx_lm | per CPU-s: no drafts / mlx_lm | "
          "drafts / mlx_lm |")  # fmt: skip
    print("|" + " --- |" * 8)
    lm, plain, drafts = "mlx_lm.server", "serve, no drafts", "serve, drafts"
    for n in args.streams:
        rs = [r for r in runs if r["streams"] == n]

        def med(f):
            return statistics.median(f(r) for r in rs)

        def ratio(a, b):
            return med(lambda r: r[a] / max(r[b], 1e-9))

        print(f"| {n} | {med(lambda r: r[lm]):.1f} | {med(lambda r: r[plain]):.1f} | "
              f"{med(lambda r: r[drafts]):.1f} | {ratio(plain, lm):.3f} | "
              f"{ratio(drafts, lm):.3f} | {ratio(plain + ' cpu', lm + ' cpu'):.3f} | "
              f"{ratio(drafts + ' cpu', lm + ' cpu'):.3f} |")  # fmt: skip
    if "base, drafts" in runs[0]:
        print("\nthis checkout against the baseline, paired (tok/s; per CPU-s):")
        print("| streams | no drafts | drafts | no drafts, CPU | drafts, CPU |")
        print("|" + " --- |" * 5)
        for n in args.streams:
            rs = [r for r in runs if r["streams"] == n]

            def paired(a, b):
                return statistics.median(r[a] / max(r[b], 1e-9) for r in rs)

            print(f"| {n} | {paired(plain, 'base, no drafts'):.3f} | "
                  f"{paired(drafts, 'base, drafts'):.3f} | "
                  f"{paired(plain + ' cpu', 'base, no drafts cpu'):.3f} | "
                  f"{paired(drafts + ' cpu', 'base, drafts cpu'):.3f} |")  # fmt: skip

if __name__ == "__main__":
    main()
