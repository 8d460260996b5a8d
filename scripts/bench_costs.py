"""The parts of a speculative round, timed on one model (not a test).

Prints, in plain decode steps (mlx-lm's own pipelined step = 1):
``c_verify(T)`` for T = 1..K+1 (the trunk's forward over T tokens with a warm
cache, per-token states kept for T > 1 as a verify pass keeps them), the same
without keeping states (``plain(T)``), and ``c_draft(k)`` for k = 1..K (the
head's drafts, depth 1 with a catch-up over two positions). Every repetition
runs every timing once, in a rotating order; medians are printed, of wall
time and of this process's CPU time (the work done: on a CPU shared with other
jobs it does not stretch with their load; run with ``OPENBLAS_NUM_THREADS=1``
so that no BLAS thread spins while it waits). It uses only
what every version of the loop has (``draft``, ``prefill``, the trunk), so the
same script times older checkouts: ``PYTHONPATH=OLD_CHECKOUT python
scripts/bench_costs.py MODEL``.

    python scripts/bench_costs.py MODEL [--draft-max 3] [--repeats 15] [--json]
"""

import argparse
import json
import statistics
import time

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache

import mlx_mtp
from mlx_mtp.cache import rollback, start_verify
from mlx_mtp.sampling import ExactMatchVerifier
from mlx_mtp.speculative import draft, prefill


def snapshot(cache):
    marks = []
    for c in cache.trunk + cache.head:
        if isinstance(c, ArraysCache):
            marks.append(("arrays", list(c.cache)))
        else:
            marks.append(("offset", c.offset))
    return marks, [p.copy() for p in cache.pending]


def restore(cache, snap):
    marks, pending = snap
    for c, (kind, value) in zip(cache.trunk + cache.head, marks):
        if kind == "arrays":
            if hasattr(c, "rollback"):
                c.rollback(0)
            c.cache = list(value)
        else:
            rollback([c], c.offset - value)
    cache.pending = [p.copy() for p in pending]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--draft-max", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=8, help="plain steps per timing")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    model = mlx_mtp.load_model(args.model)
    vocab = model.trunk.embed_tokens.weight.shape[0]
    context = [(7 * i + 3) % min(vocab, 256) for i in range(args.context)]
    cache = model.make_cache()
    prefill(model, cache, context[:-1], 2048, True)
    y = context[-2]  # one plain step: the next draft catches up over two
    _, hidden = model.trunk(mx.array([[y]]), cache.trunk)
    cache.pending[0].push(hidden, [y])
    mx.eval(hidden, [c.state for c in cache.trunk + cache.head])
    y = context[-1]
    snap = snapshot(cache)

    def plain_steps():  # mlx-lm's generate_step: step n+1 built while n computes
        token = mx.array([y])
        logits = model.trunk.model(token[None], cache=cache.trunk)
        token = mx.argmax(logits[0, -1:], axis=-1)
        mx.async_eval(token)
        for _ in range(args.steps - 1):
            logits = model.trunk.model(token.reshape(1, 1), cache=cache.trunk)
            nxt = mx.argmax(logits[0, -1:], axis=-1)
            mx.async_eval(nxt)
            token.item()
            token = nxt
        token.item()

    def forward(t, keep):
        if keep:
            start_verify(cache.trunk)
        tokens = mx.array([y] + context[-t:-1] if t > 1 else [y])
        logits, hidden = model.trunk(tokens[None], cache.trunk)
        mx.eval(mx.argmax(logits, axis=-1), hidden)

    def drafts(k):
        out, _ = draft(model, cache, y, k, 0.0, ExactMatchVerifier(), context)
        mx.eval([d.token for d in out])

    K = args.draft_max
    jobs = [("plain", 0, plain_steps)]
    jobs += [("verify", t, lambda t=t: forward(t, True)) for t in range(1, K + 2)]
    jobs += [("nokeep", t, lambda t=t: forward(t, False)) for t in range(1, K + 2)]
    if model.head is not None:
        jobs += [("draft", k, lambda k=k: drafts(k)) for k in range(1, K + 1)]
    times = {(name, i): [] for name, i, _ in jobs}
    for rep in range(args.repeats + 1):  # the first repetition warms up
        shift = rep % len(jobs)
        for name, i, fn in jobs[shift:] + jobs[:shift]:
            tic, cpu = time.perf_counter(), time.process_time()
            fn()
            if rep:
                wall = time.perf_counter() - tic
                times[name, i].append((wall, time.process_time() - cpu))
            restore(cache, snap)
    out = {"model": args.model, "repeats": args.repeats}
    for kind, col in (("wall", 0), ("cpu", 1)):
        med = {key: statistics.median(t[col] for t in v) for key, v in times.items()}
        step = med["plain", 0] / args.steps
        out[kind] = {
            "step_ms": step * 1e3,
            "verify": [med["verify", t] / step for t in range(1, K + 2)],
            "nokeep": [med["nokeep", t] / step for t in range(1, K + 2)],
            "draft": [med["draft", k] / step for k in range(1, K + 1)]
            if model.head is not None
            else [],
        }
    if args.json:
        print(json.dumps(out))
        return
    print(f"{args.model}: medians of {args.repeats}, in plain steps")
    for kind in ("wall", "cpu"):
        o = out[kind]
        print(f"{kind}: plain step {o['step_ms']:.2f} ms")
        print("  T      " + " ".join(f"{t:7d}" for t in range(1, K + 2)))
        print("  verify " + " ".join(f"{c:7.3f}" for c in o["verify"]))
        print("  nokeep " + " ".join(f"{c:7.3f}" for c in o["nokeep"]))
        print("  k      " + " ".join(f"{k:7d}" for k in range(1, K + 1)))
        print("  draft  " + " ".join(f"{c:7.3f}" for c in o["draft"]))


if __name__ == "__main__":
    main()
