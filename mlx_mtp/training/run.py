"""``mlx-mtp train-head`` as one function: data, shards, training, evaluation.

Everything a run makes lives under ``OUT`` (``OUT/work`` for data and shards,
``OUT/checkpoint`` for training state), and every phase picks up where an
earlier run of the same command stopped: self-distilled answers are appended
as they finish, shards are reused when their windows match, training resumes
from its checkpoint. A time budget (``max_minutes``) or Ctrl-C ends a run
cleanly at the next safe point; running the same command with ``resume=True``
goes on.
"""

import signal
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx

from ..errors import MTPError
from ..loader import load
from . import evaluate
from .data import (
    DEFAULT_DISTILL_BATCH,
    DEFAULT_DISTILL_TOKENS,
    check_data_file,
    chunk_sequences,
    encode_rows,
    read_jsonl,
    self_distill,
)
from .head import init_head, save_head
from .prompts import eval_prompts, render_prompt, training_prompts, validation_prompts
from .shards import ShardSet, shard_count, write_shards
from .trainer import CHECKPOINT_DIR, TrainConfig, train

WORK_DIR = "work"
DEFAULT_VALIDATION_PROMPTS = 32
DEFAULT_TRUNK_BATCH = 8
DEFAULT_EVAL_TOKENS = 64
DEFAULT_EVAL_DRAFT_MAXES = (1, 2, 3)


@dataclass
class Hooks:
    """How a front end follows a run (all optional)."""

    phase: Callable[[str, int], Any] = lambda name, total: None  # new phase, units
    advance: Callable[[int], Any] = lambda n: None  # units done in the phase
    step: Callable[[int, float, int], Any] = lambda step, loss, tokens: None
    evaluated: Callable[[int, list[float]], Any] = lambda step, per_depth: None
    message: Callable[[str], Any] = lambda text: None


class Stop:
    """Says when to stop: after a deadline, or after Ctrl-C (see ``interruptible``)."""

    def __init__(self, max_minutes: float = 0.0):
        self.deadline = time.monotonic() + max_minutes * 60 if max_minutes else None
        self.interrupted = False

    def __call__(self) -> bool:
        late = self.deadline is not None and time.monotonic() > self.deadline
        return self.interrupted or late


@contextmanager
def interruptible(stop: Stop):
    """The first Ctrl-C asks ``stop`` to end the run at the next safe point
    (seconds away); a second one interrupts at once."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        if stop.interrupted:
            raise KeyboardInterrupt
        stop.interrupted = True

    old = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


def base_identity(config: dict[str, Any], base: Path) -> dict[str, Any]:
    """What the head was trained for, without any path of this machine."""
    keys = ("model_type", "num_hidden_layers", "hidden_size", "vocab_size")
    return {"name": Path(base).name, **{k: config.get(k) for k in keys}}


def train_head(
    base: Path,
    out: Path,
    data: Sequence[Path] = (),
    self_distill_prompts: int = 0,
    distill_tokens: int = DEFAULT_DISTILL_TOKENS,
    cfg: TrainConfig | None = None,
    resume: bool = False,
    eval_tokens: int = DEFAULT_EVAL_TOKENS,
    eval_draft_maxes: Sequence[int] = DEFAULT_EVAL_DRAFT_MAXES,
    hooks: Hooks | None = None,
    distill_batch: int = DEFAULT_DISTILL_BATCH,
    trunk_batch: int = DEFAULT_TRUNK_BATCH,
    validation: int = DEFAULT_VALIDATION_PROMPTS,
    max_minutes: float = 0.0,
    eval_per_kind: int = 4,
    stop: Stop | None = None,
) -> dict[str, Any]:
    """Train an MTP head for the model folder ``base`` and write it to ``out``.

    Returns a report (data sizes, per-depth agreement, held-out acceptance,
    ``"complete": False`` when time or Ctrl-C ended the run first).
    """
    cfg = cfg or TrainConfig()
    hooks = hooks or Hooks()
    stop = stop or Stop(max_minutes)
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise MTPError(f"{out}: exists and is not a folder")
    if not data and not self_distill_prompts:
        raise MTPError("no training data: give --data FILE and/or --self-distill N")
    rows = [check_data_file(Path(f)) for f in data]  # before any model work
    ckpt = out / CHECKPOINT_DIR
    if ckpt.exists() and not resume and any(ckpt.iterdir()):
        raise MTPError(
            f"{out}: holds a checkpoint; pass --resume or choose another folder"
        )
    if cfg.depth < 1 or len(cfg.chain_weights) < cfg.depth:
        raise MTPError(f"--depth {cfg.depth} needs as many chain weights")
    mtp_model, tokenizer = load(base)
    work = out / WORK_DIR
    work.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"base": base_identity(mtp_model.config, base)}

    def stopped(phase: str) -> dict[str, Any]:
        return {**report, "complete": False, "stopped_in": phase}

    with interruptible(stop):
        # 1) the trunk's own answers: validation prompts first, then training prompts
        model = mtp_model.trunk.model

        def distill(prompts, name):
            path = work / f"{name}.jsonl"
            hooks.phase(f"self-distillation, {name} (answers)", len(prompts))
            return self_distill(
                model,
                tokenizer,
                prompts,
                distill_tokens,
                path,
                distill_batch,
                hooks.advance,
                stop,
            )

        val_prompts = validation_prompts(validation, cfg.seed)
        val_seqs = distill(val_prompts, "validation")
        if len(val_seqs) < len(val_prompts):
            return stopped("self-distillation")
        seqs = [s for r in rows for s in encode_rows(r, tokenizer)]
        if self_distill_prompts:
            prompts = training_prompts(self_distill_prompts, cfg.seed, val_prompts)
            tic, before = time.time(), _tokens(work / "distill.jsonl")
            distilled = distill(prompts, "distill")
            made = _tokens(work / "distill.jsonl") - before
            if made:  # answer tokens per second of this run's generation
                report["distill_tokens_per_second"] = made / (time.time() - tic)
            if len(distilled) < len(prompts):
                return stopped("self-distillation")
            seqs += distilled
        windows = chunk_sequences(seqs, cfg.seq_len)
        val_windows = chunk_sequences(val_seqs, cfg.seq_len)
        if not windows:
            raise MTPError(
                "the training data is too short (need sequences of 8+ tokens)"
            )

        # 2) the frozen trunk's view, streamed to shards
        sets = {}
        for name, wins in (("validation", val_windows), ("train", windows)):
            hooks.phase(
                f"trunk hidden states, {name} (tokens)", sum(len(w) for w, _ in wins)
            )
            folder = work / f"shards-{name}"
            if not write_shards(
                mtp_model.trunk,
                wins,
                cfg.seq_len,
                folder,
                trunk_batch,
                hooks.advance,
                stop,
            ):
                return stopped("hidden states")
            sets[name] = ShardSet(folder, shard_count(len(wins)))
        train_set, val_set = sets["train"], sets["validation"]

        # 3) train
        head = init_head(mtp_model, cfg.eh_init, sample=windows[0][0])
        hooks.phase("training (steps)", cfg.steps)
        result = train(
            head,
            train_set,
            val_set,
            cfg,
            out,
            mtp_model.config["vocab_size"],
            resume,
            hooks.step,
            hooks.evaluated,
            stop,
        )
        if result.vocab is not None:  # draft from the tokens the head was trained on
            head.draft_vocab = mx.array(result.vocab, dtype=mx.int32)
        report.update(
            train_tokens=train_set.tokens(),
            train_windows=len(windows),
            validation_tokens=val_set.tokens(),
            config=_config_dict(cfg),
            steps=result.steps,
            best_step=result.best_step,
            initial_agreement=result.initial_agreement,
            agreement=result.best_agreement,
            train_seconds=round(result.seconds, 1),
        )
        save_head(head, mtp_model.config, out, cfg.dtype, _head_info(report))
        if result.stopped:
            return stopped("training")

        # 4) held-out acceptance, with the head as the runtime loads it
        if eval_draft_maxes:
            loaded, _ = load(base, mtp=out)
            prompts = eval_prompts(eval_per_kind)
            n = sum(len(p) for p in prompts.values()) * len(eval_draft_maxes)
            hooks.phase("held-out acceptance (generations)", n)
            results = evaluate.by_kind(
                loaded, tokenizer, prompts, eval_draft_maxes, eval_tokens, hooks.advance
            )
            by_depth = results["all"][max(eval_draft_maxes)].per_position_acceptance
            sample = render_prompt(tokenizer, next(iter(prompts.values()))[0])
            costs = evaluate.measure_costs(loaded, sample, max(eval_draft_maxes))
            report.update(
                acceptance={
                    kind: {k: evaluate.summary(s) for k, s in per_k.items()}
                    for kind, per_k in results.items()
                },
                table=evaluate.table(results),
                costs=costs,
                expected_speedups=evaluate.expected_speedups(by_depth, costs),
                recommended_draft_max=evaluate.recommend_draft_max(by_depth, costs),
                acceptance_by_depth=[round(a, 4) for a in by_depth],
            )
            save_head(head, mtp_model.config, out, cfg.dtype, _head_info(report))
    report["complete"] = True
    return report


def _head_info(report: dict[str, Any]) -> dict[str, Any]:
    """mtp_config.json's keys besides the family's: how to use the head, how it
    was made."""
    top = ("recommended_draft_max", "acceptance_by_depth")
    info = {k: report[k] for k in top if k in report}
    info["training"] = {k: v for k, v in report.items() if k not in top + ("table",)}
    return info


def _config_dict(cfg: TrainConfig) -> dict[str, Any]:
    d = asdict(cfg)
    d["chain_weights"] = list(cfg.chain_weights)
    return d


def _tokens(path: Path) -> int:
    return sum(len(r["tokens"]) - r["prompt_len"] for r in read_jsonl(path))
