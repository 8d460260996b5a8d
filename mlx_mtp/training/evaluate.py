"""What a head is worth at run time: held-out acceptance, costs, best draft-max.

Acceptance comes from real greedy speculative generations (the runtime's own
loop) on the hand-written held-out prompts. Costs are timed on this machine:
a verify forward over ``k + 1`` tokens and a chained head call, relative to a
plain one-token step. The recommended draft-max maximises the expected
tokens per verify pass over its cost (the bound of ``MTPStats``'s numbers).
"""

import itertools
import time
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx

from ..generate import stream_generate
from ..stats import MTPStats
from .prompts import Prompt, render_prompt


def acceptance(
    mtp_model: Any,
    tokenizer: Any,
    prompts: Sequence[list[int]],
    draft_maxes: Sequence[int] = (1, 2, 3),
    max_tokens: int = 64,
    progress: Callable[[int], None] | None = None,
) -> dict[int, MTPStats]:
    """Greedy speculative generation of every prompt at every draft-max."""
    out = {}
    for k in draft_maxes:
        total = MTPStats(draft_max=k)
        for p in prompts:
            *_, last = stream_generate(
                mtp_model, tokenizer, p, max_tokens, draft_max=k, adaptive_draft=False
            )
            total.add(last.stats)
            if progress is not None:
                progress(1)
        out[k] = total
    return out


def summary(stats: MTPStats) -> dict[str, Any]:
    return {
        "acceptance_rate": stats.acceptance_rate,
        "mean_accepted_length": stats.mean_accepted_length,
        "per_position_acceptance": stats.per_position_acceptance,
        "drafted": stats.drafted,
        "accepted": stats.accepted,
        "rounds": stats.rounds,
    }


def by_kind(
    mtp_model: Any,
    tokenizer: Any,
    prompts: dict[str, list[Prompt]],
    draft_maxes: Sequence[int],
    max_tokens: int,
    progress: Callable[[int], None] | None = None,
) -> dict[str, dict[int, MTPStats]]:
    """``acceptance`` per prompt kind, plus ``"all"``."""
    out: dict[str, dict[int, MTPStats]] = {}
    for kind, ps in prompts.items():
        ids = [render_prompt(tokenizer, p) for p in ps]
        out[kind] = acceptance(
            mtp_model, tokenizer, ids, draft_maxes, max_tokens, progress
        )
    out["all"] = {}
    for k in draft_maxes:
        total = MTPStats(draft_max=k)
        for kind in prompts:
            total.add(out[kind][k])
        out["all"][k] = total
    return out


def table(results: dict[str, dict[int, MTPStats]]) -> str:
    """A markdown table: acceptance (accepted/drafted) and mean accepted length
    per kind and draft-max, then the per-depth acceptance at the largest one."""
    ks = sorted(next(iter(results.values())))
    head = "| prompts | " + " | ".join(f"draft-max {k}" for k in ks) + " | per depth |"
    lines = [head, "| --- " * (len(ks) + 2) + "|"]
    for kind, per_k in results.items():
        cells = [
            f"{s.acceptance_rate:.1%} ({s.accepted}/{s.drafted}), "
            f"{s.mean_accepted_length:.2f}"
            for s in (per_k[k] for k in ks)
        ]
        depth = ", ".join(f"{a:.2f}" for a in per_k[ks[-1]].per_position_acceptance)
        lines.append(f"| {kind} | " + " | ".join(cells) + f" | {depth} |")
    return "\n".join(lines)


def measure_costs(mtp_model: Any, prompt: list[int], k_max: int, repeats: int = 15):
    """Median times, relative to a plain one-token step, of a verify forward
    over ``T = 1..k_max + 1`` tokens and of one chained head call."""
    trunk, head = mtp_model.target, mtp_model.head
    cache = mtp_model.make_cache()
    _, hidden = trunk(mx.array(prompt)[None], cache.trunk)
    mx.eval(hidden, [c.state for c in cache.trunk])
    if head is not None:
        _, h = head(hidden[:, :-1], mx.array(prompt[1:])[None], cache.head)
        mx.eval(h, [c.state for c in cache.head])
    tokens = mx.array(prompt[-k_max - 1 :])[None]

    def verify(t):
        logits, _ = trunk(tokens[:, :t], cache.trunk)
        mx.eval(logits)
        for c in cache.trunk:
            c.trim(t)

    def chained():
        logits, _ = head(h[:, -1:], tokens[:, :1], cache.head)
        mx.eval(mx.argmax(logits, axis=-1))
        for c in cache.head:
            c.trim(1)

    calls = [lambda t=t: verify(t) for t in range(1, k_max + 2)]
    calls += [chained] if head is not None else []
    times = [[] for _ in calls]
    for r in range(repeats + 1):  # interleaved, so drifting load hits all alike
        for fn, seen in zip(calls, times):
            tic = time.perf_counter()
            fn()
            if r:  # the first round warms up
                seen.append(time.perf_counter() - tic)
    med = [sorted(t)[len(t) // 2] for t in times]
    step = med[0]
    # a forward over more tokens never costs less: noise must not say otherwise
    verify_costs = list(itertools.accumulate((m / step for m in med[: k_max + 1]), max))
    return {
        "verify": verify_costs,
        "head": med[-1] / step if head is not None else 0.0,
        "step_seconds": step,
    }


def expected_speedups(per_depth: Sequence[float], costs: dict[str, Any]) -> list[float]:
    """Tokens per second against plain decoding at draft-max ``1..len(per_depth)``:
    expected tokens per pass, ``1 + a_1 + a_1 a_2 + ...``, over the pass's cost."""
    out, run, tokens = [], 1.0, 1.0
    for k, a in enumerate(per_depth, 1):
        run *= a
        tokens += run
        if k + 1 > len(costs["verify"]):
            break
        out.append(tokens / (costs["verify"][k] + k * costs["head"]))
    return out


def recommend_draft_max(per_depth: Sequence[float], costs: dict[str, Any]) -> int:
    """The draft-max with the best expected speed-up (at least 1)."""
    speedups = expected_speedups(per_depth, costs)
    if not speedups:
        return 1
    return 1 + max(range(len(speedups)), key=lambda i: speedups[i])
