"""Train a DeepSeek-style MTP head for a model that has none (``mlx-mtp train-head``).

The head is one MTP layer (enorm, hnorm, eh_proj, one decoder block of the
trunk's own class, shared_head.norm) sharing the trunk's embedding and output
head. The trunk stays frozen, so its post-norm hidden states are computed once
and stored; training then only runs the head over ``(h_i, t_{i+1})`` pairs with
the trunk's own greedy choice for ``t_{i+2}`` as the target (what a verify
pass will accept). The result is ``OUT/mtp.safetensors`` plus
``OUT/mtp_config.json``, which ``mlx_mtp.load(BASE, mtp=OUT)`` attaches.
"""

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten

from .errors import MTPError
from .heads import deepseek
from .heads.base import MTPHead
from .loader import HEAD_CONFIG_FILE, MTPModel
from .trunk import find_backbone, output_head

HEAD_FILE = "mtp.safetensors"
CHECKPOINT_DIR = "checkpoint"
WORK_DIR = "work"
DEFAULT_SEQ_LEN = 256
DEFAULT_BATCH_SIZE = 8
DEFAULT_LR = 3e-4


@dataclass
class TrainConfig:
    """Everything that decides a run; saved beside the head so it can be repeated."""

    steps: int = 2000
    batch_size: int = DEFAULT_BATCH_SIZE
    seq_len: int = DEFAULT_SEQ_LEN
    lr: float = DEFAULT_LR
    warmup: int = 50
    weight_decay: float = 0.0
    seed: int = 0
    eval_every: int = 100
    patience: int = 5  # evaluations without improvement before stopping
    save_every: int = 200
    eh_init: str = "hidden"  # eh_proj starts as the identity on this half
    dtype: str = "bfloat16"  # of the saved head
    vocab_top: int = 0  # train the softmax over the k most frequent targets (0: all)
    soft_targets: bool = (
        True  # distil the trunk's top-K probabilities, not only its argmax
    )


@dataclass
class Dataset:
    """Precomputed training windows: the frozen trunk's view of each token."""

    hidden: mx.array  # [N, L, D] post-norm trunk hidden states h_i (float16)
    next_tokens: mx.array  # [N, L] t_{i+1}
    targets: mx.array  # [N, L] the trunk's greedy t_{i+2}
    mask: mx.array  # [N, L] 1 where a target exists
    soft_ids: mx.array  # [N, L, K] the trunk's top-K tokens for t_{i+2}
    soft_probs: mx.array  # [N, L, K] their probabilities (float16)

    @property
    def tokens(self) -> int:
        return int(self.mask.sum().item())


@dataclass
class TrainResult:
    steps: int
    best_step: int
    best_agreement: float
    initial_agreement: float
    losses: List[float] = field(default_factory=list)
    seconds: float = 0.0
    vocab: Optional[List[int]] = None  # the subset the softmax was trained over


# -- the head -----------------------------------------------------------------
def init_head(
    mtp_model: MTPModel, eh_init: str = "hidden", sample: Optional[List[int]] = None
) -> MTPHead:
    """A DeepSeek-style head initialised from the trunk.

    The block copies the trunk's last decoder layer; ``eh_proj`` starts as the
    identity on the hidden half (or the embedding half), so the untrained head
    continues the trunk's last layer; shared_head.norm copies the final norm.
    With a ``sample`` of tokens, hnorm is scaled to the RMS of the trunk's
    residual stream before its final norm, the scale the copied block expects
    (a unit-RMS input lets the block's update swamp it).
    """
    if eh_init not in ("hidden", "embedding"):
        raise MTPError(f"eh_proj init must be hidden or embedding, not {eh_init!r}")
    model = mtp_model.trunk.model
    backbone = find_backbone(model)
    args = model.args
    block = deepseek.make_block(backbone, args, args.num_hidden_layers)
    block.update(backbone.layers[-1].parameters())
    head = deepseek.DeepSeekMTP(args, block, has_embed=False, has_head=False)
    d = args.hidden_size
    eye, zero = mx.eye(d), mx.zeros((d, d))
    halves = [zero, eye] if eh_init == "hidden" else [eye, zero]
    head.eh_proj.weight = mx.concatenate(halves, axis=1)
    head.shared_head.norm.weight = mx.array(backbone.norm.weight)
    if sample is not None:
        head.hnorm.weight = head.hnorm.weight * residual_rms(mtp_model, sample)
    head.set_dtype(mx.float32)
    head.bind(backbone.embed_tokens, output_head(model))
    mx.eval(head.parameters())
    return head


def residual_rms(mtp_model: MTPModel, tokens: List[int]) -> float:
    """Mean RMS of the trunk's last residual state (before its final norm)."""
    trunk = mtp_model.trunk
    where, trunk.hidden_tap = trunk.hidden_tap, "pre"
    try:
        _, pre = trunk(mx.array([tokens]), trunk.make_cache())
    finally:
        trunk.hidden_tap = where
    return mx.sqrt(mx.mean(pre.astype(mx.float32) ** 2, axis=-1)).mean().item()


def head_prefix(config: Dict[str, Any]) -> str:
    return deepseek.prefix(config)


def save_head(head: MTPHead, config: Dict[str, Any], out: Path, dtype: str, info: dict):
    """Write ``mtp.safetensors`` and ``mtp_config.json`` into ``out`` atomically."""
    out.mkdir(parents=True, exist_ok=True)
    pre = head_prefix(config)
    weights = {}
    for name, value in tree_flatten(head.trainable_parameters()):
        rel = name[len("block.") :] if name.startswith("block.") else name
        floating = mx.issubdtype(value.dtype, mx.floating)
        weights[f"{pre}{rel}"] = value.astype(getattr(mx, dtype)) if floating else value
    tmp = out / f".{HEAD_FILE}.tmp.safetensors"
    mx.save_safetensors(str(tmp), weights, metadata={"mtp_family": "deepseek"})
    tmp.replace(out / HEAD_FILE)
    meta = {"family": "deepseek", "prefix": pre, "num_nextn_predict_layers": 1, **info}
    tmp = out / f".{HEAD_CONFIG_FILE}.tmp"
    tmp.write_text(json.dumps(meta, indent=2) + "\n")
    tmp.replace(out / HEAD_CONFIG_FILE)


# -- data ---------------------------------------------------------------------
SOFT_TOP = 8  # trunk probabilities kept per position for distillation


Window = Union[List[int], Tuple[List[int], int]]  # tokens, or (tokens, answer start)


def _split(window: Window) -> Tuple[List[int], int]:
    return window if isinstance(window, tuple) else (window, 0)


def trunk_view(
    mtp_model: MTPModel, windows: Sequence[List[int]], seq_len: int, batch: int = 8
):
    """The frozen trunk's hidden states and greedy tokens over padded windows."""
    trunk = mtp_model.trunk
    for start in range(0, len(windows), batch):
        group = windows[start : start + batch]
        tokens = mx.array([w + [0] * (seq_len - len(w)) for w in group])
        logits, hidden = trunk(tokens, trunk.make_cache())
        greedy = mx.argmax(logits, axis=-1).astype(mx.int32)
        ids = mx.argpartition(-logits, SOFT_TOP - 1, axis=-1)[..., :SOFT_TOP]
        logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        probs = mx.exp(mx.take_along_axis(logp, ids, axis=-1)).astype(mx.float16)
        soft = (ids.astype(mx.int32), probs)
        mx.eval(hidden, greedy, soft)
        yield group, tokens, hidden.astype(mx.float16), greedy, soft


def build_dataset(
    mtp_model: MTPModel,
    windows: Sequence[Window],
    seq_len: int,
    progress: Optional[Callable[[int], None]] = None,
) -> Dataset:
    """Teacher-forced pairs for every window: row ``i`` pairs ``(h_i, t_{i+1})``.

    The target at ``i`` is the trunk's greedy token after ``t_{i+1}`` (the
    argmax at position ``i + 1``), which is what a verify pass compares a
    draft with. Padding positions carry no target, and neither do positions
    whose target lies before the window's answer start: a head drafts only
    after a prompt, and a prompt's fixed parts (system prompt, template)
    would otherwise inflate the held-out agreement.
    """
    parts, done = [], 0
    split = [_split(w) for w in windows]
    for group, tokens, hidden, greedy, (ids, probs) in trunk_view(
        mtp_model, [t for t, _ in split], seq_len
    ):
        lengths = mx.array([len(w) for w in group])[:, None]
        first = mx.array([s for _, s in split[done : done + len(group)]])[:, None]
        done += len(group)
        pos = mx.arange(seq_len - 1)[None]
        valid = (pos < lengths - 1) & (pos + 2 >= first)
        parts.append(
            (
                hidden[:, :-1],
                tokens[:, 1:],
                greedy[:, 1:],
                valid,
                ids[:, 1:],
                probs[:, 1:],
            )
        )
        if progress is not None:
            progress(sum(len(w) for w in group))
    return Dataset(*(mx.concatenate(list(p), axis=0) for p in zip(*parts)))


def save_dataset(ds: Dataset, path: Path) -> None:
    tmp = path.with_suffix(".tmp.safetensors")
    mx.save_safetensors(str(tmp), {k: v for k, v in asdict(ds).items()})
    tmp.replace(path)


def load_dataset(path: Path) -> Dataset:
    w = mx.load(str(path))
    w["mask"] = w["mask"].astype(mx.bool_)
    return Dataset(**w)


# -- training -----------------------------------------------------------------
def head_loss(
    head: MTPHead, hidden, next_tokens, targets, mask, out_rows=None, soft=None
):
    """Masked cross-entropy of the head's logits for ``t_{i+2}``.

    With ``out_rows`` (the output embedding rows of a vocabulary subset, and
    ``targets`` indexing into it) the softmax runs over that subset only: the
    49k-row output projection is most of a small head's cost, and the trunk's
    greedy tokens mostly come from a few thousand ids. MLX is lazy, so the
    head's full logits are then never computed. With ``soft = (ids, probs)``
    the target is the trunk's own top-K distribution (renormalised) instead of
    its greedy token alone: more signal per token of scarce data.
    """
    logits, h = head(hidden.astype(mx.float32), next_tokens, None)
    if out_rows is not None:
        logits = h @ out_rows.T
    if soft is None:
        ce = nn.losses.cross_entropy(logits, targets, reduction="none")
    else:
        ids, probs = soft
        logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        probs = probs.astype(mx.float32)
        picked = mx.take_along_axis(logp, ids, axis=-1)
        ce = -(probs * picked).sum(-1) / mx.maximum(probs.sum(-1), 1e-6)
    m = mask.astype(ce.dtype)
    return (ce * m).sum() / mx.maximum(m.sum(), 1)


def agreement(head: MTPHead, ds: Dataset, batch: int = 8) -> float:
    """Teacher-forced top-1 agreement of the head with the trunk's greedy token."""
    hits = total = 0
    for s in range(0, ds.hidden.shape[0], batch):
        logits, _ = head(
            ds.hidden[s : s + batch].astype(mx.float32),
            ds.next_tokens[s : s + batch],
            None,
        )
        m = ds.mask[s : s + batch]
        hit = (mx.argmax(logits, axis=-1) == ds.targets[s : s + batch]) & m
        hits += hit.sum().item()
        total += m.sum().item()
    return hits / max(total, 1)


def _schedule(cfg: TrainConfig):
    warm = optim.linear_schedule(cfg.lr * 0.01, cfg.lr, max(cfg.warmup, 1))
    decay = optim.cosine_decay(cfg.lr, max(cfg.steps - cfg.warmup, 1), cfg.lr * 0.05)
    return optim.join_schedules([warm, decay], [max(cfg.warmup, 1)])


def _save_checkpoint(head, opt, step, best, ckpt: Path):
    ckpt.mkdir(parents=True, exist_ok=True)
    state = dict(tree_flatten(opt.state))
    tmp = ckpt / ".head.tmp.safetensors"
    mx.save_safetensors(str(tmp), dict(tree_flatten(head.trainable_parameters())))
    tmp.replace(ckpt / "head.safetensors")
    tmp = ckpt / ".optimizer.tmp.safetensors"
    mx.save_safetensors(
        str(tmp), {k: v for k, v in state.items() if isinstance(v, mx.array)}
    )
    tmp.replace(ckpt / "optimizer.safetensors")
    (ckpt / "state.json").write_text(json.dumps({"step": step, **best}))


def _load_checkpoint(head, opt, ckpt: Path) -> dict:
    from mlx.utils import tree_unflatten

    head.load_weights(str(ckpt / "head.safetensors"))
    opt.init(head.trainable_parameters())
    state = mx.load(str(ckpt / "optimizer.safetensors"))
    opt.state = tree_unflatten(list({**dict(tree_flatten(opt.state)), **state}.items()))
    return json.loads((ckpt / "state.json").read_text())


def train(
    head: MTPHead,
    train_ds: Dataset,
    eval_ds: Dataset,
    cfg: TrainConfig,
    out: Path,
    resume: bool = False,
    on_step: Optional[Callable[[int, float, int], None]] = None,
    on_eval: Optional[Callable[[int, float], None]] = None,
) -> TrainResult:
    """Train ``head`` with AdamW; keep the weights with the best held-out agreement.

    Every ``eval_every`` steps the head's teacher-forced agreement on
    ``eval_ds`` is measured; training stops after ``patience`` evaluations
    without improvement. Checkpoints go to ``out/checkpoint`` every
    ``save_every`` steps and hold what ``resume=True`` needs to go on.
    """
    mx.random.seed(cfg.seed)
    # only the head's own modules train; the shared embedding is the trunk's
    opt = optim.AdamW(learning_rate=_schedule(cfg), weight_decay=cfg.weight_decay)
    ckpt = out / CHECKPOINT_DIR
    start, best = (
        0,
        {
            "best_step": 0,
            "best_agreement": -1.0,
            "initial_agreement": None,
            "bad_evals": 0,
        },
    )
    if resume and (ckpt / "state.json").exists():
        state = _load_checkpoint(head, opt, ckpt)
        start, best = state.pop("step"), state
    if best["initial_agreement"] is None:
        best["initial_agreement"] = agreement(head, eval_ds)
        if on_eval is not None:
            on_eval(0, best["initial_agreement"])
    best_weights = dict(tree_flatten(head.trainable_parameters()))
    if (ckpt / "best.safetensors").exists() and resume:
        best_weights = mx.load(str(ckpt / "best.safetensors"))

    loss_and_grad = nn.value_and_grad(head, head_loss)

    out_rows, targets, mask = None, train_ds.targets, train_ds.mask
    soft_ids, soft_probs = train_ds.soft_ids, train_ds.soft_probs
    vocab = None
    if cfg.vocab_top:
        vocab, out_rows, targets, mask, soft_ids, soft_probs = _vocab_subset(
            head, train_ds, cfg.vocab_top
        )
    n = train_ds.hidden.shape[0]
    order = _epoch_order(n, cfg.seed, start * cfg.batch_size)
    losses: List[float] = []
    t0 = time.time()
    step = start
    for step in range(start + 1, cfg.steps + 1):
        idx = mx.array([next(order) for _ in range(cfg.batch_size)])
        batch = (
            train_ds.hidden[idx],
            train_ds.next_tokens[idx],
            targets[idx],
            mask[idx],
        )
        soft = (soft_ids[idx], soft_probs[idx]) if cfg.soft_targets else None
        loss, grads = loss_and_grad(head, *batch, out_rows, soft)
        opt.update(head, grads)
        mx.eval(head.parameters(), opt.state, loss)
        losses.append(loss.item())
        if on_step is not None:
            on_step(step, losses[-1], int(batch[3].sum().item()))
        if step % cfg.eval_every == 0 or step == cfg.steps:
            acc = agreement(head, eval_ds)
            if on_eval is not None:
                on_eval(step, acc)
            if acc > best["best_agreement"]:
                best.update(best_step=step, best_agreement=acc, bad_evals=0)
                best_weights = dict(tree_flatten(head.trainable_parameters()))
                ckpt.mkdir(parents=True, exist_ok=True)
                mx.save_safetensors(str(ckpt / "best.safetensors"), best_weights)
            else:
                best["bad_evals"] += 1
        if step % cfg.save_every == 0:
            _save_checkpoint(head, opt, step, best, ckpt)
        if best["bad_evals"] >= cfg.patience:
            break
    head.load_weights(list(best_weights.items()))
    mx.eval(head.parameters())
    return TrainResult(
        steps=step,
        best_step=best["best_step"],
        best_agreement=best["best_agreement"],
        initial_agreement=best["initial_agreement"],
        losses=losses,
        seconds=time.time() - t0,
        vocab=vocab,
    )


def _vocab_subset(head: MTPHead, ds: Dataset, k: int):
    """Output rows of the ``k`` most frequent targets; targets re-indexed into them."""
    import numpy as np

    tg = np.array(ds.targets)[np.array(ds.mask)]
    counts = np.bincount(tg, minlength=1)
    keep = np.argsort(-counts, kind="stable")[: min(k, int((counts > 0).sum()))]
    size = max(int(np.array(ds.targets).max()), int(np.array(ds.soft_ids).max())) + 1
    table = np.full(max(size, counts.shape[0]), -1, np.int64)
    table[keep] = np.arange(keep.shape[0])
    mapped = table[np.array(ds.targets)]
    soft = table[np.array(ds.soft_ids)]
    soft_probs = mx.where(mx.array(soft >= 0), ds.soft_probs, 0)
    # the output head applied to the identity gives its weight, tied or not
    d = head.eh_proj.weight.shape[0]
    rows = head.logits(mx.eye(d))[:, mx.array(keep)].T.astype(mx.float32)
    return (
        keep.tolist(),
        mx.stop_gradient(rows),
        mx.array(np.maximum(mapped, 0).astype(np.int32)),
        ds.mask & mx.array(mapped >= 0),
        mx.array(np.maximum(soft, 0).astype(np.int32)),
        soft_probs,
    )


def _epoch_order(n: int, seed: int, skip: int):
    """Window indices, reshuffled every epoch, deterministic from ``seed``."""
    import random

    epoch, emitted = 0, 0
    while True:
        perm = list(range(n))
        random.Random(seed * 1000003 + epoch).shuffle(perm)
        for i in perm:
            if emitted >= skip:
                yield i
            emitted += 1
        epoch += 1


# -- acceptance ---------------------------------------------------------------
def acceptance(
    mtp_model: MTPModel,
    tokenizer: Any,
    prompts: Sequence[List[int]],
    draft_maxes: Sequence[int] = (1, 2, 3, 4),
    max_tokens: int = 128,
) -> Dict[int, Dict[str, float]]:
    """Real greedy speculative generations: acceptance and mean accepted length."""
    from .generate import stream_generate
    from .stats import MTPStats

    out = {}
    for k in draft_maxes:
        total = MTPStats(draft_max=k)
        for p in prompts:
            *_, last = stream_generate(mtp_model, tokenizer, p, max_tokens, draft_max=k)
            s = last.stats
            total.rounds += s.rounds
            total.drafted += s.drafted
            total.accepted += s.accepted
            total.generation_tokens += s.generation_tokens
        out[k] = {
            "acceptance_rate": total.acceptance_rate,
            "mean_accepted_length": total.mean_accepted_length,
            "drafted": total.drafted,
            "accepted": total.accepted,
            "rounds": total.rounds,
        }
    return out


# -- the whole command --------------------------------------------------------
@dataclass
class Hooks:
    """How a front end follows a run (all optional)."""

    phase: Callable[[str, int], Any] = lambda name, total: None  # new phase, units
    advance: Callable[[int], Any] = lambda n: None  # units done in the phase
    step: Callable[[int, float, int], Any] = lambda step, loss, tokens: None
    evaluated: Callable[[int, float], Any] = lambda step, agreement: None
    message: Callable[[str], Any] = lambda text: None


def _sequences(path: Path) -> List[Tuple[List[int], int]]:
    rows = path.read_text().splitlines() if path.exists() else []
    rows = [json.loads(line) for line in rows if line.strip()]
    return [(r["tokens"], r.get("prompt_len", 0)) for r in rows]


def _distilled(
    mtp_model, tokenizer, prompts, max_tokens, path: Path, hooks: Hooks, batch=32
):
    """Greedy continuations of ``prompts``, resumed from ``path`` (JSON lines)."""
    from .train_data import self_distill

    done = _sequences(path)
    todo = prompts[len(done) :]
    if todo:
        hooks.phase("self-distillation (tokens)", len(todo) * max_tokens)
        for seq in self_distill(
            mtp_model.trunk.model,
            tokenizer,
            todo,
            max_tokens,
            batch,
            path,
            hooks.advance,
        ):
            done.append(seq)  # (tokens, prompt length)
    return done


def _dataset(
    mtp_model, windows, seq_len, path: Path, hooks: Hooks, name: str
) -> Dataset:
    """The precomputed dataset for ``windows``, reused from ``path`` when it matches."""
    import hashlib

    key = hashlib.sha256(json.dumps([seq_len, windows]).encode()).hexdigest()[:16]
    stamp = path.with_suffix(".key")
    if path.exists() and stamp.exists() and stamp.read_text() == key:
        return load_dataset(path)
    hooks.phase(f"trunk hidden states, {name} (tokens)", sum(len(w) for w in windows))
    ds = build_dataset(mtp_model, windows, seq_len, hooks.advance)
    save_dataset(ds, path)
    stamp.write_text(key)
    return ds


def train_head(
    base: Path,
    out: Path,
    data: Sequence[Path] = (),
    self_distill_prompts: int = 0,
    distill_tokens: int = 256,
    cfg: Optional[TrainConfig] = None,
    resume: bool = False,
    eval_tokens: int = 128,
    eval_draft_maxes: Sequence[int] = (1, 2, 3, 4),
    hooks: Optional[Hooks] = None,
) -> Dict[str, Any]:
    """Train an MTP head for the model folder ``base`` and write it to ``out``.

    Returns a report: data sizes, training result, held-out teacher-forced
    agreement and real speculative acceptance per draft_max.
    """
    from .loader import load
    from .train_data import (
        EVAL_PROMPTS,
        chunk_sequences,
        default_snippet_files,
        distill_prompts,
        read_data_file,
        render_prompt,
    )

    cfg = cfg or TrainConfig()
    hooks = hooks or Hooks()
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise MTPError(f"{out}: exists and is not a folder")
    if not data and not self_distill_prompts:
        raise MTPError("no training data: give --data FILE and/or --self-distill N")
    if (
        (out / CHECKPOINT_DIR).exists()
        and not resume
        and any((out / CHECKPOINT_DIR).iterdir())
    ):
        raise MTPError(
            f"{out}: holds a checkpoint; pass --resume or choose another folder"
        )
    mtp_model, tokenizer = load(base)
    work = out / WORK_DIR
    work.mkdir(parents=True, exist_ok=True)

    # 1) held-out set: the trunk's greedy answers to prompts never trained on
    eval_prompts = [{"chat": p} for ps in EVAL_PROMPTS.values() for p in ps]
    eval_seqs = _distilled(
        mtp_model, tokenizer, eval_prompts, eval_tokens, work / "eval.jsonl", hooks
    )

    # 2) training text: user files, then the trunk's own continuations
    seqs = [s for f in data for s in read_data_file(Path(f), tokenizer)]
    if self_distill_prompts:
        prompts = distill_prompts(
            self_distill_prompts, cfg.seed, default_snippet_files()
        )
        seqs += _distilled(
            mtp_model, tokenizer, prompts, distill_tokens, work / "distill.jsonl", hooks
        )
    windows = chunk_sequences(seqs, cfg.seq_len)
    if not windows:
        raise MTPError("the training data is too short (need sequences of 8+ tokens)")

    # 3) the frozen trunk's view, computed once
    train_ds = _dataset(
        mtp_model, windows, cfg.seq_len, work / "train.safetensors", hooks, "train"
    )
    eval_ds = _dataset(
        mtp_model,
        chunk_sequences(eval_seqs, cfg.seq_len),
        cfg.seq_len,
        work / "eval.safetensors",
        hooks,
        "held-out",
    )

    # 4) train
    head = init_head(mtp_model, cfg.eh_init, sample=windows[0][0])
    hooks.phase("training (steps)", cfg.steps)
    result = train(
        head, train_ds, eval_ds, cfg, out, resume, hooks.step, hooks.evaluated
    )
    if result.vocab is not None:  # draft from the tokens the head was trained on
        head.draft_vocab = mx.array(result.vocab, dtype=mx.int32)
    report = {
        "base": str(base),
        "train_tokens": train_ds.tokens,
        "train_windows": len(windows),
        "eval_tokens": eval_ds.tokens,
        "config": asdict(cfg),
        "steps": result.steps,
        "best_step": result.best_step,
        "initial_agreement": result.initial_agreement,
        "agreement": result.best_agreement,
        "train_seconds": round(result.seconds, 1),
    }
    save_head(head, mtp_model.config, out, cfg.dtype, {"training": report})

    # 5) real acceptance, with the head as the runtime loads it
    if eval_draft_maxes:
        hooks.message("measuring acceptance on held-out prompts")
        loaded, _ = load(base, mtp=out)
        prompts = [render_prompt(tokenizer, p) for p in eval_prompts]
        report["acceptance"] = acceptance(
            loaded, tokenizer, prompts, eval_draft_maxes, eval_tokens
        )
        save_head(head, mtp_model.config, out, cfg.dtype, {"training": report})
    return report
