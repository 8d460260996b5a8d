"""The parts of a speculative round and the whole loop, timed on one model (not a test).

Parts, in plain decode steps (mlx-lm's own pipelined step = 1): ``c_verify(T)``
for T = 1..K+1 (the trunk's forward over T tokens with a warm cache, per-token
states kept for T > 1 as a verify pass keeps them), the same without keeping
states (``nokeep``), and ``c_draft(k)`` for k = 1..K (the head's drafts, depth
1 with a catch-up over two positions).

With ``--tokens N`` also the whole loop: greedy generations of N tokens by
mlx-lm's ``generate_step`` and by mlx-mtp drafting a fixed k = 0..K every
round (and, where the checkout has it, choosing k by cost: "auto"), on a code,
a prose and a chat prompt; per k the speed-up over mlx-lm (median of ratios
paired within a repetition), the mean accepted length E, and the bound
``E / (c_verify(k + 1) + c_draft(k))`` from this run's parts.

Every repetition runs every timing once, in a rotating order. Times are wall
time and this process's CPU time (the work done: on a CPU shared with other
jobs it does not stretch with their load; run with ``OPENBLAS_NUM_THREADS=1``
so that no BLAS thread spins while it waits). The script uses only what every
version of the loop has, so the same script times older checkouts:
``PYTHONPATH=OLD_CHECKOUT python scripts/bench/bench_costs.py MODEL``.

    python scripts/bench/bench_costs.py MODEL [--draft-max 3] [--repeats 15]
        [--tokens 64] [--json]
"""

import argparse
import inspect
import json
import statistics
import time

import mlx.core as mx
from mlx_lm.generate import generate_step

import mlx_mtp
from mlx_mtp import cache as caches
from mlx_mtp.adaptive import FixedDraft
from mlx_mtp.cache import start_verify
from mlx_mtp.sampling import ExactMatchVerifier, make_verifier
from mlx_mtp.speculative import draft, prefill, speculative_generate_step
from mlx_mtp.stats import MTPStats

CLOCKS = (time.perf_counter, time.process_time)


def timed(fn):
    start = [clock() for clock in CLOCKS]
    fn()
    return [clock() - s for clock, s in zip(CLOCKS, start)]


def per_token(steps):
    """(wall, cpu, tokens timed): the time after the first token (the first
    carries the prefill), and the tokens."""
    tokens, start = [], None
    for t in steps:
        tokens.append(int(t[0]) if isinstance(t, tuple) else int(t))
        if start is None:
            start = [clock() for clock in CLOCKS]
    times = [clock() - s for clock, s in zip(CLOCKS, start)]
    return times + [len(tokens) - 1], tokens


def snapshot(cache):
    """A function that brings ``cache`` back to now (``StreamCache.snapshot`` where
    the checkout has it, else each cache's mark and the head's pending inputs)."""
    if hasattr(cache, "snapshot"):
        snap = cache.snapshot()
        return lambda: cache.restore(snap)
    marks = [caches.mark(c) for c in cache.trunk + cache.head]
    pending = [p.copy() for p in cache.pending]

    def back():
        for c, m in zip(cache.trunk + cache.head, marks):
            caches.restore(c, m)
        cache.pending[:] = [p.copy() for p in pending]

    return back


def fixed(k):
    """The loop's arguments for a fixed ``k`` drafts every round."""
    params = inspect.signature(speculative_generate_step).parameters
    if "draft_max" in params:
        return {"draft_max": k}  # a checkout from before the policy carried it
    if "draft_policy" in params:  # before draft sources
        return {"draft_policy": FixedDraft(k)}
    return {"drafts": FixedDraft(k)}


def prompts_for(path, vocab):
    try:
        _, tokenizer = mlx_mtp.load(path)
        from mlx_mtp.prompts import load_prompts, user_prompt

        seen, out = set(), []
        for p in load_prompts():
            if p.kind not in seen:
                seen.add(p.kind)
                text = user_prompt(tokenizer, p.prompt)
                out.append(tokenizer.encode(text, add_special_tokens=False))
        return out
    except Exception:  # no tokenizer: fixed token sequences
        return [
            [(a * i + b) % min(vocab, 256) for i in range(48)]
            for a, b in ((7, 3), (13, 5), (31, 11))
        ]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--draft-max", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=8, help="plain steps per timing")
    ap.add_argument("--tokens", type=int, default=0, help="also time the loop")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    K = args.draft_max

    model = mlx_mtp.load_model(args.model)
    vocab = model.target.embed_tokens.weight.shape[0]
    context = [(7 * i + 3) % min(vocab, 256) for i in range(args.context)]
    cache = model.make_cache()
    prefill(model, cache, context[:-1], 2048, True)
    y = context[-2]  # one plain step: the next draft catches up over two
    _, hidden = model.target(mx.array([[y]]), cache.trunk)
    cache.pending[0].push(hidden, [y])
    mx.eval(hidden, [c.state for c in cache.trunk + cache.head])
    y = context[-1]
    back = snapshot(cache)

    def plain_steps():  # mlx-lm's generate_step: step n+1 built while n computes
        token = mx.array([y])
        logits = model.target.model(token[None], cache=cache.trunk)
        token = mx.argmax(logits[0, -1:], axis=-1)
        mx.async_eval(token)
        for _ in range(args.steps - 1):
            logits = model.target.model(token.reshape(1, 1), cache=cache.trunk)
            nxt = mx.argmax(logits[0, -1:], axis=-1)
            mx.async_eval(nxt)
            token.item()
            token = nxt
        token.item()

    def forward(t, keep):
        if keep:
            start_verify(cache.trunk)
        tokens = mx.array([y] + context[-t:-1] if t > 1 else [y])
        logits, hidden = model.target(tokens[None], cache.trunk)
        mx.eval(mx.argmax(logits, axis=-1), hidden)

    def drafts(k):
        out, _ = draft(model, cache, y, k, 0.0, ExactMatchVerifier(), context)
        mx.eval([d.token for d in out])

    parts = [("plain", 0, plain_steps)]
    parts += [("verify", t, lambda t=t: forward(t, True)) for t in range(1, K + 2)]
    parts += [("nokeep", t, lambda t=t: forward(t, False)) for t in range(1, K + 2)]
    if model.head is not None:
        parts += [("draft", k, lambda k=k: drafts(k)) for k in range(1, K + 1)]
    ptimes = {(name, i): [] for name, i, _ in parts}

    loops, prompts = [], []
    if args.tokens:
        prompts = prompts_for(args.model, vocab)
        argmax = lambda x: mx.argmax(x, axis=-1)  # noqa: E731

        def mlx_lm(p):
            return generate_step(
                mx.array(p), model.target.model, max_tokens=args.tokens, sampler=argmax
            )

        def ours(p, k, stats, policy=None):  # with the verifier users get
            how = fixed(k if policy is None else K)
            if policy is not None:
                how[next(iter(how))] = policy
            return speculative_generate_step(
                p,
                model,
                max_tokens=args.tokens,
                stats=stats,
                verifier=make_verifier(),
                **how,
            )

        loops = [("mlx-lm", None)] + [(f"k={k}", k) for k in range(K + 1)]
        try:
            from mlx_mtp.drafts import make_policy  # this checkout chooses k

            loops.append(("auto", "auto"))
        except ImportError:
            pass
    ltimes = {(name, i): [] for name, _ in loops for i in range(len(prompts))}
    lstats = {name: MTPStats() for name, _ in loops}
    ltokens = {}

    def auto_policy():
        from mlx_mtp.probe import machine_costs

        try:  # checkouts since the costs are passed in
            return make_policy(model, K, costs=machine_costs)
        except TypeError:
            return make_policy(model, K)

    def run_loop(name, k, i):
        stats = MTPStats()
        if k is None:
            steps = mlx_lm(prompts[i])
        elif k == "auto":
            steps = ours(prompts[i], K, stats, auto_policy())
        else:
            steps = ours(prompts[i], k, stats)
        t, tokens = per_token(steps)
        ltimes[name, i].append(t)
        lstats[name].add(stats)
        ltokens.setdefault(i, {}).setdefault(name, tokens)
        return tokens

    for rep in range(args.repeats + 1):  # the first repetition warms up
        shift = rep % len(parts)
        for name, i, fn in parts[shift:] + parts[:shift]:
            t = timed(fn)
            back()
            if rep:
                ptimes[name, i].append(t)
        for i in range(len(prompts)):
            shift = rep % len(loops)
            for name, k in loops[shift:] + loops[:shift]:
                if rep:
                    run_loop(name, k, i)
                else:
                    per_token(
                        mlx_lm(prompts[i])
                        if k is None
                        else ours(prompts[i], 0 if k == "auto" else k, MTPStats())
                    )

    out = {"model": args.model, "repeats": args.repeats, "tokens": args.tokens}
    for kind, col in (("wall", 0), ("cpu", 1)):
        med = {key: statistics.median(t[col] for t in v) for key, v in ptimes.items()}
        step = med["plain", 0] / args.steps
        o = out[kind] = {
            "step_ms": step * 1e3,
            "verify": [med["verify", t] / step for t in range(1, K + 2)],
            "nokeep": [med["nokeep", t] / step for t in range(1, K + 2)],
            "draft": [med["draft", k] / step for k in range(1, K + 1)]
            if model.head is not None
            else [],
        }
        if loops:
            o["loop"] = {}

            def pooled(name):  # seconds per token over every run
                runs = [t for i in range(len(prompts)) for t in ltimes[name, i]]
                return sum(t[col] for t in runs) / sum(t[2] for t in runs)

            for name, k in loops:
                ratios = [
                    (b[col] / b[2]) / (t[col] / t[2])
                    for i in range(len(prompts))
                    for t, b in zip(ltimes[name, i], ltimes["mlx-lm", i])
                ]
                s = lstats[name]
                e = s.mean_accepted_length if k is not None else 1.0
                row = {
                    # pooled over every run (the bound uses the pooled E)
                    "speedup": pooled("mlx-lm") / pooled(name),
                    "speedup_median": statistics.median(ratios),
                    # against the plain step of the parts above, the bound's unit
                    "vs_step": step / pooled(name),
                    "E": e,
                }
                if isinstance(k, int) and k > 0 and o["draft"]:
                    row["bound"] = e / (o["verify"][k] + o["draft"][k - 1])
                if k is not None:
                    row["per_position"] = s.per_position_acceptance
                    row["drafted"] = s.drafted
                o["loop"][name] = row
    if loops:
        out["same_output"] = all(
            toks == per["mlx-lm"] for per in ltokens.values() for toks in per.values()
        )
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
        for name, row in o.get("loop", {}).items():
            bound = ""
            if "bound" in row:
                ratio = row["vs_step"] / row["bound"]
                bound = f"  bound {row['bound']:.3f}, measured/bound {ratio:.3f}"
            print(
                f"  {name:7s} {row['speedup']:.3f}x mlx-lm ({row['vs_step']:.3f}x "
                f"the plain step)  E {row['E']:.2f}{bound}"
            )
    if loops:
        print(f"same output as mlx-lm: {out['same_output']}")


if __name__ == "__main__":
    main()
