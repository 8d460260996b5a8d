"""``mlx-mtp train-head``: train an MTP head for a model that has none."""

import json
import sys
import time
from enum import Enum
from pathlib import Path

import typer
from rich.console import Console

from mlx_mtp.training import Hooks, Stop, TrainConfig
from mlx_mtp.training import train_head as run_train_head
from mlx_mtp.training.corpus import DEFAULT_CORPUS_TOKENS
from mlx_mtp.training.data import DEFAULT_DISTILL_BATCH, DEFAULT_DISTILL_TOKENS
from mlx_mtp.training.head import EH_INITS
from mlx_mtp.training.run import (
    DEFAULT_EVAL_DRAFT_MAXES,
    DEFAULT_EVAL_TOKENS,
    DEFAULT_TRUNK_BATCH,
    DEFAULT_VALIDATION_PROMPTS,
    DataConfig,
    RunConfig,
)
from mlx_mtp.training.trainer import DISTILL_TARGETS

from .app import app
from .progress import LINE_EVERY, duration

DATA = "Data"
TRAINING = "Training"
RUN = "Run"
EXIT_STOPPED = 75  # EX_TEMPFAIL: not finished, run again with --resume
d = TrainConfig()


def _choices(name: str, values) -> type:
    """An Enum of ``values``: typer shows the choices in --help and checks them."""
    return Enum(name, {v: v for v in values}, type=str)


EhInit = _choices("EhInit", EH_INITS)
Distill = _choices("Distill", DISTILL_TARGETS)
Dtype = _choices("Dtype", ("bfloat16", "float16", "float32"))


def _plain_hooks(console: Console, every: float | None = None) -> Hooks:
    """One line per phase, progress every ``every`` seconds (default
    ``LINE_EVERY``, as a long prompt's progress): for logs."""
    every = LINE_EVERY if every is None else every
    s = {"name": "", "total": 0, "done": 0, "t0": 0.0, "last": 0.0, "info": ""}
    s["shown"] = -1  # the count of the last line printed: a line is never repeated

    def line():
        rate = s["done"] / max(time.time() - s["t0"], 1e-9)
        console.print(
            f"{s['name']}: {s['done']}/{s['total']} ({rate:.1f}/s){s['info']}"
        )
        s["last"], s["shown"] = time.time(), s["done"]

    def phase(name, total):
        if s["name"] and s["done"] and s["done"] != s["shown"]:
            line()
        s.update(name=name, total=total, done=0, t0=time.time(), last=time.time())
        s.update(info="", shown=-1)

    def advance(n):
        s["done"] += n
        if time.time() - s["last"] >= every:
            line()

    def step(n, loss, tokens):
        s["info"] = f", loss {loss:.3f}"
        advance(n - s["done"])

    return Hooks(
        phase=phase,
        advance=advance,
        step=step,
        evaluated=lambda n, acc: console.print(f"step {n}: {_agreement(acc)}"),
        message=lambda text: console.print(text, soft_wrap=True, markup=False),
        planned=lambda what, seconds: console.print(
            _plan(what, seconds), soft_wrap=True, markup=False
        ),
    )


def _rich_hooks(progress, console: Console) -> Hooks:
    s = {"task": None, "agreement": ""}

    def phase(name, total):
        if s["task"] is not None:
            progress.update(s["task"], visible=False)
        s["task"] = progress.add_task(name, total=total, info="")

    def step(n, loss, tokens):
        info = f"loss {loss:.3f}  {s['agreement']}"
        progress.update(s["task"], completed=n, info=info)

    def evaluated(n, acc):
        s["agreement"] = _agreement(acc)
        progress.console.print(f"step {n}: {s['agreement']}")

    return Hooks(
        phase=phase,
        advance=lambda k: progress.advance(s["task"], k),
        step=step,
        evaluated=evaluated,
        message=lambda text: progress.console.print(text, markup=False),
        planned=lambda what, seconds: progress.console.print(
            _plan(what, seconds), markup=False
        ),
    )


def _plan(what: str, seconds: float) -> str:
    return f"{what}: about {duration(seconds)} on this machine"


def _agreement(per_depth) -> str:
    return "held-out agreement by depth " + ", ".join(f"{a:.1%}" for a in per_depth)


def _summary(report: dict) -> str:
    lines = [
        f"trained on {report['train_tokens']} target tokens "
        f"({report['chat_tokens']} chat, {report['text_tokens']} text; "
        f"{report['train_windows']} windows), {report['steps']} steps in "
        f"{report['train_seconds']:.0f} s; best step {report['best_step']}",
        "held-out teacher-forced agreement by depth: "
        + ", ".join(
            f"{a:.1%} (untrained {b:.1%})"
            for a, b in zip(report["agreement"], report["initial_agreement"])
        ),
    ]
    if "table" in report:
        lines += ["held-out acceptance, mean accepted length:", report["table"]]
        lines.append(f"recommended draft-max: {report['recommended_draft_max']}")
    return "\n".join(lines)


def _weights(text: str) -> tuple:
    try:
        weights = tuple(float(w) for w in text.split(","))
    except ValueError:
        raise typer.BadParameter("a comma-separated list of numbers") from None
    if any(w < 0 for w in weights):
        raise typer.BadParameter("weights must not be negative")
    return weights


@app.command("train-head")
def train_head(
    base: Path = typer.Argument(..., help="MLX model folder (the frozen trunk)."),
    out: Path = typer.Argument(
        ...,
        help="Folder for the head (mtp.safetensors, mtp_config.json) and the "
        "run's data and checkpoints.",
    ),
    text: list[Path] | None = typer.Option(
        None,
        "--text",
        rich_help_panel=DATA,
        help="Text files or folders (their text files, by suffix), read "
        "teacher-forced with the trunk's top-8 as targets. Repeatable.",
    ),
    corpus: bool = typer.Option(
        False,
        "--corpus",
        rich_help_panel=DATA,
        help="Also read the ready corpus every install has: the Python standard "
        "library's source and permissively licensed packages' READMEs, deduplicated.",
    ),
    text_tokens: int = typer.Option(
        0,
        "--text-tokens",
        min=0,
        rich_help_panel=DATA,
        help=f"Tokens of --text/--corpus at most (0: all of --text; "
        f"{DEFAULT_CORPUS_TOKENS:,} with --corpus).",
    ),
    chat_share: float = typer.Option(
        d.chat_share,
        "--chat-share",
        min=0.0,
        max=1.0,
        rich_help_panel=DATA,
        help="Share of training windows drawn from chat (--data, --self-distill) "
        "when text is given too (0: in proportion to their sizes).",
    ),
    data: list[Path] | None = typer.Option(
        None,
        "--data",
        rich_help_panel=DATA,
        help='Chat data: UTF-8 text, or JSON lines with "tokens" (and '
        '"prompt_len") or "text". Repeatable.',
    ),
    self_distill: int = typer.Option(
        0,
        "--self-distill",
        min=0,
        rich_help_panel=DATA,
        help="Also train on the model's greedy answers to this many generated prompts.",
    ),
    distill_tokens: int = typer.Option(
        DEFAULT_DISTILL_TOKENS,
        "--distill-tokens",
        min=8,
        rich_help_panel=DATA,
        help="Tokens per self-distilled answer at most.",
    ),
    distill_batch: int = typer.Option(
        DEFAULT_DISTILL_BATCH,
        "--distill-batch",
        min=1,
        rich_help_panel=DATA,
        help="Answers generated at once (mlx-lm's continuous batching).",
    ),
    trunk_batch: int = typer.Option(
        DEFAULT_TRUNK_BATCH,
        "--trunk-batch",
        min=1,
        rich_help_panel=DATA,
        help="Windows per trunk forward when computing hidden states.",
    ),
    validation: int = typer.Option(
        DEFAULT_VALIDATION_PROMPTS,
        "--validation-prompts",
        min=1,
        rich_help_panel=DATA,
        help="Generated prompts kept apart for early stopping.",
    ),
    steps: int = typer.Option(
        d.steps,
        "--steps",
        min=1,
        rich_help_panel=TRAINING,
        help="Training steps at most.",
    ),
    batch_size: int = typer.Option(
        d.batch_size,
        "--batch-size",
        min=1,
        rich_help_panel=TRAINING,
        help="Windows per step.",
    ),
    seq_len: int = typer.Option(
        d.seq_len,
        "--seq-len",
        min=16,
        rich_help_panel=TRAINING,
        help="Tokens per window.",
    ),
    lr: float = typer.Option(
        d.lr,
        "--lr",
        min=0.0,
        rich_help_panel=TRAINING,
        help="Peak learning rate (AdamW, warmup then cosine).",
    ),
    warmup: int = typer.Option(
        d.warmup,
        "--warmup",
        min=0,
        rich_help_panel=TRAINING,
        help="Warm-up steps (at most a tenth of --steps).",
    ),
    seed: int = typer.Option(
        d.seed,
        "--seed",
        rich_help_panel=TRAINING,
        help="Seed for prompts and data order.",
    ),
    eval_every: int = typer.Option(
        d.eval_every,
        "--eval-every",
        min=1,
        rich_help_panel=TRAINING,
        help="Steps between held-out evaluations.",
    ),
    patience: int = typer.Option(
        d.patience,
        "--patience",
        min=1,
        rich_help_panel=TRAINING,
        help="Stop after this many evaluations without improvement.",
    ),
    save_every: int = typer.Option(
        d.save_every,
        "--save-every",
        min=1,
        rich_help_panel=TRAINING,
        help="Steps between checkpoints.",
    ),
    eh_init: EhInit = typer.Option(
        d.eh_init,
        "--eh-init",
        rich_help_panel=TRAINING,
        help="eh_proj starts as the identity on this half of its input.",
    ),
    vocab_top: int = typer.Option(
        d.vocab_top,
        "--vocab-top",
        min=0,
        rich_help_panel=TRAINING,
        help="Draft from the K most frequent targets only (cheaper drafts; 0: "
        "the whole vocabulary).",
    ),
    distill: Distill = typer.Option(
        d.distill,
        "--distill",
        rich_help_panel=TRAINING,
        help="Target: the trunk's top-8 probabilities, its full distribution "
        "(over the draft vocabulary), or its greedy token.",
    ),
    depth: int = typer.Option(
        d.depth,
        "--depth",
        min=1,
        rich_help_panel=TRAINING,
        help="Chained drafts trained, as the runtime chains them (1: the first only).",
    ),
    chain_weights: str = typer.Option(
        ",".join(f"{w:g}" for w in d.chain_weights),
        "--chain-weights",
        rich_help_panel=TRAINING,
        help="Loss weight per depth, comma-separated.",
    ),
    dtype: Dtype = typer.Option(
        d.dtype,
        "--dtype",
        rich_help_panel=TRAINING,
        help="Saved head dtype.",
    ),
    eval_tokens: int = typer.Option(
        DEFAULT_EVAL_TOKENS,
        "--eval-tokens",
        min=8,
        rich_help_panel=RUN,
        help="Tokens per held-out generation at the end.",
    ),
    no_acceptance: bool = typer.Option(
        False,
        "--no-acceptance",
        rich_help_panel=RUN,
        help="Skip the held-out speculative generations at the end.",
    ),
    resume: bool = typer.Option(
        False,
        "--resume",
        rich_help_panel=RUN,
        help="Go on from OUT's checkpoint and reuse its data.",
    ),
    max_minutes: float = typer.Option(
        0.0,
        "--max-minutes",
        min=0.0,
        rich_help_panel=RUN,
        help="Stop cleanly after this many minutes (0: no limit); exits with "
        f"{EXIT_STOPPED} and a checkpoint, --resume goes on.",
    ),
    as_json: bool = typer.Option(
        False, "--json", help="Print the final report as JSON."
    ),
):
    """Train a DeepSeek-style MTP head for a model, its trunk frozen.

    The run first says what it will do and about how long it will take. It
    prepares no more data than --steps can use (steps x batch-size windows:
    as many self-distilled answers and validation prompts at most, and their
    tokens of text). Ctrl-C stops at the next safe point (seconds) and keeps
    a checkpoint; run the same command with --resume to go on.
    """
    weights = _weights(chain_weights)
    if len(weights) < depth:
        raise typer.BadParameter(
            f"{len(weights)} weights for --depth {depth}", param_hint="--chain-weights"
        )
    cfg = TrainConfig(
        steps=steps,
        batch_size=batch_size,
        seq_len=seq_len,
        lr=lr,
        warmup=min(warmup, max(steps // 10, 1)),
        seed=seed,
        eval_every=eval_every,
        patience=patience,
        save_every=save_every,
        eh_init=EhInit(eh_init).value,
        dtype=Dtype(dtype).value,
        vocab_top=vocab_top,
        distill=Distill(distill).value,
        depth=depth,
        chain_weights=weights[:depth],
        chat_share=chat_share,
    )
    sources = DataConfig(
        files=data or [],
        text=text or [],
        corpus=corpus,
        text_tokens=text_tokens,
        self_distill=self_distill,
        distill_tokens=distill_tokens,
        distill_batch=distill_batch,
        trunk_batch=trunk_batch,
        validation=validation,
    )
    run = RunConfig(
        resume=resume,
        eval_tokens=eval_tokens,
        eval_draft_maxes=() if no_acceptance else DEFAULT_EVAL_DRAFT_MAXES,
        max_minutes=max_minutes,
    )
    _run(base, out, sources, cfg, run, as_json)


def _run(
    base: Path, out: Path, data: DataConfig, cfg: TrainConfig, run: RunConfig, as_json
) -> None:
    """Run with progress on the terminal (bars) or in a log (lines); report."""
    console = Console(stderr=True)
    stop = Stop(run.max_minutes)
    args = {
        "base": base,
        "out": out,
        "data": data,
        "cfg": cfg,
        "run": run,
        "stop": stop,
    }
    if console.is_terminal:
        with _progress(console) as progress:
            report = run_train_head(**args, hooks=_rich_hooks(progress, console))
    else:
        hooks = _plain_hooks(console)
        try:
            report = run_train_head(**args, hooks=hooks)
        finally:
            hooks.phase("", 0)  # the last phase's closing line
    if as_json:
        print(json.dumps(report))
    if not report["complete"]:
        why = "interrupted" if stop.interrupted else "time budget reached"
        console.print(
            f"{why} during {report['stopped_in']}; progress is saved in {out}: "
            "run the same command with --resume to go on"
        )
        raise typer.Exit(130 if stop.interrupted else EXIT_STOPPED)
    if not as_json:
        console.print(_summary(report))
    console.print(
        f"head written to {out}; use it with: mlx-mtp generate -m {base} --mtp {out}"
    )
    sys.stderr.flush()


def _progress(console: Console):
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        TextColumn("{task.fields[info]}"),
    )
    return Progress(*columns, console=console)
