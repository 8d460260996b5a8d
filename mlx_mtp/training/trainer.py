"""Train an MTP head on the frozen trunk's shards, chained drafts included.

Every step draws windows from the shards, runs the head over them at depths
1..``depth`` exactly as the runtime chains drafts (``head.chain_forward``:
the training-time test of HASS and EAGLE-3), and minimises a weighted sum of
the per-depth losses. Held-out agreement per depth decides the best weights
and early stopping; checkpoints hold everything ``resume`` needs.
"""

import itertools
import json
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
from mlx import nn
from mlx.utils import tree_flatten, tree_unflatten

from ..heads.base import MTPHead
from .head import chain_forward, output_rows, shift
from .shards import ShardSet, target_mask

CHECKPOINT_DIR = "checkpoint"
DEFAULT_STEPS = 2000
DEFAULT_BATCH_SIZE = 8
DEFAULT_SEQ_LEN = 256
DEFAULT_LR = 1e-3
DEFAULT_DEPTH = 3
DEFAULT_CHAIN_WEIGHTS = (1.0, 0.7, 0.5)
DEFAULT_VOCAB_TOP = 8192
DISTILL_TARGETS = ("top8", "full", "hard")
DEFAULT_CHAT_SHARE = 0.5


@dataclass
class TrainConfig:
    """Everything that decides a run; saved beside the head so it can be repeated."""

    steps: int = DEFAULT_STEPS
    batch_size: int = DEFAULT_BATCH_SIZE
    seq_len: int = DEFAULT_SEQ_LEN
    lr: float = DEFAULT_LR
    warmup: int = 50
    weight_decay: float = 0.0
    seed: int = 0
    eval_every: int = 100
    patience: int = 5  # evaluations without improvement before stopping
    save_every: int = 100
    eh_init: str = "hidden"  # eh_proj starts as the identity on this half
    dtype: str = "bfloat16"  # of the saved head
    vocab_top: int = (
        DEFAULT_VOCAB_TOP  # draft from the k most frequent targets (0: all)
    )
    distill: str = "top8"  # target: the trunk's top-8, its full distribution, or argmax
    depth: int = DEFAULT_DEPTH  # chained drafts trained (1: the first draft only)
    chain_weights: tuple[float, ...] = DEFAULT_CHAIN_WEIGHTS  # loss weight per depth
    # share of the windows drawn from the first part of a joined set (the chat
    # answers) when the text follows it; 0: every window equally likely
    chat_share: float = DEFAULT_CHAT_SHARE


@dataclass
class TrainResult:
    steps: int
    best_step: int
    best_agreement: list[float]  # per depth, held-out
    initial_agreement: list[float]
    losses: list[float] = field(default_factory=list)
    seconds: float = 0.0
    vocab: list[int] | None = None  # the subset the head drafts from
    stopped: bool = False  # interrupted or out of time; the checkpoint holds the rest


class Vocab:
    """The draft vocabulary: output rows of a token subset, and the id remap."""

    def __init__(self, head: MTPHead, keep: np.ndarray | None, vocab_size: int):
        self.keep = keep
        if keep is None:
            self.rows, self.table = mx.stop_gradient(output_rows(head)), None
        else:
            self.rows = mx.stop_gradient(
                output_rows(head, mx.array(keep.astype(np.int32)))
            )
            self.table = np.full(vocab_size, -1, np.int64)
            self.table[keep] = np.arange(len(keep))

    def remap(self, ids: np.ndarray) -> np.ndarray:
        return ids if self.table is None else self.table[ids]


def choose_vocab(train: ShardSet, vocab_size: int, k: int) -> np.ndarray | None:
    """The ``k`` most frequent greedy targets (None: the whole vocabulary)."""
    if not k:
        return None
    counts = train.target_counts(vocab_size)
    return np.argsort(-counts, kind="stable")[: min(k, int((counts > 0).sum()))]


def make_batch(raw: dict[str, np.ndarray], vocab: Vocab) -> dict[str, mx.array]:
    """Row ``i`` of a window pairs ``(h_i, t_{i+1})`` with targets for ``t_{i+2}``."""
    seq_len = raw["tokens"].shape[1]
    target = vocab.remap(raw["greedy"][:, 1:])
    soft = vocab.remap(raw["soft_ids"][:, 1:])
    return {
        "hidden": mx.array(raw["hidden"][:, :-1]),
        "next": mx.array(raw["tokens"][:, 1:]),
        "target": mx.array(np.maximum(target, 0).astype(np.int32)),
        "in_vocab": mx.array(target >= 0),
        "mask": mx.array(target_mask(raw["meta"], seq_len)),
        "soft_ids": mx.array(np.maximum(soft, 0).astype(np.int32)),
        "soft_probs": mx.where(
            mx.array(soft >= 0), mx.array(raw["soft_probs"][:, 1:]), 0
        ),
        # the trunk's own logits for t_{i+2} are its output head at h_{i+1}
        "next_hidden": mx.array(raw["hidden"][:, 1:]),
    }


def chain_losses(
    head: MTPHead, batch: dict[str, mx.array], vocab: Vocab, cfg: TrainConfig
):
    """Weighted sum of per-depth losses, and the per-depth losses themselves.

    Depth ``d`` (0-based) at ``p`` predicts ``t_{p+d+2}``: its targets are the
    depth-1 targets shifted by ``d``, kept where the chain's start and its own
    target both lie in the answer.
    """
    outs = chain_forward(head, batch["hidden"], batch["next"], cfg.depth)
    total, per_depth = 0.0, []
    for d, h in enumerate(outs):
        logits = h @ vocab.rows.T
        mask = batch["mask"] & shift(batch["mask"], d, False)
        if cfg.distill == "hard":
            mask = mask & shift(batch["in_vocab"], d, False)
            ce = nn.losses.cross_entropy(
                logits, shift(batch["target"], d), reduction="none"
            )
        else:
            logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            if cfg.distill == "full":
                trunk = shift(batch["next_hidden"], d).astype(mx.float32) @ vocab.rows.T
                probs = mx.softmax(trunk, axis=-1)
                ce = -(probs * logp).sum(-1)
            else:
                probs = shift(batch["soft_probs"], d).astype(mx.float32)
                picked = mx.take_along_axis(logp, shift(batch["soft_ids"], d), axis=-1)
                ce = -(probs * picked).sum(-1) / mx.maximum(probs.sum(-1), 1e-6)
        m = mask.astype(mx.float32)
        loss = (ce * m).sum() / mx.maximum(m.sum(), 1)
        per_depth.append(loss)
        total = total + cfg.chain_weights[d] * loss
    return total, mx.stack(per_depth)


def agreement(
    head: MTPHead, shards: ShardSet, vocab: Vocab, depth: int, batch: int = 8
) -> list[float]:
    """Teacher-forced top-1 agreement with the trunk's greedy token, per depth."""
    hits, total = np.zeros(depth), np.zeros(depth)
    for s in range(0, shards.rows, batch):
        b = make_batch(shards.batch(range(s, min(s + batch, shards.rows))), vocab)
        outs = chain_forward(head, b["hidden"], b["next"], depth)
        for d, h in enumerate(outs):
            mask = b["mask"] & shift(b["mask"], d, False)
            guess = mx.argmax(h @ vocab.rows.T, axis=-1)
            ok = (guess == shift(b["target"], d)) & shift(b["in_vocab"], d, False)
            hits[d] += (ok & mask).sum().item()
            total[d] += mask.sum().item()
    return (hits / np.maximum(total, 1)).tolist()


def expected_length(per_depth: Sequence[float]) -> float:
    """Tokens per verify pass if depth ``j`` is accepted with rate ``a_j`` given
    the ones before (1 + a_1 + a_1 a_2 + ...): the score that picks the best step."""
    run, total = 1.0, 1.0
    for a in per_depth:
        run *= a
        total += run
    return total


def _schedule(cfg: TrainConfig):
    warm = optim.linear_schedule(cfg.lr * 0.01, cfg.lr, max(cfg.warmup, 1))
    decay = optim.cosine_decay(cfg.lr, max(cfg.steps - cfg.warmup, 1), cfg.lr * 0.05)
    return optim.join_schedules([warm, decay], [max(cfg.warmup, 1)])


def _save_checkpoint(head, opt, state: dict, ckpt: Path) -> None:
    ckpt.mkdir(parents=True, exist_ok=True)
    for name, arrays in (
        ("head", dict(tree_flatten(head.trainable_parameters()))),
        ("optimizer", dict(tree_flatten(opt.state))),
    ):
        tmp = ckpt / f".{name}.tmp.safetensors"
        arrays = {k: v for k, v in arrays.items() if isinstance(v, mx.array)}
        mx.save_safetensors(str(tmp), arrays)
        tmp.replace(ckpt / f"{name}.safetensors")
    tmp = ckpt / ".state.json.tmp"
    tmp.write_text(json.dumps(state))
    tmp.replace(ckpt / "state.json")


def _load_checkpoint(head, opt, ckpt: Path) -> dict:
    head.load_weights(str(ckpt / "head.safetensors"))
    opt.init(head.trainable_parameters())
    saved = mx.load(str(ckpt / "optimizer.safetensors"))
    opt.state = tree_unflatten(list({**dict(tree_flatten(opt.state)), **saved}.items()))
    return json.loads((ckpt / "state.json").read_text())


def _order(parts: Sequence[int], share: float, seed: int, skip: int):
    """Window indices, deterministic from ``seed``, after the first ``skip``.

    One part: a new shuffle every epoch. Two parts with ``share`` > 0: each
    draw comes from the first part with probability ``share``, else from the
    second; each part runs through its own shuffles.
    """
    if len(parts) < 2 or not share or not all(parts):
        yield from _shuffled(sum(parts), seed, skip)
        return
    first, second = _shuffled(parts[0], seed, 0), _shuffled(parts[1], seed + 1, 0)
    rng = random.Random(seed * 7919 + 1)
    for emitted in itertools.count():
        i = next(first) if rng.random() < share else parts[0] + next(second)
        if emitted >= skip:
            yield i


def _shuffled(n: int, seed: int, skip: int):
    """``range(n)``, reshuffled every epoch."""
    epoch, emitted = 0, 0
    while True:
        perm = list(range(n))
        random.Random(seed * 1000003 + epoch).shuffle(perm)
        for i in perm:
            if emitted >= skip:
                yield i
            emitted += 1
        epoch += 1


def _keep_best(head: MTPHead, acc: list[float], step: int, state: dict, ckpt: Path):
    """Score a held-out evaluation; the head's weights (also saved) when best."""
    score = expected_length(acc)
    if score <= state["best_score"]:
        state["bad_evals"] += 1
        return None
    state.update(best_step=step, best_score=score, bad_evals=0, best_agreement=acc)
    weights = dict(tree_flatten(head.trainable_parameters()))
    ckpt.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(ckpt / "best.safetensors"), weights)
    return weights


def train(
    head: MTPHead,
    train_set: ShardSet,
    val_set: ShardSet,
    cfg: TrainConfig,
    out: Path,
    vocab_size: int,
    resume: bool = False,
    on_step: Callable[[int, float, int], None] | None = None,
    on_eval: Callable[[int, list[float]], None] | None = None,
    should_stop: Callable[[], bool] = lambda: False,
) -> TrainResult:
    """Train ``head`` with AdamW; keep the weights with the best held-out score.

    Every ``eval_every`` steps the per-depth agreement on ``val_set`` is
    measured and scored by ``expected_length``; training stops after
    ``patience`` evaluations without improvement. ``out/checkpoint`` is
    written every ``save_every`` steps and whenever ``should_stop()`` ends the
    run early, and holds what ``resume=True`` needs to go on.
    """
    if len(cfg.chain_weights) < cfg.depth:
        raise ValueError(f"need {cfg.depth} chain weights, got {cfg.chain_weights}")
    mx.random.seed(cfg.seed)
    opt = optim.AdamW(learning_rate=_schedule(cfg), weight_decay=cfg.weight_decay)
    ckpt = out / CHECKPOINT_DIR
    keep = choose_vocab(train_set, vocab_size, cfg.vocab_top)
    vocab = Vocab(head, keep, vocab_size)
    # chains are measured to the default depth even when trained shallower
    eval_depth = max(cfg.depth, DEFAULT_DEPTH)
    state = {"step": 0, "best_step": 0, "best_score": -1.0, "bad_evals": 0}
    if resume and (ckpt / "state.json").exists():
        state = _load_checkpoint(head, opt, ckpt)
    if "initial_agreement" not in state:
        state["initial_agreement"] = agreement(head, val_set, vocab, eval_depth)
        state["best_agreement"] = state["initial_agreement"]
        state["best_score"] = expected_length(state["initial_agreement"])
        if on_eval is not None:
            on_eval(0, state["initial_agreement"])
    best_weights = dict(tree_flatten(head.trainable_parameters()))
    if resume and (ckpt / "best.safetensors").exists():
        best_weights = mx.load(str(ckpt / "best.safetensors"))

    loss_and_grad = nn.value_and_grad(head, chain_losses)
    skip = state["step"] * cfg.batch_size
    order = _order(train_set.parts, cfg.chat_share, cfg.seed, skip)
    losses: list[float] = []
    t0, step, stopped = time.time(), state["step"], False
    while step < cfg.steps:
        if should_stop():
            stopped = True
            break
        step += 1
        raw = train_set.batch([next(order) for _ in range(cfg.batch_size)])
        batch = make_batch(raw, vocab)
        (loss, _), grads = loss_and_grad(head, batch, vocab, cfg)
        opt.update(head, grads)
        mx.eval(head.parameters(), opt.state, loss)
        losses.append(loss.item())
        if on_step is not None:
            n = int(target_mask(raw["meta"], raw["tokens"].shape[1]).sum())
            on_step(step, losses[-1], n)
        if step % cfg.eval_every == 0 or step == cfg.steps:
            acc = agreement(head, val_set, vocab, eval_depth)
            if on_eval is not None:
                on_eval(step, acc)
            best_weights = _keep_best(head, acc, step, state, ckpt) or best_weights
        state["step"] = step
        if step % cfg.save_every == 0:
            _save_checkpoint(head, opt, state, ckpt)
        if state["bad_evals"] >= cfg.patience:
            break
    state["step"] = step
    _save_checkpoint(head, opt, state, ckpt)
    head.load_weights(list(best_weights.items()))
    mx.eval(head.parameters())
    return TrainResult(
        steps=step,
        best_step=state["best_step"],
        best_agreement=state["best_agreement"],
        initial_agreement=state["initial_agreement"],
        losses=losses,
        seconds=time.time() - t0,
        vocab=None if keep is None else keep.tolist(),
        stopped=stopped,
    )
