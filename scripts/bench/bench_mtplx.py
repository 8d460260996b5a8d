"""mlx-mtp against MTPLX at fixed depths on one model, output compared (not a test).

MTPLX (PyPI ``mtplx``) is installed in a separate virtual environment, never
as a dependency of mlx-mtp:

    python3 -m venv /somewhere/mtplx && /somewhere/mtplx/bin/pip install mtplx

On Linux it needs two things: MLX and mlx-lm visible to that environment (a
``.pth`` file naming the site-packages that hold them), and a stand-in for
macOS's ``libSystem.B.dylib``, which MTPLX's ``route_tape`` loads at import
for its clock: this script compiles one (``cc`` needed) and points MTPLX's
``ctypes.CDLL`` call at it. MTPLX runs with its ``batched`` verify strategy:
its default for Qwen3-Next (``capture_commit``) reads Qwen3.5's split
projections (``in_proj_qkv``), which Qwen3-Next's layers do not have.

Each repetition runs one process per side, alternately (warm-up, then every
prompt at every depth, greedy); printed are median tokens per second (and per
CPU second) per depth and side, and whether every side emitted mlx-lm's tokens.

    python scripts/bench/bench_mtplx.py MODEL --mtplx-python /somewhere/mtplx/bin/python
        [--depths 1,2,3] [--tokens 64] [--reps 3]
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

STUB = r"""
#include <stdint.h>
#include <string.h>
#include <time.h>
struct tb { uint32_t numer, denom; };
int mach_timebase_info(struct tb *t) { t->numer = 1; t->denom = 1; return 0; }
uint64_t mach_continuous_time(void) {
  struct timespec ts; clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}
int sysctlbyname(const char *name, void *old, size_t *len, void *new_, size_t n) {
  if (old && len && *len) { strncpy(old, "linux", *len - 1); ((char *)old)[*len - 1] = 0; }
  return 0;
}
"""


def prompts(n: int, length: int = 40):
    return [
        [(a * i + b) % 256 for i in range(length)]
        for a, b in ((7, 3), (13, 5), (31, 11))
    ][:n]


def run_mtplx(args):
    import ctypes

    stub = os.environ["MLX_MTP_LIBSYSTEM_STUB"]
    init = ctypes.CDLL.__init__

    def patched(self, name, *a, **kw):
        if name == "/usr/lib/libSystem.B.dylib":
            name = stub
        init(self, name, *a, **kw)

    ctypes.CDLL.__init__ = patched
    from mtplx.generation import generate_ar, generate_mtpk
    from mtplx.runtime import load
    from mtplx.sampling import SamplerConfig

    rt = load(args.model, mtp=True)
    greedy = SamplerConfig(temperature=0.0, top_p=1.0, top_k=0)
    kw = dict(sampler=greedy, draft_sampler=greedy, verify_strategy="batched")

    def one(p, d):
        if d == 0:
            return generate_ar(rt, p, max_tokens=args.tokens, sampler=greedy)
        return generate_mtpk(rt, p, max_tokens=args.tokens, speculative_depth=d, **kw)

    return run_side(one, args)


def run_ours(args):
    import mlx_mtp
    from mlx_mtp.adaptive import FixedDraft
    from mlx_mtp.sampling import make_verifier
    from mlx_mtp.speculative import speculative_generate_step

    model = mlx_mtp.load_model(args.model)

    class Out:
        pass

    def one(p, d):
        o = Out()
        o.tokens = [
            t
            for t, _ in speculative_generate_step(
                p,
                model,
                max_tokens=args.tokens,
                drafts=FixedDraft(d),
                verifier=make_verifier(),
            )
        ]
        return o

    return run_side(one, args)


def run_side(one, args):
    depths = [int(d) for d in args.depths.split(",")]
    ps = prompts(args.prompts)
    one(ps[0], depths[0])  # warm up
    rows = []
    for d in depths:
        for i, p in enumerate(ps):
            wall, cpu = time.perf_counter(), time.process_time()
            out = one(p, d)
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            tokens = [int(t) for t in out.tokens]
            rows.append(
                {
                    "depth": d,
                    "prompt": i,
                    "tokens": tokens,
                    "tps": len(tokens) / wall,
                    "cpu_tps": len(tokens) / cpu,
                }
            )
    print(json.dumps(rows))


def reference(args):
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load_model

    model, _ = load_model(Path(args.model))
    out = []
    for p in prompts(args.prompts):
        steps = generate_step(
            mx.array(p),
            model,
            max_tokens=args.tokens,
            sampler=lambda x: mx.argmax(x, axis=-1),
        )
        out.append([int(t) for t, _ in steps])
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--mtplx-python", help="python of the environment with mtplx")
    ap.add_argument("--depths", default="1,2,3")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--side", choices=["mtplx", "mlx-mtp"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.side == "mtplx":
        return run_mtplx(args)
    if args.side == "mlx-mtp":
        return run_ours(args)

    with tempfile.TemporaryDirectory() as tmp:
        src, lib = Path(tmp) / "stub.c", Path(tmp) / "libsystem_stub.so"
        src.write_text(STUB)
        subprocess.run(
            ["cc", "-shared", "-fPIC", "-O2", "-o", str(lib), str(src)], check=True
        )
        env = dict(os.environ, MLX_MTP_LIBSYSTEM_STUB=str(lib))
        common = [
            args.model,
            "--depths",
            args.depths,
            "--tokens",
            str(args.tokens),
            "--prompts",
            str(args.prompts),
        ]
        sides = {"mlx-mtp": sys.executable, "MTPLX": args.mtplx_python}
        runs = {name: [] for name in sides}
        for rep in range(args.reps):
            order = list(sides) if rep % 2 == 0 else list(sides)[::-1]
            for name in order:
                side = "mtplx" if name == "MTPLX" else "mlx-mtp"
                out = subprocess.run(
                    [sides[name], __file__, *common, "--side", side],
                    env=env,
                    capture_output=True,
                    text=True,
                )
                if out.returncode:
                    sys.exit(f"{name} failed:\n{out.stderr[-3000:]}")
                runs[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
    expected = reference(args)
    print(
        f"{args.model}: {args.tokens} tokens, {args.prompts} prompts, "
        f"{args.reps} alternating repetitions; tok/s (tok per CPU second)"
    )
    for d in [int(x) for x in args.depths.split(",")]:
        cells = []
        for name, reps in runs.items():
            rows = [r for rep in reps for r in rep if r["depth"] == d]
            same = all(r["tokens"] == expected[r["prompt"]] for r in rows)
            tps = statistics.median(r["tps"] for r in rows)
            cpu = statistics.median(r["cpu_tps"] for r in rows)
            cells.append(f"{name} {tps:7.2f} ({cpu:7.2f}) same={same}")
        print(f"D{d}: " + " | ".join(cells))


if __name__ == "__main__":
    main()
