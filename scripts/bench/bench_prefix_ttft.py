"""Time to first token for a long shared prefix (7680 tokens by default), four
ways, each in fresh processes, ``--repeats`` times (not a test):

1. cold: a fresh ``mlx-mtp serve``, a request of prefix + question;
2. warm in memory: the same server, prefix + another question;
3. from disk: a fresh server process on the ``--prompt-cache-dir`` the first
   one left, prefix + a third question (its memory is empty);
4. ``generate --prompt-cache-file``: ``cache-prompt`` wrote the prefix once;
   a fresh ``generate`` continues it with a question (and, for reference,
   a fresh ``generate`` of the whole prompt).

The server's time is the wall time from sending a streamed request to its
first text chunk; ``generate``'s is its own prompt time (prompt tokens /
prompt tok/s of ``--json``), the process start and model load left out.
Also the prompt tokens each read and those the cache gave
(``cached_tokens``). Medians over the repeats.

    python scripts/bench/bench_prefix_ttft.py [MODEL] [--prefix 7680]
        [--repeats 3] [--kv-bits 8] [--json]

The prefix is the shipped bench prompts repeated to the length; the default
7680 leaves the question and the answer room in the default model's 8192
positions (the server refuses a prompt past its context: 400
``context_length_exceeded``).
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

QUESTIONS = ("\n\nSummarise the above.", "\n\nWhat came first?", "\n\nCount the parts.")


def prefix_text(tokenizer, length: int) -> str:
    from mlx_mtp.prompts import load_prompts

    text = "\n\n".join(p.prompt for p in load_prompts())
    body = text
    while len(tokenizer.encode(body)) < length:
        body += "\n\n" + text
    ids = tokenizer.encode(body)[:length]
    return tokenizer.decode(ids)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, args, model, cache_dir):
        self.port = free_port()
        cmd = [sys.executable, "-m", "mlx_mtp", "serve", "-m", model, "--port",
               str(self.port), "--prompt-cache-dir", cache_dir, "-n", "8", *args]  # fmt: skip
        self.proc = subprocess.Popen(
            cmd, stderr=subprocess.PIPE, text=True, cwd=tempfile.gettempdir(),
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip
        log = ""
        while "serving" not in log:
            line = self.proc.stderr.readline()
            if not line:
                sys.exit(f"the server did not start: {log}")
            log += line

    def first_token(self, prompt: str):
        """(seconds to the first text chunk, prompt tokens, cached tokens)."""
        body = {"model": "m", "prompt": prompt, "max_tokens": 8, "stream": True,
                "temperature": 0, "stream_options": {"include_usage": True}}  # fmt: skip
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        tic, first, usage = time.perf_counter(), None, {}
        with urllib.request.urlopen(request, timeout=3600) as r:
            for line in r:
                line = line.decode().strip()
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    first = first or time.perf_counter()
                if chunk.get("usage"):
                    usage = chunk["usage"]
        cached = usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
        return first - tic, usage.get("prompt_tokens"), cached

    def close(self):
        self.proc.terminate()
        self.proc.wait(timeout=120)


def generate(model, args, prompt: str, cache_file=None):
    cmd = [sys.executable, "-m", "mlx_mtp", "generate", "-m", model, "-p", prompt,
           "-n", "8", "--json", *args]  # fmt: skip
    if cache_file is not None:
        cmd += ["--prompt-cache-file", cache_file]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=tempfile.gettempdir())
    if out.returncode:
        sys.exit(out.stderr)
    stats = json.loads(out.stdout)["stats"]
    return stats["prompt_tokens"] / stats["prompt_tps"], stats["prompt_tokens"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?")
    ap.add_argument("--prefix", type=int, default=7680)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--kv-bits", type=int, default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    import mlx_mtp  # noqa: F401  (the tokenizer, once, in this process)
    from mlx_lm.utils import load_tokenizer

    from mlx_mtp.convert.default_model import default_model_path

    model = args.model or str(default_model_path())
    tokenizer = load_tokenizer(Path(model))
    prefix = prefix_text(tokenizer, args.prefix)
    flags = ["--kv-bits", str(args.kv_bits)] if args.kv_bits else []
    times = {k: [] for k in ("cold", "warm", "disk", "file", "whole")}
    counts = {}
    for rep in range(args.repeats):
        with tempfile.TemporaryDirectory() as folder:
            s = Server(flags, model, folder)
            try:
                t, n, c = s.first_token(prefix + QUESTIONS[0])
                times["cold"].append(t), counts.setdefault("cold", (n, c))
                t, n, c = s.first_token(prefix + QUESTIONS[1])
                times["warm"].append(t), counts.setdefault("warm", (n, c))
            finally:
                s.close()  # its entries are on disk once it stops
            s = Server(flags, model, folder)
            try:
                t, n, c = s.first_token(prefix + QUESTIONS[2])
                times["disk"].append(t), counts.setdefault("disk", (n, c))
            finally:
                s.close()
            file = str(Path(folder) / "prefix.safetensors")
            cmd = [sys.executable, "-m", "mlx_mtp", "cache-prompt", "-m", model,
                   "-p", prefix, "--prompt-cache-file", file, *flags]  # fmt: skip
            subprocess.run(cmd, check=True, capture_output=True, cwd=tempfile.gettempdir())
            t, n = generate(model, flags, QUESTIONS[0], file)
            times["file"].append(t), counts.setdefault("file", (n, None))
            t, n = generate(model, flags, prefix + QUESTIONS[0])
            times["whole"].append(t), counts.setdefault("whole", (n, None))
        print(f"repeat {rep + 1}/{args.repeats} done", file=sys.stderr)
    rows = {k: {"ttft_s": statistics.median(v), "runs": v,
                "prompt_tokens": counts[k][0], "cached_tokens": counts[k][1]}
            for k, v in times.items()}  # fmt: skip
    if args.json:
        print(json.dumps(rows))
        return
    names = {
        "cold": "serve, cold", "warm": "serve, warm in memory",
        "disk": "serve, fresh process, prefix from disk",
        "file": "generate --prompt-cache-file", "whole": "generate, whole prompt",
    }  # fmt: skip
    for k, row in rows.items():
        print(f"{names[k]:<40} {row['ttft_s']:8.3f} s  prompt {row['prompt_tokens']}"
              f" tokens, cached {row['cached_tokens']}")  # fmt: skip


if __name__ == "__main__":
    main()
