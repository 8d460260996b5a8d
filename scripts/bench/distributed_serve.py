"""``mlx-mtp serve`` over 2 processes against one process: tokens per second at
1 and 4 streams, and the collectives serving adds per round (not a test).

Both servers run at once on this machine (2 ranks by hand, MLX's ring backend
over 127.0.0.1, as ``mlx.launch --backend ring -n 2`` starts them); the
measurements alternate between them, repetitions interleaved, medians:

    python scripts/bench/distributed_serve.py MODEL [--sharding pipeline] \\
        [-n 64] [--repeats 3] [--draft-max 2]
"""

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

PROMPTS = ["Tell me about the sea.", "Count to ten.", "Why is the sky blue?",
           "Write a short poem."]  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(args, port: int, ranks: int) -> list:
    cmd = [sys.executable, "-m", "mlx_mtp", "serve", "-m", args.model,
           "--port", str(port), "--draft-max", str(args.draft_max)]  # fmt: skip
    if ranks == 1:
        return [subprocess.Popen(cmd, stderr=subprocess.DEVNULL)]
    ring = free_port()
    hosts = Path(tempfile.mkdtemp()) / "hosts.json"
    hosts.write_text(json.dumps([[f"127.0.0.1:{ring + 1 + r}"] for r in range(ranks)]))
    return [
        subprocess.Popen(
            cmd + ["--sharding", args.sharding],
            env={**os.environ, "MLX_RANK": str(r), "MLX_HOSTFILE": str(hosts)},
            stderr=subprocess.DEVNULL,
        )
        for r in range(ranks)
    ]


def get(port: int, path: str) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=60) as r:
        return json.loads(r.read())


def wait_up(port: int) -> None:
    deadline = time.monotonic() + 300
    while True:
        try:
            get(port, "/health")
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def complete(port: int, prompt: str, n: int) -> int:
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0}
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=600) as r:
        return json.loads(r.read())["usage"]["completion_tokens"]


def rate(port: int, streams: int, n: int) -> float:
    """Completion tokens per second of ``streams`` requests sent at once."""
    tokens = [0] * streams

    def one(i):
        tokens[i] = complete(port, PROMPTS[i % len(PROMPTS)], n)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(streams)]
    tic = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(tokens) / (time.perf_counter() - tic)


def totals(port: int) -> dict:
    c = get(port, "/health")["cluster"]
    return {
        "rounds": c["rounds"],
        "turns": c["turns"],
        "collectives": c["plan_collectives"] + c["decision_collectives"],
        "plan": c["plan_ms"] * c["plan_collectives"],
        "decision": c["decision_ms"] * c["decision_collectives"],
        "turn": c["turn_ms"] * c["turns"],
    }


def main():
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--sharding", default="pipeline")
    p.add_argument("-n", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--draft-max", type=int, default=2)
    args = p.parse_args()
    ports = {"one process": free_port(), "2 processes": free_port()}
    procs = {name: start(args, port, 1 if name == "one process" else 2)
             for name, port in ports.items()}  # fmt: skip
    try:
        for port in ports.values():
            wait_up(port)
        for port in ports.values():  # warm up: first shapes compile
            rate(port, 4, 8)
        speeds = {(name, s): [] for name in ports for s in (1, 4)}
        rounds = {}
        for _ in range(args.repeats):
            for streams in (1, 4):
                for name, port in ports.items():
                    if name == "2 processes":
                        before = totals(port)
                    speeds[name, streams].append(rate(port, streams, args.n))
                    if name == "2 processes":
                        after = totals(port)
                        d = {k: after[k] - before[k] for k in after}
                        rounds.setdefault(streams, []).append(d)
        report(args, speeds, rounds)
    finally:
        for group in procs.values():
            group[0].send_signal(signal.SIGINT)
        for group in procs.values():
            for proc in group:
                proc.wait(timeout=120)


def report(args, speeds, rounds) -> None:
    print(f"{args.model}, {args.sharding}, draft-max {args.draft_max}, "
          f"{args.n} tokens per request, medians of {args.repeats}")  # fmt: skip
    print("| streams | one process (tok/s) | 2 processes (tok/s) | ratio | "
          "collectives per round | plan + decision per round (ms) | turn (ms) "
          "| share |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for s in (1, 4):
        one = statistics.median(speeds["one process", s])
        two = statistics.median(speeds["2 processes", s])
        d = {k: sum(r[k] for r in rounds[s]) for k in rounds[s][0]}
        per = (d["plan"] + d["decision"]) / max(d["rounds"], 1)
        turn = d["turn"] / max(d["turns"], 1)
        share = (d["plan"] + d["decision"]) / d["turn"] if d["turn"] else 0.0
        print(f"| {s} | {one:.1f} | {two:.1f} | {two / one:.2f} | "
              f"{d['collectives'] / max(d['rounds'], 1):.2f} | {per:.2f} | "
              f"{turn:.2f} | {share:.0%} |")  # fmt: skip


if __name__ == "__main__":
    main()
