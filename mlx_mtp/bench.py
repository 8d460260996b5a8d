"""Side-by-side benchmark: mlx-lm's plain generation against mlx-mtp, in one run.

Configurations: mlx-lm's own ``stream_generate`` on the same loaded trunk (the
baseline), mlx-mtp with no drafts, mlx-mtp drafting a fixed ``k = 1..N`` every
round, and mlx-mtp choosing each round's count (at most N) by cost ("auto",
the default of ``generate``). Runs are interleaved (repetition, then prompt,
then configuration, the order of configurations rotating per repetition) so
drift on a shared machine hits all of them alike; speed ratios are medians of
ratios paired within the run. Every repetition also times the parts of a
round (``tune``'s measurements), so each fixed ``k`` is shown against its
bound ``E / (c_verify(k + 1) + c_draft(k))`` from the same run's costs and
mean accepted length.

Timing is the same for every configuration: prompt tok/s covers the prompt and
the first step (as mlx-lm reports it); generation tok/s counts the tokens
after the first step over the time after it, a step being one main-model
forward that produced tokens (one token for mlx-lm, a round for mlx-mtp).
"""

import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, List, Optional

import mlx.core as mx
import mlx_lm
from mlx_lm.generate import stream_generate as mlx_lm_stream_generate

from .adaptive import Costs
from .cache import MTP
from .config import backend, blas, default_draft_max, weights_dtype
from .defaults import (
    DEFAULT_BENCH_TOKENS,
    DEFAULT_DRAFT_P_MIN,
    DEFAULT_REPEATS,
    min_bench_tokens,
)
from .errors import MTPError
from .generate import stream_generate
from .kv import KVSettings
from .loader import MTPModel
from .prompts import BenchPrompt, encoded_prompts
from .stats import MTPStats
from .tune import CostTimer

BASELINE = "mlx-lm"
NO_MTP = "no-mtp"
AUTO = "mtp auto"
NGRAM = "ngram"  # prompt lookup alone
BOTH = "auto"  # the head or prompt lookup, per round (generate's default)
WARMUP_TOKENS = 8


def check_max_tokens(max_tokens: int, draft_max: int) -> None:
    least = min_bench_tokens(draft_max)
    if max_tokens < least:
        raise MTPError(
            f"{max_tokens} tokens per generation are too few to time: the first "
            f"round (up to {least // 2} tokens here) is counted with the prompt; "
            f"ask for {least} or more (bench -n)"
        )


@dataclass
class Measurement:
    """One timed generation."""

    config: str
    prompt: int
    repeat: int
    tokens: List[int]
    prompt_tokens: int
    prompt_tps: float
    generation_tps: float
    peak_memory: float  # GB
    stats: Optional[MTPStats] = None  # None for mlx-lm
    # CPU seconds of this process per token after the first: on a CPU shared
    # with other jobs, the work done, which their load does not stretch
    cpu_per_token: float = 0.0


@dataclass
class ConfigResult:
    """One row of the table."""

    config: str
    draft_max: Optional[int]
    generation_tps: float  # median over runs
    ratio: float  # median over runs of generation_tps / mlx-lm's in the same slot
    prompt_tps: float  # median
    tokens: int  # generated, all runs together
    acceptance_rate: Optional[float]
    mean_accepted_length: float
    per_position_acceptance: List[float]
    forwards_per_token: float
    peak_memory_gb: float
    same_output: bool  # every run emitted exactly mlx-lm's tokens
    # per prompt kind: ratio, acceptance_rate, mean_accepted_length
    by_kind: Dict[str, Dict[str, Optional[float]]] = field(default_factory=dict)
    adaptive: bool = False  # the draft count chosen each round by cost
    # a fixed k's bound E / (c_verify(k + 1) + c_draft(k)), this run's costs
    bound: Optional[float] = None
    # the same in CPU time of this process (see ``Measurement.cpu_per_token``)
    cpu_ratio: Optional[float] = None
    cpu_bound: Optional[float] = None
    # where its drafts came from: "mtp" (the head), a drafter's name, "ngram",
    # "auto"
    source: str = "mtp"


@dataclass
class BenchResult:
    regime: Dict[str, Any]
    prompts: List[BenchPrompt]
    repeats: int
    max_tokens: int
    configs: List[ConfigResult] = field(default_factory=list)
    runs: List[Measurement] = field(default_factory=list)
    # medians, in plain steps: verify over T = 1..N+1, draft k = 1..N, rounds
    # k = 0..N; step_seconds: the plain step; and the same in CPU time
    costs: Dict[str, Any] = field(default_factory=dict)
    cpu_costs: Dict[str, Any] = field(default_factory=dict)
    # why the machine's load may have distorted the figures (see ``noise``)
    noise: List[str] = field(default_factory=list)
    seconds: float = 0.0  # the benchmark's wall time, warm-up included

    def to_dict(self) -> dict:
        """Everything but the runs' tokens and detailed stats (their speeds stay)."""
        out = asdict(self)
        out["runs"] = [
            {
                "config": r.config,
                "prompt": r.prompt,
                "repeat": r.repeat,
                "tokens": len(r.tokens),
                "prompt_tps": r.prompt_tps,
                "generation_tps": r.generation_tps,
                "cpu_per_token": r.cpu_per_token,
                "peak_memory_gb": r.peak_memory,
            }
            for r in self.runs
        ]
        return out


def regime(model: MTPModel, kv: KVSettings = KVSettings()) -> Dict[str, Any]:
    """Backend, weights dtype, BLAS and the KV cache: the context the numbers
    need."""
    backend_name = backend()
    return {
        "kv_cache": kv.describe(),
        "backend": backend_name,
        "device": str(mx.default_device()),
        "weights": weights_dtype(model),
        "blas": blas() if backend_name == "cpu" else "n/a (GPU)",
        "cpus": os.cpu_count(),
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm.__version__,
        "model_type": model.model_type,
        "mtp_head": model.head is not None,
        "drafters": [d.name for d in model.drafters if d.name != MTP],
        "hidden_tap": model.target.hidden_tap,
    }


def _timed(responses, in_first_step: Callable[[Any], bool]):
    """Run a response stream; returns (tokens, prompt time, first-step tokens,
    time after the first step, CPU time after the first step, last response)."""
    tic = time.perf_counter()
    tokens, first, t_first, t_last, last = [], 0, None, None, None
    for last in responses:
        now, cpu = time.perf_counter(), time.process_time()
        if t_first is None:
            t_first, c_first = now, cpu
        first += in_first_step(last)
        tokens.append(int(last.token))
        t_last, c_last = now, cpu
    if last is None:
        raise MTPError("the generation produced no tokens")
    return tokens, t_first - tic, first, t_last - t_first, c_last - c_first, last


def run_once(
    model: MTPModel,
    tokenizer,
    draft_max: Optional[int],
    prompt,
    max_tokens,
    draft_p_min,
    adaptive: bool = False,
    source: str = "mtp",
    prefill_progress: Optional[Callable[[int, int], None]] = None,
    kv: KVSettings = KVSettings(),
):
    """One greedy generation (mlx-lm's when ``draft_max`` is None), timed;
    ``adaptive``: the draft count chosen each round, at most ``draft_max``;
    ``source``: where drafts come from (``stream_generate``'s ``draft_source``);
    ``prefill_progress(done, total)`` hears the prompt being read; ``kv``:
    the caches' policy, the same for mlx-lm (its keywords)."""
    mx.clear_cache()
    mx.reset_peak_memory()
    if draft_max is None:
        responses = mlx_lm_stream_generate(
            model.target.model,
            tokenizer,
            prompt,
            max_tokens,
            prompt_progress_callback=prefill_progress,
            **kv.as_mlx_lm(),
        )
        *timing, _ = _timed(responses, lambda r: r.generation_tokens == 1)
        stats = None
    else:
        responses = stream_generate(
            model,
            tokenizer,
            prompt,
            max_tokens,
            draft_max=draft_max,
            draft_p_min=draft_p_min,
            mtp=draft_max > 0,
            adaptive_draft=adaptive,
            draft_source=source,
            prefill_progress=prefill_progress,
            **kv.as_mlx_lm(),
        )
        *timing, last = _timed(responses, lambda r: r.stats.rounds == 1)
        stats = last.stats
    return timing, stats, mx.get_peak_memory() / 1e9


def configurations(draft_max: int, drafters=((MTP, None),)) -> List[tuple]:
    """(name, draft_max, adaptive, draft source) for each configuration; a
    draft_max of None stands for mlx-lm. Per drafter (``(name, bound)``: the
    head "mtp", an attached drafter by its name; ``bound`` None: ``draft_max``)
    a fixed ``k = 1..bound`` each and its own choice per round; prompt lookup
    (``ngram``) needs none; ``auto`` picks per round among them all."""
    out = [(BASELINE, None, False, MTP), (NO_MTP, 0, False, MTP)]
    lookup = (NGRAM, max(draft_max, 1), True, "ngram")
    if not drafters or draft_max == 0:
        return out + [lookup]
    most = 0
    for name, bound in drafters:
        bound = draft_max if bound is None else bound
        most = max(most, bound)
        out += [(f"{name} k={k}", k, False, name) for k in range(1, bound + 1)]
        out.append((f"{name} auto", bound, True, name))
    return out + [lookup, (BOTH, most, True, "auto")]


def drafter_bounds(model: MTPModel, draft_max: Optional[int]) -> List[tuple]:
    """(name, most drafts per round) of each of ``model``'s drafters: at most
    ``draft_max`` when given, else the head's recommended count and a block
    drafter's block."""
    out = []
    for d in model.drafters:
        own = default_draft_max(model) if d.name == MTP else d.max_drafts
        out.append((d.name, min(own if draft_max is None else draft_max, d.max_drafts)))
    return out


def run_bench(
    model: MTPModel,
    tokenizer,
    prompts: List[BenchPrompt],
    draft_max: Optional[int] = None,
    draft_p_min: float = DEFAULT_DRAFT_P_MIN,
    repeats: int = DEFAULT_REPEATS,
    max_tokens: int = DEFAULT_BENCH_TOKENS,
    progress: Optional[Callable[[str], None]] = None,
    estimate: Optional[Callable[[float], None]] = None,
    prefill_progress: Optional[Callable[[int, int], None]] = None,
    kv: KVSettings = KVSettings(),
    advance: Optional[Callable[[int, int], None]] = None,
) -> BenchResult:
    """Benchmark every configuration on every prompt, ``repeats`` times, interleaved.

    ``draft_max``: the fixed counts run 1..draft_max, and "auto" chooses at
    most that many (default: the head's recommended count, else 3).
    ``estimate`` hears, once after the warm-up, how many seconds the timed
    runs will take at the warm-up's speed; ``prefill_progress(done, total)``
    each prompt being read. ``kv``: the caches' policy (quantized, bounded),
    mlx-lm's runs at the same settings. ``advance(done, total)`` hears the
    runs done (warm-ups and cost timings included) from the start on.

    Ctrl-C during the timed runs raises ``BenchInterrupted`` holding the rows
    measured so far.
    """
    started = time.perf_counter()
    given = draft_max
    if draft_max is None:
        draft_max = default_draft_max(model)
    check_max_tokens(max_tokens, draft_max)
    bounds = drafter_bounds(model, given)
    check_max_tokens(max_tokens, max([draft_max] + [b for _, b in bounds]))
    run = _Runner(model, tokenizer, draft_p_min, prefill_progress, kv)
    configs = configurations(draft_max, bounds)
    encoded = encoded_prompts(tokenizer, prompts)
    timed = model.head is not None and draft_max > 0  # the round costs
    total = len(configs) + timed + repeats * (len(encoded) * len(configs) + timed)
    done = 0

    def ran() -> None:
        nonlocal done
        done += 1
        if advance is not None:
            advance(done, total)

    if advance is not None:
        advance(0, total)
    # 1) warm up every configuration (compile, allocate) and time the plan
    seconds = 0.0
    for c in configs:
        if progress:
            progress(f"warming up {c[0]}")
        seconds += run.warm_up(c, encoded, repeats, max_tokens)
        ran()
    timer = None
    if timed:
        if progress:
            progress("warming up, costs")
        tic = time.perf_counter()
        timer = run.cost_timer(encoded[0], draft_max)
        seconds += repeats * (time.perf_counter() - tic)  # its warm-up: one pass
        ran()
    if estimate is not None:
        estimate(seconds)
    # 2) the timed runs, configurations in a rotating order
    runs: List[Measurement] = []
    try:
        for rep in range(repeats):
            if timer is not None:
                if progress:
                    progress(f"repeat {rep + 1}/{repeats}, costs")
                timer.run_once(rep)
                ran()
            for i, prompt in enumerate(encoded):
                shift = rep % len(configs)
                for config in configs[shift:] + configs[:shift]:
                    if progress:
                        where = f"prompt {i + 1}/{len(encoded)}"
                        progress(f"repeat {rep + 1}/{repeats}, {where}, {config[0]}")
                    runs.append(run.measure(config, i, rep, prompt, max_tokens))
                    ran()
    except KeyboardInterrupt:
        partial = _result(model, kv, prompts, repeats, max_tokens, configs, runs)
        partial.seconds = time.perf_counter() - started
        planned = repeats * len(encoded) * len(configs)
        raise BenchInterrupted(partial, len(runs), planned) from None
    # 3) the summary, with each fixed count's bound from the measured costs
    result = _result(model, kv, prompts, repeats, max_tokens, configs, runs)
    if timer is not None:
        _bounds(result, timer)
    result.noise = noise(result, timer.times if timer is not None else {})
    result.seconds = time.perf_counter() - started
    return result


class BenchInterrupted(KeyboardInterrupt):
    """Ctrl-C during the timed runs: ``result`` holds the rows measured so far
    (each run paired with mlx-lm's in its slot; no costs or bounds), of
    ``measured`` timed runs out of ``planned``."""

    def __init__(self, result: BenchResult, measured: int, planned: int):
        super().__init__()
        self.result, self.measured, self.planned = result, measured, planned


def _result(model, kv, prompts, repeats, max_tokens, configs, runs) -> BenchResult:
    """The rows of the configurations measured, from the runs mlx-lm's pairs."""
    paired = {(r.prompt, r.repeat) for r in runs if r.config == BASELINE}
    runs = [r for r in runs if (r.prompt, r.repeat) in paired]
    result = BenchResult(regime(model, kv), prompts, repeats, max_tokens, runs=runs)
    kinds = [p.kind for p in prompts]
    measured = {r.config for r in runs}
    result.configs = [
        _summarise(name, k, runs, kinds, adaptive, source)
        for name, k, adaptive, source in configs
        if name in measured
    ]
    return result


class _Runner:
    """Runs ``run_once`` with one benchmark's model and settings."""

    def __init__(self, model, tokenizer, draft_p_min, prefill_progress, kv):
        self.model, self.tokenizer, self.kv = model, tokenizer, kv
        self.draft_p_min, self.prefill_progress = draft_p_min, prefill_progress

    def once(self, k, prompt, max_tokens, adaptive=False, source="mtp"):
        return run_once(
            self.model, self.tokenizer, k, prompt, max_tokens, self.draft_p_min,
            adaptive, source, self.prefill_progress, self.kv,
        )  # fmt: skip

    def warm_up(self, config, encoded, repeats: int, max_tokens: int) -> float:
        """Run ``config`` once; the seconds its timed runs will take at that speed."""
        _, k, adaptive, source = config
        timing, _, _ = self.once(k, encoded[0], WARMUP_TOKENS, adaptive, source)
        tokens, t_prompt, first, t_gen = timing[:4]
        per_token = t_gen / max(len(tokens) - first, 1)
        return sum(
            repeats * (t_prompt * len(p) / len(encoded[0]) + per_token * max_tokens)
            for p in encoded
        )

    def cost_timer(self, prompt, draft_max: int) -> "CostTimer":
        """The round costs' timer, on the context of a plain answer to ``prompt``."""
        plain = self.once(0, prompt, 2 * WARMUP_TOKENS)
        context = prompt + plain[0][0]
        return CostTimer(self.model, context, draft_max, self.prefill_progress)

    def measure(self, config, i: int, rep: int, prompt, max_tokens: int):
        name, k, adaptive, source = config
        (tokens, t_prompt, first, t_gen, cpu), stats, peak = self.once(
            k, prompt, max_tokens, adaptive, source
        )
        gen_tps = (len(tokens) - first) / t_gen if t_gen > 0 else 0.0
        return Measurement(
            name, i, rep, tokens, len(prompt), len(prompt) / t_prompt, gen_tps,
            peak, stats, cpu / max(len(tokens) - first, 1),
        )  # fmt: skip


def _bounds(result: BenchResult, timer: "CostTimer") -> None:
    """Each fixed count's bound E / (c_verify(k + 1) + c_draft(k)), by wall
    and by CPU time."""
    result.costs, result.cpu_costs = timer.costs(), timer.costs(cpu=True)
    costs = Costs.from_dict(result.costs)
    cpu_costs = Costs.from_dict(result.cpu_costs)
    for c in result.configs:  # the costs timed are the head's
        if c.draft_max and not c.adaptive and c.source == MTP:
            c.bound = c.mean_accepted_length / costs.round_parts(c.draft_max)
            c.cpu_bound = c.mean_accepted_length / cpu_costs.round_parts(c.draft_max)


# Repeats of one configuration on one prompt whose speeds (relative to mlx-lm's
# in the same slot) spread wider than this, as (max - min) / median, do not
# measure the configuration any more: the machine's load does.
NOISE_SPREAD = 0.15
# mlx-mtp without drafts does mlx-lm's work: further from 1x than this, the two
# did not run under the same conditions.
NOISE_NO_MTP = 0.10


def _spread(values: List[float]) -> float:
    mid = statistics.median(values)
    return (max(values) - min(values)) / mid if mid > 0 else 0.0


def noise(result: BenchResult, cost_times: Dict[tuple, List[tuple]]) -> List[str]:
    """What says the machine was too busy for the figures to hold, row by row.

    Each configuration is repeated on each prompt; the spread of its speed ratio
    over the repeats of one prompt (the median over prompts) is the noise it
    was measured with. The no-drafts row should run at mlx-lm's speed, and a
    verify over one token should cost one plain step: when they do not, the
    costs and bounds do not hold either. Empty when nothing says so (or with
    one repeat, where nothing can).
    """
    found = []
    if result.repeats > 1:
        noisy = []
        for c in result.configs[1:]:
            by_prompt: Dict[int, List[float]] = {}
            base = {
                (r.prompt, r.repeat): r.generation_tps
                for r in result.runs
                if r.config == BASELINE
            }
            for r in result.runs:
                if r.config == c.config and base.get((r.prompt, r.repeat), 0) > 0:
                    ratio = r.generation_tps / base[r.prompt, r.repeat]
                    by_prompt.setdefault(r.prompt, []).append(ratio)
            spreads = [_spread(v) for v in by_prompt.values() if len(v) > 1]
            if spreads and statistics.median(spreads) > NOISE_SPREAD:
                noisy.append(f"{c.config} ({100 * statistics.median(spreads):.0f}%)")
        if noisy:
            found.append(
                "repeats disagree by more than "
                f"{100 * NOISE_SPREAD:.0f}%: " + ", ".join(noisy)
            )
    plain = next((c for c in result.configs if c.draft_max == 0), None)
    if plain is not None and abs(plain.ratio - 1) > NOISE_NO_MTP:
        found.append(f"{plain.config} ran at {plain.ratio:.2f}x of mlx-lm's same work")
    verify = result.costs.get("verify") if result.costs else None
    if verify and not 0.8 <= verify[0] <= 1.25:
        found.append(
            f"a verify over 1 token measured {verify[0]:.2f} plain steps "
            "(about 1 when the load is steady): the costs and bounds are off"
        )
    elif cost_times:
        wide = [
            f"{name} {i}"
            for (name, i), times in cost_times.items()
            if len(times) > 1 and _spread([t[0] for t in times]) > 2 * NOISE_SPREAD
        ]
        if wide:
            found.append(
                "the costs' repeats disagree by more than "
                f"{200 * NOISE_SPREAD:.0f}% ({', '.join(wide)}): the bounds are rough"
            )
    return found


def _paired(mine: List[Measurement], base) -> tuple:
    """Median speed ratio to mlx-lm's run in the same slot, and the summed stats."""
    ratios = [
        r.generation_tps / base[r.prompt, r.repeat].generation_tps
        for r in mine
        if base[r.prompt, r.repeat].generation_tps > 0
    ]
    total = MTPStats()
    for r in mine:
        if r.stats is not None:
            total.add(r.stats)
    return (statistics.median(ratios) if ratios else 0.0), total


def _summarise(
    name: str,
    draft_max: Optional[int],
    runs: List[Measurement],
    kinds: List[str],
    adaptive: bool = False,
    source: str = MTP,
) -> ConfigResult:
    mine = [r for r in runs if r.config == name]
    base = {(r.prompt, r.repeat): r for r in runs if r.config == BASELINE}
    ratio, total = _paired(mine, base)
    cpu = [
        base[r.prompt, r.repeat].cpu_per_token / r.cpu_per_token
        for r in mine
        if r.cpu_per_token > 0
    ]
    by_kind = {}
    for kind in sorted(set(kinds)):
        kind_ratio, kind_total = _paired(
            [r for r in mine if kinds[r.prompt] == kind], base
        )
        by_kind[kind] = {
            "ratio": kind_ratio,
            "acceptance_rate": kind_total.acceptance_rate if draft_max else None,
            "mean_accepted_length": kind_total.mean_accepted_length
            if draft_max
            else 1.0,
        }
    return ConfigResult(
        config=name,
        draft_max=draft_max,
        generation_tps=statistics.median(r.generation_tps for r in mine),
        ratio=ratio,
        prompt_tps=statistics.median(r.prompt_tps for r in mine),
        tokens=sum(len(r.tokens) for r in mine),
        acceptance_rate=total.acceptance_rate if draft_max else None,
        mean_accepted_length=total.mean_accepted_length if draft_max else 1.0,
        per_position_acceptance=total.per_position_acceptance,
        forwards_per_token=total.forwards_per_token if draft_max else 1.0,
        peak_memory_gb=max(r.peak_memory for r in mine),
        same_output=all(r.tokens == base[r.prompt, r.repeat].tokens for r in mine),
        by_kind=by_kind,
        adaptive=adaptive,
        cpu_ratio=statistics.median(cpu) if cpu else None,
        source=source,
    )
