"""``mlx-mtp tune``: measure drafting costs and acceptance here (work: ``mlx_mtp.tune``)."""

import json
import sys
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from mlx_mtp.defaults import DEFAULT_TUNE_REPEATS, DEFAULT_TUNE_TOKENS, MAX_DRAFT_MAX

from . import options as o
from .app import OUTPUT, SPECULATIVE, app, fail


def tune_table(entry: dict) -> Table:
    costs, speedups = entry["costs"], entry["speedups"]
    t = Table(title=f"plain step {entry['step_ms']:.1f} ms = 1")
    for name in ("k", "verify k+1", "drafts", "round", "accept", "bound", "rounds"):
        t.add_column(name, justify="right", no_wrap=True)
    for k in range(entry["draft_max"] + 1):
        t.add_row(
            str(k),
            f"{costs['verify'][k]:.3f}",
            "-" if k == 0 else f"{costs['draft'][k - 1]:.3f}",
            f"{costs['round'][k]:.3f}",
            "-" if k == 0 else f"{entry['acceptance_by_depth'][k - 1]:.2f}",
            f"{speedups['bound'][k]:.2f}",
            f"{speedups['rounds'][k]:.2f}",
        )
    return t


def drafter_table(entry: dict, name: str) -> Table:
    """A drafter's rows: its drafts' cost, acceptance and predicted speed-up
    per count (verify costs extended past those measured)."""
    drafts = entry["costs"]["drafters"][name]
    accept = entry["drafters_acceptance"][name]
    bound = entry["drafter_speedups"][name]
    t = Table(title=f"drafter {name}")
    for column in ("k", "drafts", "accept", "bound"):
        t.add_column(column, justify="right", no_wrap=True)
    for k in range(1, len(drafts) + 1):
        t.add_row(
            str(k), f"{drafts[k - 1]:.3f}", f"{accept[k - 1]:.2f}", f"{bound[k]:.2f}"
        )
    return t


@app.command()
def tune(
    model: o.ModelPath = None,
    mtp: o.HeadPath = None,
    draft: o.DraftPath = None,
    hidden_tap: o.HiddenTap = None,
    draft_max: Optional[int] = typer.Option(
        None,
        "--draft-max",
        min=1,
        max=MAX_DRAFT_MAX,
        help="Measure up to this many drafts per round (default: the head's"
        " recommended count, else 3).",
        rich_help_panel=SPECULATIVE,
    ),
    max_tokens: int = typer.Option(
        DEFAULT_TUNE_TOKENS,
        "--max-tokens",
        "-n",
        min=1,
        help="Tokens generated per prompt for the acceptance.",
    ),
    repeats: int = typer.Option(
        DEFAULT_TUNE_REPEATS,
        "--repeats",
        "-r",
        min=1,
        help="Repetitions of every timing (medians are kept).",
    ),
    clock: str = typer.Option(
        "wall",
        "--clock",
        help="wall: wall-clock time; cpu: this process's CPU time, steadier on a"
        " CPU shared with other jobs (run BLAS with one thread then).",
    ),
    no_store: bool = typer.Option(
        False,
        "--no-store",
        help="Print the result, store nothing.",
        rich_help_panel=OUTPUT,
    ),
    as_json: bool = typer.Option(
        False, "--json", help="Print the stored entry as JSON.", rich_help_panel=OUTPUT
    ),
):
    """Measure what drafting costs and gains for a model on this machine, and store it.

    Later runs of generate, chat and bench start their choice of drafts per
    round from it (on this machine only).
    """
    from mlx_mtp.config import default_draft_max, store_tuned
    from mlx_mtp.tune import CLOCKS, too_small
    from mlx_mtp.tune import tune as run_tune

    if clock not in CLOCKS:
        raise fail(f"--clock must be one of {', '.join(CLOCKS)}")
    _, loaded, tokenizer = o.load_model(model, mtp, hidden_tap, draft=draft)
    if draft_max is None:
        draft_max = max(1, default_draft_max(loaded))
    err = Console(stderr=True, highlight=False)
    with err.status("tuning") as status:
        entry = run_tune(
            loaded,
            tokenizer,
            draft_max,
            max_tokens,
            repeats,
            progress=lambda msg: status.update(f"tuning: {msg}"),
            clock=clock,
        )
    small = None if no_store else too_small(entry)
    where = None if no_store or small else store_tuned(loaded, entry)
    if as_json:
        print(json.dumps(entry))
        if small:
            _not_stored(small)
        return
    console = Console(highlight=False)
    m = entry["machine"]
    blas = f", {m['blas']}" if m["blas"] else ""
    console.print(
        f"{m['device']} ({m['backend']}{blas}), mlx {m['mlx']}; weights "
        f"{entry['model']['weights']}; {entry['tokens']} tokens drafted at k = "
        f"{draft_max}",
        markup=False,
        soft_wrap=True,
    )
    console.print(tune_table(entry))
    for name in entry.get("drafters_acceptance") or {}:
        console.print(drafter_table(entry, name))
    rounds = entry["speedups"]["rounds"]
    best = max(range(len(rounds)), key=rounds.__getitem__)
    console.print(
        "costs in plain steps: verify over k+1 tokens, the head's k drafts, a whole "
        "round; accept: P(draft k kept | drafts before kept); predicted speed-up "
        "E(k) / cost: bound from the parts, rounds from whole rounds",
        style="dim",
        markup=False,
    )
    console.print(
        f"predicted best: k = {best} ({rounds[best]:.2f}x); "
        f"took {entry['seconds']:.0f} s",
        markup=False,
    )
    trials = entry.get("draft_vocab_trials")
    if trials:
        parts = [
            f"{t['size'] or 'all'}: depth-1 acceptance {t['acceptance_1']:.2f}, "
            f"a draft {t['draft'][0]:.3f}, best {t['speedup']:.2f}x"
            for t in trials
        ]
        chosen = len(entry.get("draft_vocab") or []) or "all tokens"
        console.print(
            "draft vocabulary (most expected tokens): "
            + "; ".join(parts)
            + f"; drafting from {chosen}",
            markup=False,
            soft_wrap=True,
        )
    if where is not None:
        print(f"stored in {where}", file=sys.stderr)
    if small:
        _not_stored(small)


def _not_stored(why: str) -> None:
    # printed last, and with --json too: the user asked for it to be stored
    print(
        f"notice: not stored, the sample is too small to start later runs from: "
        f"{why}; raise -n or -r",
        file=sys.stderr,
    )
