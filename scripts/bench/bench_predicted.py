"""Drafts the client predicts and drafts from earlier requests, as served (not
a test): ``accepted_prediction_tokens`` for a prediction equal to the answer,
and the same request twice with the lookup memory on and off.

Each side runs in a fresh ``mlx-mtp serve`` process (prompt cache off, so
that a request sent again gains only from the memory), warmed up with one
short request of another prompt. Per prompt and repetition:

1. plain: the answer ``A`` (greedy, ``--max-tokens``), memory off;
2. prediction: the same request with ``prediction = A``, memory off: the
   share of the completion's tokens accepted from the prediction, the text
   (it must be ``A``) and the decode speed against 1.;
3. memory on: the request twice; the second's share of tokens accepted from
   the memory and its speed against the first's;
4. memory off: the request twice; the second drafts nothing from a memory,
   and its speed is the first's (its draft counts may differ a little: the
   draft length follows measured round times).

Speeds are decode tokens per second from the answers' ``timings``
(``predicted_n / predicted_ms``), and wall time per request as a client
sees it. The table shows medians over ``--repeats``.

    python scripts/bench/bench_predicted.py [--model PATH] [--repeats 3]
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        OPENBLAS_NUM_THREADS=1 python scripts/bench/bench_predicted.py --checkout .

Without ``--model``, the default model. On MLX's bundled reference BLAS no
lookup can pay (a verify over t tokens costs about t steps), so nothing is
drafted there: run it with OpenBLAS preloaded (docs/performance.md).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_serve import free_port  # noqa: E402

# an edit whose answer mostly repeats its input (what editors predict), prose,
# and a list
PROMPTS = [
    "Add type hints to this function and change nothing else:\n\n"
    "def mean(values):\n    total = 0\n    for v in values:\n        total += v\n"
    "    return total / len(values)\n",
    "Write a short story about a lighthouse keeper.",
    "List ten uses for a paperclip, with a sentence each.",
]
WARM = "Say hello."


class Server:
    """A fresh ``mlx-mtp serve`` on a free port, stopped on exit."""

    def __init__(self, model: Path, memory_mb: int, checkout):
        self.port = free_port()
        cmd = [sys.executable, "-m", "mlx_mtp", "serve", "--model", str(model),
               "--port", str(self.port), "--prompt-cache-entries", "0",
               "--lookup-memory-mb", str(memory_mb)]  # fmt: skip
        env = dict(os.environ)
        if checkout is not None:  # this checkout's mlx_mtp, not an installed one
            env["PYTHONPATH"] = str(checkout.resolve())
        self.process = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            cwd=tempfile.gettempdir(), env=env,
        )  # fmt: skip
        for _ in range(1200):
            try:
                urllib.request.urlopen(self.url("/health"), timeout=1)
                return
            except OSError:
                if self.process.poll() is not None:
                    sys.exit(
                        f"error: serve did not start:\n{self.process.stderr.read()}"
                    )
                time.sleep(0.1)
        self.process.kill()
        sys.exit("error: serve did not start in 120 s")

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def ask(self, prompt: str, max_tokens: int, **extra) -> dict:
        """The answer, with ``wall`` (seconds) added."""
        body = {"messages": [{"role": "user", "content": prompt}],
                "max_tokens": max_tokens, "temperature": 0.0, **extra}  # fmt: skip
        request = urllib.request.Request(
            self.url("/v1/chat/completions"),
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        tic = time.perf_counter()
        with urllib.request.urlopen(request, timeout=3600) as r:
            answer = json.loads(r.read())
        answer["wall"] = time.perf_counter() - tic
        return answer

    def __enter__(self):
        self.ask(WARM, 8)
        return self

    def __exit__(self, *exc):
        self.process.send_signal(2)
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()


def speed(answer: dict) -> float:
    t = answer["timings"]
    return t["predicted_n"] / max(t["predicted_ms"], 1e-9) * 1e3


def share(answer: dict, source: str) -> float:
    usage = answer["usage"]
    return (
        usage["mtp"]["by_source"].get(source, {}).get("accepted", 0)
        / usage["completion_tokens"]
    )


def text(answer: dict) -> str:
    return answer["choices"][0]["message"]["content"]


def once(model, prompt: str, args) -> dict:
    """One repetition of the four sides for ``prompt``."""
    n = args.max_tokens
    with Server(model, 0, args.checkout) as s:
        plain = s.ask(prompt, n)
    with Server(model, 0, args.checkout) as s:
        prediction = {"type": "content", "content": text(plain)}
        predicted = s.ask(prompt, n, prediction=prediction)
    with Server(model, args.memory_mb, args.checkout) as s:
        on = [s.ask(prompt, n), s.ask(prompt, n)]
    with Server(model, 0, args.checkout) as s:
        off = [s.ask(prompt, n), s.ask(prompt, n)]
    details = predicted["usage"]["completion_tokens_details"]
    return {
        "tokens": plain["usage"]["completion_tokens"],
        "plain tok/s": speed(plain),
        "plain wall": plain["wall"],
        "prediction same text": text(predicted) == text(plain),
        "prediction accepted": details["accepted_prediction_tokens"]
        / predicted["usage"]["completion_tokens"],
        "prediction rejected": details["rejected_prediction_tokens"],
        "prediction speed-up": speed(predicted) / speed(plain),
        "prediction wall ratio": plain["wall"] / predicted["wall"],
        "memory on: second from memory": share(on[1], "memory"),
        "memory on: speed-up": speed(on[1]) / speed(on[0]),
        "memory on: wall ratio": on[0]["wall"] / on[1]["wall"],
        "memory on: same text": text(on[1]) == text(on[0]),
        "memory off: no memory drafts": "memory"
        not in off[1]["usage"]["mtp"]["by_source"],
        "memory off: same text": text(off[1]) == text(off[0]),
        "memory off: speed ratio": speed(off[1]) / speed(off[0]),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=len(PROMPTS),
                    help=f"the first N of the {len(PROMPTS)} prompts")  # fmt: skip
    ap.add_argument(
        "--memory-mb",
        type=int,
        default=64,
        help="the lookup memory's size on the 'memory on' side",
    )
    ap.add_argument("--checkout", type=Path, help="run this checkout's mlx_mtp")
    ap.add_argument("--json", type=Path, help="write every run here")
    args = ap.parse_args()
    if args.model is None:
        from mlx_mtp.convert.default_model import default_model_path

        args.model = default_model_path(print)
    model = args.model.resolve()
    runs = []
    for rep in range(args.repeats):
        for i, prompt in enumerate(PROMPTS[: args.prompts]):
            row = {"rep": rep, "prompt": i, **once(model, prompt, args)}
            runs.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    if args.json:
        args.json.write_text(json.dumps(runs, indent=1))
    blas = "OpenBLAS preloaded" if "openblas" in os.environ.get("LD_PRELOAD", "") \
        else "stock BLAS"  # fmt: skip
    print(f"model: {model.name}, {args.max_tokens} tokens, greedy chat, {blas}, "
          f"fresh serve processes, medians of {args.repeats} repetitions")  # fmt: skip
    keys = [k for k in runs[0] if k not in ("rep", "prompt")]
    print("| prompt | " + " | ".join(keys) + " |")
    print("|" + " --- |" * (len(keys) + 1))
    for i in range(args.prompts):
        rs = [r for r in runs if r["prompt"] == i]
        cells = []
        for k in keys:
            values = [r[k] for r in rs]
            if isinstance(values[0], bool):
                cells.append("yes" if all(values) else "NO")
            else:
                cells.append(f"{statistics.median(values):.3g}")
        print(f"| {i} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
