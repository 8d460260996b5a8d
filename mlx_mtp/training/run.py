"""``mlx-mtp train-head`` as one function: data, shards, training, evaluation.

Everything a run makes lives under ``OUT`` (``OUT/work`` for data and shards,
``OUT/checkpoint`` for training state), and every phase picks up where an
earlier run of the same command stopped: self-distilled answers are appended
as they finish, shards are reused when their windows match, training resumes
from its checkpoint. A time budget (``max_minutes``) or Ctrl-C ends a run
cleanly at the next safe point; running the same command with ``resume=True``
goes on.
"""

import math
import signal
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import mlx.core as mx

from ..errors import MTPError
from ..loader import load
from . import evaluate
from .corpus import DEFAULT_CORPUS_TOKENS, read_text, short_warning, text_files
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
from .prompts import (
    DEFAULT_EVAL_PER_KIND,
    eval_prompts,
    render_prompt,
    training_prompts,
    validation_prompts,
)
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
    # once the model is loaded: what the run will do, about how many seconds
    planned: Callable[[str, float], Any] = lambda what, seconds: None


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


@dataclass
class DataConfig:
    """Where the training text comes from, and how the trunk reads it."""

    files: Sequence[Path] = ()  # --data: text or JSON lines, answers included
    text: Sequence[Path] = ()  # --text: files or folders, read teacher-forced
    corpus: bool = False  # --corpus: the ready corpus (``corpus.py``)
    text_tokens: int = 0  # text tokens at most (0: all given; corpus: 1 M)
    self_distill: int = 0  # the trunk's answers to this many generated prompts
    distill_tokens: int = DEFAULT_DISTILL_TOKENS
    distill_batch: int = DEFAULT_DISTILL_BATCH
    trunk_batch: int = DEFAULT_TRUNK_BATCH
    validation: int = DEFAULT_VALIDATION_PROMPTS


@dataclass
class RunConfig:
    """How a run goes on, stops and ends."""

    resume: bool = False
    eval_tokens: int = DEFAULT_EVAL_TOKENS
    eval_draft_maxes: Sequence[int] = DEFAULT_EVAL_DRAFT_MAXES
    eval_per_kind: int = DEFAULT_EVAL_PER_KIND
    max_minutes: float = 0.0


def capped(data: DataConfig, cfg: TrainConfig) -> DataConfig:
    """``data`` with no more to prepare than ``cfg.steps`` can use: the steps
    read ``steps x batch_size`` windows of ``seq_len`` tokens, so no more
    self-distilled answers (each one a window at least) or validation prompts
    than those windows, and no more text tokens or answer tokens than theirs."""
    windows = cfg.steps * cfg.batch_size
    tokens = windows * cfg.seq_len
    text = data.text_tokens or (DEFAULT_CORPUS_TOKENS if data.corpus else tokens)
    return replace(
        data,
        self_distill=min(data.self_distill, windows),
        validation=min(data.validation, windows),
        distill_tokens=min(data.distill_tokens, tokens),
        text_tokens=min(text, tokens) if data.text or data.corpus else 0,
    )


class _Stopped(Exception):
    """A phase ended early (time or Ctrl-C); its work so far is saved."""

    def __init__(self, phase: str):
        super().__init__(phase)
        self.phase = phase


def train_head(
    base: Path,
    out: Path,
    data: DataConfig,
    cfg: TrainConfig | None = None,
    run: RunConfig | None = None,
    hooks: Hooks | None = None,
    stop: Stop | None = None,
) -> dict[str, Any]:
    """Train an MTP head for the model folder ``base`` and write it to ``out``.

    Returns a report (data sizes, per-depth agreement, held-out acceptance,
    ``"complete": False`` when time or Ctrl-C ended the run first).
    """
    cfg, run = cfg or TrainConfig(), run or RunConfig()
    stop = stop or Stop(run.max_minutes)
    rows = _check(base, Path(out), data, cfg, run)  # before any model work
    hooks = hooks or Hooks()
    prepared = capped(data, cfg)
    phases = _Phases(base, Path(out), prepared, cfg, run, hooks, stop)
    hooks.planned(*phases.plan(prepared != data))
    with interruptible(stop):
        try:
            windows = phases.windows(rows)
            sets = phases.hidden_states(windows)
            head = phases.train(windows, sets)
            if run.eval_draft_maxes:
                phases.evaluate(head)
        except _Stopped as s:
            return {**phases.report, "complete": False, "stopped_in": s.phase}
    phases.report["complete"] = True
    return phases.report


def _check(
    base: Path, out: Path, data: DataConfig, cfg: TrainConfig, run: RunConfig
) -> list[list[dict[str, Any]]]:
    """Everything that can be refused before the model is loaded; the --data rows."""
    if out.exists() and not out.is_dir():
        raise MTPError(f"{out}: exists and is not a folder")
    if not (data.files or data.self_distill or data.text or data.corpus):
        raise MTPError(
            "no training data: give --text PATH, --corpus, --data FILE "
            "and/or --self-distill N"
        )
    rows = [check_data_file(Path(f)) for f in data.files]
    text_files(data.text)  # a missing path or an empty folder fails here
    ckpt = out / CHECKPOINT_DIR
    if ckpt.exists() and not run.resume and any(ckpt.iterdir()):
        raise MTPError(
            f"{out}: holds a checkpoint; pass --resume or choose another folder"
        )
    if cfg.depth < 1 or len(cfg.chain_weights) < cfg.depth:
        raise MTPError(f"--depth {cfg.depth} needs as many chain weights")
    return rows


class _Phases:
    """One run's phases over what they share: the model, the configs, the
    work folder, the report so far."""

    def __init__(self, base, out, data, cfg, run, hooks, stop):
        self.base, self.out, self.data, self.cfg, self.run = base, out, data, cfg, run
        self.hooks, self.stop = hooks, stop
        self.mtp_model, self.tokenizer = load(base)
        init_head(self.mtp_model, cfg.eh_init)  # a trunk the head cannot copy fails now
        self.work = out / WORK_DIR
        self.work.mkdir(parents=True, exist_ok=True)
        self.report: dict[str, Any] = {
            "base": base_identity(self.mtp_model.config, base)
        }

    def plan(self, capped_by_steps: bool) -> tuple[str, float]:
        """What this run will do, and about how many seconds it will take at
        the speed of a few steps timed now."""
        data, cfg, run = self.data, self.cfg, self.run
        answers = data.validation + data.self_distill
        distil = f"self-distil {answers} answers of up to {data.distill_tokens} tokens"
        what = [f"{distil} ({data.validation} for validation)"]
        if data.files:
            what.append(f"read {len(data.files)} --data file(s)")
        text = data.text_tokens if data.text or data.corpus else 0
        if text:
            what.append(f"read up to {text:,} tokens of text")
        if capped_by_steps:
            what[-1] += " (as much as the steps can use)"
        what.append(
            f"train {cfg.steps} steps of {cfg.batch_size} x {cfg.seq_len} tokens"
        )
        prompts = eval_prompts(run.eval_per_kind).values()
        generations = sum(map(len, prompts)) * len(run.eval_draft_maxes)
        if generations:
            what.append(f"measure acceptance in {generations} generations")
        # 1) self-distillation, 2) the trunk's pass, 3) training, 4) evaluation
        batch = max(1, min(data.distill_batch, answers))
        step, one, window = _speeds(self.mtp_model.target, batch, cfg.seq_len)
        rounds = sum(math.ceil(n / batch) for n in (data.validation, data.self_distill))
        seconds = rounds * data.distill_tokens * step
        seconds += (answers * data.distill_tokens + text) / cfg.seq_len * window
        seconds += cfg.steps * cfg.batch_size * cfg.depth * window
        seconds += generations * run.eval_tokens * one
        return "train-head: " + ", ".join(what), seconds

    def _distill(self, prompts, name):
        tokens = len(prompts) * self.data.distill_tokens
        self.hooks.phase(f"self-distillation, {name} (tokens)", tokens)
        seqs = self_distill(
            self.mtp_model.target.model,
            self.tokenizer,
            prompts,
            self.data.distill_tokens,
            self.work / f"{name}.jsonl",
            self.data.distill_batch,
            self.hooks.advance,
            self.stop,
        )
        if len(seqs) < len(prompts):
            raise _Stopped("self-distillation")
        return seqs

    def windows(self, rows) -> dict[str, list]:
        """1) the windows: validation answers, chat (--data and the trunk's
        answers), text (--text and --corpus)."""
        data, cfg, tokenizer = self.data, self.cfg, self.tokenizer
        val_prompts = validation_prompts(data.validation, cfg.seed)
        val = self._distill(val_prompts, "validation")
        chat = []
        for f, r in zip(data.files, rows):
            seqs = encode_rows(r, tokenizer)
            n = sum(len(t) for t, _ in seqs)
            if n < cfg.seq_len:
                self.hooks.message(short_warning(str(f), n, cfg.seq_len))
            chat += seqs
        if data.self_distill:
            prompts = training_prompts(data.self_distill, cfg.seed, val_prompts)
            tic, before = time.time(), _tokens(self.work / "distill.jsonl")
            chat += self._distill(prompts, "distill")
            made = _tokens(self.work / "distill.jsonl") - before
            if made:  # answer tokens per second of this run's generation
                rate = made / (time.time() - tic)
                self.report["distill_tokens_per_second"] = rate
        text = []
        if data.text or data.corpus:
            extra = " and the ready corpus" if data.corpus else ""
            self.hooks.message(f"reading text{extra}")
            text = read_text(
                data.text,
                data.corpus,
                tokenizer,
                data.text_tokens,
                cfg.seed,
                self.hooks.message,
                cfg.seq_len,
            )
        windows = {
            "validation": chunk_sequences(val, cfg.seq_len),
            "train": chunk_sequences(chat, cfg.seq_len),
            "text": chunk_sequences(text, cfg.seq_len),
        }
        if not windows["train"] and not windows["text"]:
            raise MTPError(
                "the training data is too short (need sequences of 8+ tokens)"
            )
        return windows

    def hidden_states(self, windows) -> dict[str, ShardSet]:
        """2) the frozen trunk's view of every window, streamed to shards."""
        sets = {}
        for name, wins in windows.items():
            if not wins:
                continue
            total = sum(len(w) for w, _ in wins)
            self.hooks.phase(f"trunk hidden states, {name} (tokens)", total)
            folder = self.work / f"shards-{name}"
            if not write_shards(
                self.mtp_model.target,
                wins,
                self.cfg.seq_len,
                folder,
                self.data.trunk_batch,
                self.hooks.advance,
                self.stop,
            ):
                raise _Stopped("hidden states")
            sets[name] = ShardSet(folder, shard_count(len(wins)))
        return sets

    def train(self, windows, sets):
        """3) train; chat and text windows mixed at ``chat_share``."""
        cfg, hooks = self.cfg, self.hooks
        train_set = ShardSet.join([sets[n] for n in ("train", "text") if n in sets])
        first = (windows["train"] or windows["text"])[0][0]
        head = init_head(self.mtp_model, cfg.eh_init, sample=first)
        hooks.phase("training (steps)", cfg.steps)
        result = train(
            head,
            train_set,
            sets["validation"],
            cfg,
            self.out,
            self.mtp_model.config["vocab_size"],
            self.run.resume,
            hooks.step,
            hooks.evaluated,
            self.stop,
        )
        if result.vocab is not None:  # draft from the tokens it was trained on
            head.draft_vocab = mx.array(result.vocab, dtype=mx.int32)
        self.report.update(
            train_tokens=train_set.tokens(),
            chat_tokens=sets["train"].tokens() if "train" in sets else 0,
            text_tokens=sets["text"].tokens() if "text" in sets else 0,
            train_windows=train_set.rows,
            validation_tokens=sets["validation"].tokens(),
            config=_config_dict(cfg),
            steps=result.steps,
            best_step=result.best_step,
            initial_agreement=result.initial_agreement,
            agreement=result.best_agreement,
            train_seconds=round(result.seconds, 1),
        )
        self._save(head)
        if result.stopped:
            raise _Stopped("training")
        return head

    def evaluate(self, head) -> None:
        """4) held-out acceptance, with the head as the runtime loads it."""
        run = self.run
        loaded, _ = load(self.base, mtp=self.out)
        prompts = eval_prompts(run.eval_per_kind)
        n = sum(len(p) for p in prompts.values()) * len(run.eval_draft_maxes)
        self.hooks.phase("held-out acceptance (generations)", n)
        results = evaluate.by_kind(
            loaded,
            self.tokenizer,
            prompts,
            run.eval_draft_maxes,
            run.eval_tokens,
            self.hooks.advance,
        )
        by_depth = results["all"][max(run.eval_draft_maxes)].per_position_acceptance
        sample = render_prompt(self.tokenizer, next(iter(prompts.values()))[0])
        costs = evaluate.measure_costs(loaded, sample, max(run.eval_draft_maxes))
        self.report.update(
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
        self._save(head)

    def _save(self, head) -> None:
        config = self.mtp_model.config
        save_head(head, config, self.out, self.cfg.dtype, _head_info(self.report))


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


def _speeds(trunk, batch: int, seq_len: int) -> tuple[float, float, float]:
    """Seconds, timed on this machine, of a decode step of ``batch`` streams,
    of one stream, and of reading one window of ``seq_len`` tokens."""

    def timed(fn) -> float:
        fn()  # warm-up
        tic = time.perf_counter()
        fn()
        return time.perf_counter() - tic

    def step(n: int) -> float:
        cache = trunk.make_cache()
        tokens = mx.zeros((n, 1), dtype=mx.int32)
        mx.eval(trunk(mx.zeros((n, 8), dtype=mx.int32), cache)[0])
        return timed(lambda: mx.eval(trunk(tokens, cache)[0]))

    window = mx.zeros((1, seq_len), dtype=mx.int32)
    read = timed(lambda: mx.eval(trunk(window, trunk.make_cache())[0]))
    batched = step(batch)
    return batched, step(1) if batch > 1 else batched, read


def _tokens(path: Path) -> int:
    return sum(len(r["tokens"]) - r["prompt_len"] for r in read_jsonl(path))
