"""``mlx-mtp train-head``: train an MTP head for a model that has none."""

import json
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from mlx_mtp.train_head import Hooks, TrainConfig
from mlx_mtp.train_head import train_head as run_train_head

from .app import app

DATA = "Data"
TRAINING = "Training"
d = TrainConfig()


def _hooks(progress: Progress, console: Console) -> Hooks:
    state = {"task": None, "tokens": 0, "t0": None, "agreement": None}

    def phase(name: str, total: int):
        if state["task"] is not None:
            progress.update(state["task"], visible=False)
        state["task"] = progress.add_task(name, total=total, info="")

    def step(n: int, loss: float, tokens: int):
        import time

        if state["t0"] is None:
            state["t0"] = time.time()
        state["tokens"] += tokens
        rate = state["tokens"] / max(time.time() - state["t0"], 1e-9)
        agree = state["agreement"]
        info = f"loss {loss:.3f}  {rate:.0f} tok/s"
        if agree is not None:
            info += f"  held-out agreement {agree:.1%}"
        progress.update(state["task"], completed=n, info=info)

    def evaluated(n: int, agreement: float):
        state["agreement"] = agreement
        progress.console.print(f"step {n}: held-out top-1 agreement {agreement:.1%}")

    return Hooks(
        phase=phase,
        advance=lambda k: progress.advance(state["task"], k),
        step=step,
        evaluated=evaluated,
        message=lambda text: progress.console.print(text),
    )


def _summary(report: dict) -> str:
    lines = [
        f"trained on {report['train_tokens']} tokens ({report['train_windows']} windows), "
        f"{report['steps']} steps in {report['train_seconds']:.0f} s; best step {report['best_step']}",
        f"held-out teacher-forced agreement: {report['initial_agreement']:.1%} untrained -> "
        f"{report['agreement']:.1%}",
    ]
    for k, a in report.get("acceptance", {}).items():
        lines.append(
            f"draft-max {k}: acceptance {a['acceptance_rate']:.1%} "
            f"({a['accepted']}/{a['drafted']}), mean accepted length "
            f"{a['mean_accepted_length']:.2f}"
        )
    return "\n".join(lines)


@app.command("train-head")
def train_head(
    base: Path = typer.Argument(..., help="MLX model folder (the frozen trunk)."),
    out: Path = typer.Argument(
        ..., help="Folder for the head (mtp.safetensors, mtp_config.json)."
    ),
    data: Optional[List[Path]] = typer.Option(
        None,
        "--data",
        help='Training text: plain text, or JSON lines with "tokens" or "text". Repeatable.',
        rich_help_panel=DATA,
    ),
    self_distill: int = typer.Option(
        0,
        "--self-distill",
        min=0,
        help="Also train on the model's greedy answers to this many generated prompts.",
        rich_help_panel=DATA,
    ),
    distill_tokens: int = typer.Option(
        256,
        "--distill-tokens",
        min=8,
        help="Tokens per self-distilled answer.",
        rich_help_panel=DATA,
    ),
    steps: int = typer.Option(
        d.steps,
        "--steps",
        min=1,
        help="Training steps at most.",
        rich_help_panel=TRAINING,
    ),
    batch_size: int = typer.Option(
        d.batch_size,
        "--batch-size",
        min=1,
        help="Windows per step.",
        rich_help_panel=TRAINING,
    ),
    seq_len: int = typer.Option(
        d.seq_len,
        "--seq-len",
        min=16,
        help="Tokens per window.",
        rich_help_panel=TRAINING,
    ),
    lr: float = typer.Option(
        d.lr,
        "--lr",
        min=0.0,
        help="Peak learning rate (AdamW, warmup then cosine).",
        rich_help_panel=TRAINING,
    ),
    seed: int = typer.Option(
        d.seed,
        "--seed",
        help="Seed for prompts and data order.",
        rich_help_panel=TRAINING,
    ),
    eval_every: int = typer.Option(
        d.eval_every,
        "--eval-every",
        min=1,
        help="Steps between held-out evaluations.",
        rich_help_panel=TRAINING,
    ),
    patience: int = typer.Option(
        d.patience,
        "--patience",
        min=1,
        help="Stop after this many evaluations without improvement.",
        rich_help_panel=TRAINING,
    ),
    save_every: int = typer.Option(
        d.save_every,
        "--save-every",
        min=1,
        help="Steps between checkpoints.",
        rich_help_panel=TRAINING,
    ),
    resume: bool = typer.Option(
        False,
        "--resume",
        help="Go on from OUT's checkpoint and reuse its precomputed data.",
        rich_help_panel=TRAINING,
    ),
    eh_init: str = typer.Option(
        d.eh_init,
        "--eh-init",
        help="eh_proj starts as the identity on the hidden or the embedding half.",
        rich_help_panel=TRAINING,
    ),
    vocab_top: int = typer.Option(
        d.vocab_top,
        "--vocab-top",
        min=0,
        help="Softmax over the K most frequent targets only (faster; 0: whole vocabulary).",
        rich_help_panel=TRAINING,
    ),
    hard_targets: bool = typer.Option(
        False,
        "--hard-targets",
        help="Train on the trunk's greedy token alone, not its top-8 probabilities.",
        rich_help_panel=TRAINING,
    ),
    dtype: str = typer.Option(
        d.dtype,
        "--dtype",
        help="Saved head dtype: bfloat16, float16 or float32.",
        rich_help_panel=TRAINING,
    ),
    eval_tokens: int = typer.Option(
        128,
        "--eval-tokens",
        min=8,
        help="Tokens per held-out answer.",
        rich_help_panel=TRAINING,
    ),
    no_acceptance: bool = typer.Option(
        False,
        "--no-acceptance",
        help="Skip the speculative generations at the end.",
        rich_help_panel=TRAINING,
    ),
    as_json: bool = typer.Option(
        False, "--json", help="Print the final report as JSON."
    ),
):
    """Train a DeepSeek-style MTP head for a model, its trunk frozen."""
    from mlx_mtp.errors import MTPError

    if dtype not in ("bfloat16", "float16", "float32"):
        raise MTPError("--dtype must be bfloat16, float16 or float32")
    cfg = TrainConfig(
        steps=steps,
        batch_size=batch_size,
        seq_len=seq_len,
        lr=lr,
        seed=seed,
        eval_every=eval_every,
        patience=patience,
        save_every=save_every,
        eh_init=eh_init,
        vocab_top=vocab_top,
        dtype=dtype,
        soft_targets=not hard_targets,
        warmup=min(d.warmup, max(steps // 10, 1)),
    )
    console = Console(stderr=True)
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        TextColumn("{task.fields[info]}"),
    )
    with Progress(*columns, console=console) as progress:
        report = run_train_head(
            base,
            out,
            data or [],
            self_distill,
            distill_tokens,
            cfg,
            resume,
            eval_tokens,
            () if no_acceptance else (1, 2, 3, 4),
            _hooks(progress, console),
        )
    if as_json:
        print(json.dumps(report))
    else:
        console.print(_summary(report))
        console.print(
            f"head written to {out}; use it with: mlx-mtp generate -m {base} --mtp {out}"
        )
