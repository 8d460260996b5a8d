"""Collectives per speculative round over processes, and their time (not a test).

Run it under mlx.launch, and alone for the one-process round time:

    mlx.launch --backend ring -n 2 -- python scripts/bench/distributed_rounds.py MODEL \\
        [--sharding pipeline] [--draft-max 3] [-n 64] [--repeats 3]
    python scripts/bench/distributed_rounds.py MODEL

Rank 0 prints, per draft-max k (repetitions interleaved, medians): rounds,
the collectives a round issues by kind (counted by wrapping mx.distributed's
functions while the trunk, the head and the verifier run), the round time,
the per-round decision collective's time and share of it, and a ping test of
each collective alone at the sizes a round moves (median and 10th percentile).
"""

import argparse
import json
import statistics
import time
from collections import Counter

import mlx.core as mx

from mlx_mtp import distributed, speculative, stream_generate

OPS = ("all_sum", "all_gather", "send", "recv", "recv_like")
counts = Counter()
phase = ["other"]


def count_collectives():
    for name in OPS:
        op = getattr(mx.distributed, name)

        def counted(*args, _op=op, _name=name, **kwargs):
            counts[phase[0], _name] += 1
            return _op(*args, **kwargs)

        setattr(mx.distributed, name, counted)


def in_phase(name, fn):
    """Count the collectives ``fn`` issues under ``name`` (prefill: not per round)."""

    def wrapped(*args, **kwargs):
        before = phase[0]
        phase[0] = before if before == "prefill" else name
        try:
            return fn(*args, **kwargs)
        finally:
            phase[0] = before

    return wrapped


def ping(fn, group, n=200):
    """Median and 10th-percentile ms of ``fn()`` evaluated, all ranks in step."""
    times = []
    for _ in range(n):
        mx.eval(mx.distributed.all_sum(mx.array(0), group=group, stream=mx.cpu))
        tic = time.perf_counter()
        mx.eval(fn())
        times.append(1e3 * (time.perf_counter() - tic))
    times.sort()
    return round(statistics.median(times), 3), round(times[n // 10], 3)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--sharding", default="auto")
    p.add_argument("--draft-max", type=int, default=3)
    p.add_argument("-n", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()

    group = distributed.world()
    model, tokenizer = distributed.load(args.model, sharding=args.sharding)
    count_collectives()
    model.target.__class__.__call__ = in_phase("trunk", model.target.__class__.__call__)
    head_cls = type(model.head.layer(0))  # the loop calls the head's layers
    prefill = speculative.prefill
    speculative.prefill = in_phase("prefill", prefill)
    head_cls.__call__ = in_phase("head", head_cls.__call__)
    verify = distributed.SyncedVerifier.verify
    distributed.SyncedVerifier.verify = in_phase("decision", verify)
    prompt = list(range(3, 40))
    rows = {k: [] for k in range(args.draft_max + 1)}
    calls = {}
    for _ in range(args.repeats):
        for k in rows:
            counts.clear()
            trunk_calls, head_calls = [0], [0]
            trunk_call, head_call = model.target.__class__.__call__, head_cls.__call__

            def tc(*a, **kw):
                trunk_calls[0] += phase[0] != "prefill"
                return trunk_call(*a, **kw)

            def hc(*a, **kw):
                head_calls[0] += phase[0] != "prefill"
                return head_call(*a, **kw)

            model.target.__class__.__call__, head_cls.__call__ = tc, hc
            for r in stream_generate(
                model, tokenizer, prompt, args.n, draft_max=k, mtp=k > 0
            ):
                pass
            model.target.__class__.__call__, head_cls.__call__ = trunk_call, head_call
            s = r.stats
            rows[k].append(
                (s.generation_time / s.rounds, s.sync_time / max(s.syncs, 1), s)
            )
            calls[k] = (trunk_calls[0], head_calls[0], dict(counts), s.rounds)

    d = model.config["hidden_size"]
    out = {"processes": group.size(), "sharding": model.sharding.mode, "hidden": d}
    for k, runs in rows.items():
        trunk_n, head_n, c, rounds = calls[k]
        per_forward = {
            op: c.get(("trunk", op), 0) / trunk_n for op in OPS if c.get(("trunk", op))
        }
        per_head = {
            op: c.get(("head", op), 0) / head_n
            for op in OPS
            if head_n and c.get(("head", op))
        }
        round_ms = 1e3 * statistics.median(r[0] for r in runs)
        sync_ms = 1e3 * statistics.median(r[1] for r in runs)
        s = runs[-1][2]
        out[f"k={k}"] = {
            "rounds": rounds,
            "mean_accepted_length": round(s.mean_accepted_length, 2),
            "trunk_collectives_per_forward": per_forward,
            "head_calls_per_round": round(head_n / rounds, 2),
            "head_collectives_per_call": per_head,
            "decision_collectives_per_round": c.get(("decision", "all_gather"), 0)
            / rounds,
            "round_ms": round(round_ms, 3),
            "decision_ms": round(sync_ms, 3),
            "decision_share": round(sync_ms / round_ms, 3),
        }
    if group.size() > 1:
        peer = 1 - group.rank() if group.size() == 2 else None
        pings = {}
        for k in (1, args.draft_max):
            x = mx.zeros((1, k + 1, d), mx.float32)
            pings[f"all_gather hidden [1,{k + 1},{d}]"] = ping(
                lambda x=x: mx.distributed.all_gather(x, group=group), group
            )
            pings[f"all_sum hidden [1,{k + 1},{d}]"] = ping(
                lambda x=x: mx.distributed.all_sum(x, group=group), group
            )
            if peer is not None:

                def exchange(x=x):
                    if group.rank() == 0:
                        mx.eval(mx.distributed.send(x, peer, group=group))
                        return mx.distributed.recv_like(x, peer, group=group)
                    y = mx.distributed.recv_like(x, peer, group=group)
                    return mx.distributed.send(y, peer, group=group)

                pings[f"send+recv hidden [1,{k + 1},{d}] (round trip)"] = ping(
                    exchange, group
                )
            row = mx.zeros((3 + 2 * k + 2,), mx.int32)
            pings[f"decision all_gather int32[{3 + 2 * k + 2}]"] = ping(
                lambda row=row: mx.distributed.all_gather(
                    row, group=group, stream=mx.cpu
                ),
                group,
            )
        out["ping_ms_median_p10"] = pings
    if group.rank() == 0:
        print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
