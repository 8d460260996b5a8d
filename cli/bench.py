"""``mlx-mtp bench``: mlx-lm against mlx-mtp side by side (work: ``mlx_mtp.bench``)."""

import json
import sys
from pathlib import Path
from typing import Optional

import typer

from mlx_mtp.defaults import (
    DEFAULT_BENCH_TOKENS,
    DEFAULT_DRAFT_P_MIN,
    DEFAULT_LOOKUP_MAX,
    DEFAULT_REPEATS,
    MAX_DRAFT_MAX,
    min_bench_tokens,
)
from mlx_mtp.stats import MTPStats

from . import options as o
from .app import OUTPUT, SPECULATIVE, app
from .progress import PromptProgress, duration

# the table shows the first depths' acceptance (lookup drafts reach 8, the head
# up to 16; the full list is in --json), so the other columns keep their width
PER_POSITION_SHOWN = 4


def first_positions(rates) -> str:
    shown = ", ".join(f"{a:.2f}" for a in rates[:PER_POSITION_SHOWN])
    return (shown + ", ..." if len(rates) > PER_POSITION_SHOWN else shown) or "-"


def regime_line(regime: dict) -> str:
    return (
        f"regime: backend {regime['backend']} ({regime['device']}), "
        f"weights {regime['weights']}, BLAS {regime['blas']}, {regime['cpus']} CPUs, "
        f"mlx {regime['mlx']}, mlx-lm {regime['mlx_lm']}; {regime['model_type']}, "
        + (
            f"MTP head, {regime['hidden_tap']}-norm tap"
            if regime["mtp_head"]
            else "no MTP head"
        )
        + "".join(f", drafter {name}" for name in regime.get("drafters", ()))
        + (f"; KV cache: {regime['kv_cache']}" if "kv_cache" in regime else "")
    )


def table(result):
    from rich.table import Table

    kinds = sorted({p.kind for p in result.prompts})
    t = Table(
        title=(
            f"{len(result.prompts)} prompts ({', '.join(kinds)}) x {result.repeats} "
            f"repeats, {result.max_tokens} tokens each, greedy"
        )
    )
    for name in (
        "config",
        "tok/s",
        "vs mlx-lm",
        "bound",
        "prompt tok/s",
        "accept",
        "mean len",
        "per position",
        "fwd/tok",
        "peak GB",
        "same",
    ):
        t.add_column(
            name,
            justify="left" if name in ("config", "per position") else "right",
            no_wrap=True,
        )
    for c in result.configs:
        acc = "-" if c.acceptance_rate is None else f"{c.acceptance_rate:.2f}"
        per_pos = first_positions(c.per_position_acceptance)
        t.add_row(
            c.config,
            f"{c.generation_tps:.1f}",
            f"{c.ratio:.2f}",
            "-" if c.bound is None else f"{c.bound:.2f}",
            f"{c.prompt_tps:.1f}",
            acc,
            f"{c.mean_accepted_length:.2f}",
            per_pos,
            f"{c.forwards_per_token:.2f}",
            f"{c.peak_memory_gb:.3f}",
            "yes" if c.same_output else "NO",
        )
    return t


def costs_line(costs: dict) -> str:
    """The parts of a round, in plain steps, as the bound column uses them."""
    verify = " ".join(f"{c:.2f}" for c in costs["verify"])
    drafts = " ".join(f"{c:.3f}" for c in costs["draft"])
    return (
        f"costs in plain steps ({costs['step_seconds'] * 1e3:.1f} ms): verify over "
        f"T = 1..{len(costs['verify'])} tokens {verify}; "
        f"k = 1..{len(costs['draft'])} drafts {drafts}"
    )


def kinds_table(result):
    """Per prompt kind: speed ratio, acceptance and mean accepted length."""
    from rich.table import Table

    kinds = sorted({p.kind for p in result.prompts})
    t = Table(title="by prompt kind: vs mlx-lm, acceptance, mean accepted length")
    t.add_column("config")
    for kind in kinds:
        t.add_column(kind, justify="right", no_wrap=True)
    for c in result.configs[1:]:  # the first is mlx-lm itself
        cells = []
        for kind in kinds:
            k = c.by_kind[kind]
            acc = "-" if k["acceptance_rate"] is None else f"{k['acceptance_rate']:.2f}"
            cells.append(f"{k['ratio']:.2f}x  {acc}  {k['mean_accepted_length']:.2f}")
        t.add_row(c.config, *cells)
    return t


def took_line(seconds: float, planned: Optional[float]) -> str:
    line = f"took {duration(seconds)}"
    if planned and seconds > 1.25 * planned:
        line += f", planned about {duration(planned)}: the machine slowed down"
    return line


def plan_line(prompts: int, configs: int, repeats: int, tokens: int, seconds: float):
    """What the benchmark will run and about how long it will take."""
    minutes = duration(seconds)
    return (
        f"bench: {configs} configurations x {prompts} prompts x {repeats} repeats x "
        f"{tokens} tokens, about {minutes} at the warm-up's speed "
        "(-r, -n, --draft-max and --prompts make it shorter)"
    )


def start_line(prompts: int, configs: int, repeats: int, tokens: int) -> str:
    """What the benchmark will run, before the warm-up times it."""
    return (
        f"bench: {configs} configurations x {prompts} prompts x {repeats} repeats "
        f"x {tokens} tokens; warming up each configuration first, then the time "
        "it will take"
    )


class RunsShown:
    """The runs done so far, on stderr from the start: a rich bar on a terminal
    (its text the run under way), a line per timed run elsewhere."""

    def __init__(self, err, terminal: Optional[bool] = None):
        self.err = err
        self.terminal = err.is_terminal if terminal is None else terminal
        self.bar = self.task = None
        self.text = "benchmarking: warming up"
        self.warmed = False
        if self.terminal:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                SpinnerColumn,
                TextColumn,
                TimeElapsedColumn,
            )

            self.bar = Progress(
                SpinnerColumn(),
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("runs"),
                TimeElapsedColumn(),
                console=err,
                transient=True,
            )
            self.task = self.bar.add_task(self.text, total=None)

    @property
    def status(self):
        """What ``PromptProgress`` updates with the prompt's reading (a bar only)."""
        return self if self.bar is not None else None

    def update(self, text: str) -> None:
        self.bar.update(self.task, description=text)

    def __enter__(self):
        if self.bar is not None:
            self.bar.start()
        return self

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.stop()

    def step(self, text: str) -> None:
        self.text = text
        if self.bar is not None:
            self.update(text)

    def say(self, line: str) -> None:
        if self.bar is not None:
            self.bar.console.print(line, markup=False, highlight=False)
        else:
            print(line, file=sys.stderr, flush=True)
        self.warmed = True

    def advance(self, done: int, total: int) -> None:
        if self.bar is not None:
            self.bar.update(self.task, completed=done, total=total)
        elif self.warmed and done:  # a timed run (or the costs) just finished
            print(
                f"{self.text}: done ({done}/{total} runs)", file=sys.stderr, flush=True
            )


def distributed_summary(result, sharding) -> dict:
    """How the model was spread, and the per-round collective over all mlx-mtp runs."""
    total = MTPStats()
    for run in result.runs:
        if run.stats is not None:
            total.add(run.stats)
    return {
        "sharding": sharding.mode,
        "processes": sharding.size,
        "syncs": total.syncs,
        "sync_ms": 1e3 * total.sync_time / total.syncs if total.syncs else 0.0,
        "sync_share": total.sync_share,
    }


@app.command()
@o.kv_options
def bench(
    model: o.ModelPath = None,
    mtp: o.HeadPath = None,
    draft: o.DraftPath = None,
    hidden_tap: o.HiddenTap = None,
    sharding: o.ShardingOption = o.Sharding.auto,
    prompts: Optional[Path] = typer.Option(
        None,
        "--prompts",
        help="Prompts: a .json list or one prompt per line"
        " (default: the shipped code, prose and chat prompts).",
    ),
    max_tokens: int = typer.Option(
        DEFAULT_BENCH_TOKENS,
        "--max-tokens",
        "-n",
        help=f"Tokens per generation: at least {min_bench_tokens()}, or 2 x "
        f"(--draft-max + 1) past --draft-max {DEFAULT_LOOKUP_MAX} (the first "
        "round is counted with the prompt, and as many must follow to be timed).",
    ),
    repeats: int = typer.Option(
        DEFAULT_REPEATS,
        "--repeats",
        "-r",
        min=1,
        help="Repetitions of every prompt and configuration.",
    ),
    draft_max: Optional[int] = typer.Option(
        None,
        "--draft-max",
        min=0,
        max=MAX_DRAFT_MAX,
        help="Benchmark k = 1..this drafts per round, and auto with at most this"
        " many (default: the head's recommended count, else 3).",
        rich_help_panel=SPECULATIVE,
    ),
    draft_p_min: float = typer.Option(
        DEFAULT_DRAFT_P_MIN,
        "--draft-p-min",
        min=0.0,
        max=1.0,
        help="Stop drafting when the draft's top probability falls below this.",
        rich_help_panel=SPECULATIVE,
    ),
    as_json: bool = typer.Option(
        False,
        "--json",
        help="Print one JSON object instead of the table.",
        rich_help_panel=OUTPUT,
    ),
    kv=None,  # the KV cache options (o.kv_options)
):
    """Benchmark mlx-lm's generation, mlx-mtp without and with MTP, side by side."""
    from rich.console import Console

    from mlx_mtp.bench import (
        BenchInterrupted,
        check_max_tokens,
        configurations,
        drafter_bounds,
        run_bench,
    )
    from mlx_mtp.config import default_draft_max
    from mlx_mtp.prompts import load_prompts

    o.processes()
    check_max_tokens(max_tokens, draft_max or 0)  # before the model is loaded
    bench_prompts = load_prompts(prompts)
    _, loaded, tokenizer = o.load_model(
        model, mtp, hidden_tap, sharding=sharding, draft=draft
    )
    kv.check_model(loaded)
    err = Console(stderr=True, highlight=False)
    bounds = drafter_bounds(loaded, draft_max)
    fixed = draft_max
    if draft_max is None:
        draft_max = default_draft_max(loaded)
    # before the warm-up's minutes
    check_max_tokens(max_tokens, max([draft_max] + [b for _, b in bounds]))
    n_configs = len(configurations(draft_max, bounds))

    plan = {}
    print(
        start_line(len(bench_prompts), n_configs, repeats, max_tokens),
        file=sys.stderr,
        flush=True,
    )
    shown = RunsShown(err)
    prefill = PromptProgress(
        label="benchmarking: warming up, reading the prompt",
        after="benchmarking: warming up",
        status=shown.status,
    )

    def step(msg: str) -> None:  # the run about to start, and its prompt's reading
        prefill.label, prefill.after = (
            f"benchmarking: {msg}, reading the prompt",
            f"benchmarking: {msg}",
        )
        shown.step(prefill.after)

    def planned(seconds: float):
        plan["seconds"] = seconds
        line = plan_line(len(bench_prompts), n_configs, repeats, max_tokens, seconds)
        shown.say(line)

    try:
        with shown:
            result = run_bench(
                loaded,
                tokenizer,
                bench_prompts,
                fixed,
                draft_p_min,
                repeats,
                max_tokens,
                progress=step,
                estimate=planned,
                prefill_progress=prefill,
                kv=kv,
                advance=shown.advance,
            )
    except BenchInterrupted as stop:
        if stop.result.configs:
            _report(stop.result, loaded, as_json, None, interrupted=True)
        rows = "the rows above" if stop.result.configs else "no row complete yet"
        print(
            f"interrupted: {stop.measured} of {stop.planned} timed runs measured, "
            f"{rows}",
            file=sys.stderr,
        )
        raise typer.Exit(130) from None
    _report(result, loaded, as_json, plan.get("seconds"))


def _report(result, loaded, as_json: bool, planned, interrupted: bool = False):
    """The table (or the JSON object) of ``result``."""
    from rich.console import Console

    from mlx_mtp.config import cannot_gain_notice

    if as_json:
        out = result.to_dict()
        if loaded.sharding is not None:
            out["distributed"] = distributed_summary(result, loaded.sharding)
        if interrupted:
            out["interrupted"] = True
        print(json.dumps(out))
        return
    console = Console(highlight=False)
    if not console.is_terminal:  # piped into a file: do not squeeze into 80 columns
        console = Console(highlight=False, width=140)
    console.print(regime_line(result.regime), markup=False, soft_wrap=True)
    if loaded.sharding is not None:
        d = distributed_summary(result, loaded.sharding)
        console.print(
            f"distributed: {d['sharding']} over {d['processes']} processes; "
            f"{d['syncs']} collectives (1 per mlx-mtp round), "
            f"{d['sync_ms']:.3f} ms each, {100 * d['sync_share']:.1f}% of "
            "mlx-mtp's generation time",
            markup=False,
            soft_wrap=True,
        )
    notice = cannot_gain_notice()
    if notice is not None:
        console.print(f"note: {notice}", style="yellow", markup=False)
    console.print(table(result))
    if result.costs:
        console.print(costs_line(result.costs), markup=False, soft_wrap=True)
    if len({p.kind for p in result.prompts}) > 1:
        console.print(kinds_table(result))
    if result.noise:
        console.print(
            "warning: the machine was too busy for these figures to hold ("
            + "; ".join(result.noise)
            + "): run again when it is idle, or with more --repeats",
            style="yellow",
            markup=False,
            soft_wrap=True,
        )
    console.print(
        "tok/s: median over runs; vs mlx-lm: median of per-run ratios in this run; "
        "bound: mean len / (verify(k+1) + drafts(k)) from this run's costs; "
        "acceptance, lengths and fwd/tok over all runs; auto: the count chosen "
        "each round by cost",
        style="dim",
        markup=False,
    )
    if not interrupted:
        console.print(took_line(result.seconds, planned), style="dim", markup=False)
