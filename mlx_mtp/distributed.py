"""MTP across several processes (several Macs) with ``mlx.distributed``.

Started by ``mlx.launch``, every process loads its shard of the trunk the way
mlx-lm's ``sharded_load`` does: a pipeline split where the model class has
``pipeline``, tensor sharding where it has ``shard``. Either way every process
ends a forward holding the final hidden state (mlx-lm's pipeline all-gathers
it; tensor-parallel layers all-sum their outputs) and the output head (every
pipeline stage keeps the embedding, final norm and ``lm_head``), so every
process also holds the MTP head and drafts the same tokens without a transfer.
In tensor mode the head's blocks are sharded like trunk layers. A trunk that
loads through mlx-vlm (``vlm_text``) is split by its family's own tensor
split (``shard_trunk``, with ``split_counts``), or refused before loading
with the family's ``NO_SPLIT`` (docs/distributed.md, "mlx-vlm's models").

Every process runs the same speculative loop. ``SyncedVerifier`` adds the one
collective of a round: an ``all_gather`` of each rank's verify decision and
drafts. Rank 0's decision becomes every rank's, so every cache rolls back by
the same count, and a rank that drafted differently stops the run instead of
emitting tokens its caches do not hold.
"""

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, List, Optional, Tuple, Union

import mlx.core as mx
import numpy as np

from . import vlm_text
from .errors import MTPError, first_line
from .heads import family_for
from .loader import MTPModel, read_config
from .loader import load as load_local

SHARDINGS = ("auto", "pipeline", "tensor")
DEFAULT_SHARDING = "auto"
_MESSAGE_BYTES = 512  # per rank, in the load handshake
_MAGIC = np.array([77, 84, 80], np.int32)  # "MTP": heads every gathered row


class PeerLost(MTPError):
    """Another process stopped: a collective with it failed or returned no data.

    MLX's ring backend fails the first collective with a dead peer after about
    a second of retries and hands back uninitialised memory; a later one may
    wait for ever, so a process that sees this must not start another.
    """


@dataclass
class Sharding:
    """How a loaded model is spread over the processes of ``group``."""

    group: Any  # mx.distributed.Group
    mode: str  # "pipeline", "tensor" or "replicated"
    notice: Optional[str] = None  # why the model is replicated, when it is

    @property
    def rank(self) -> int:
        return self.group.rank()

    @property
    def size(self) -> int:
        return self.group.size()

    def describe(self) -> str:
        return f"{self.mode} over {self.size} processes"


def world():
    """The group ``mlx.launch`` started this process in (size 1 when it did not)."""
    return mx.distributed.init()


def quiet_other_ranks(group) -> None:
    """Send everything ranks other than 0 print to /dev/null, MLX's own messages too.

    Failures every rank sees (loading, diverging drafts) are reported by rank
    0; ``mlx.launch`` names a rank that exits non-zero on its own.
    """
    if group.rank() == 0:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.dup2(null, 2)
    os.close(null)


def _own_split(config):
    """The family's own tensor split of an mlx-vlm trunk (``shard_trunk``), or
    None: mlx-vlm's models are split only where a family writes the split."""
    if not vlm_text.serves(config):
        return None
    return getattr(family_for(config), "shard_trunk", None)


def _plan(
    model, config, group, sharding: str, head=None
) -> Tuple[str, Optional[str]]:
    """The sharding mode for ``model``, and a notice when it must be replicated."""
    if sharding not in SHARDINGS:
        raise MTPError(f"sharding must be one of {', '.join(SHARDINGS)}")
    name = config.get("model_type", type(model).__name__)
    pipeline = hasattr(model, "model") and hasattr(model.model, "pipeline")
    tensor = hasattr(model, "shard")
    vlm = vlm_text.serves(config)
    if vlm:  # an mlx-vlm model: the family's own tensor split, no pipeline
        tensor = _own_split(config) is not None
    # a head that reads a trunk layer's output (DeepSeek-V4.1: the last layer's
    # streams) finds it on the one process a pipeline split gives that layer
    read = tuple(getattr(head, "reads_layers", ()) or ())
    if sharding == "pipeline" and pipeline and read:
        raise MTPError(
            f"{name}: its MTP head reads trunk layer {read[0]}'s output, which a "
            "pipeline split keeps on one process; use --sharding tensor"
        )
    pipeline = pipeline and not read and not vlm
    if sharding == "pipeline" and vlm:
        raise MTPError(
            f"{name}: mlx-mtp splits its mlx-vlm model by tensors only; "
            "use --sharding tensor"
        )
    if sharding == "pipeline" and not pipeline:
        raise MTPError(f"{name}: mlx-lm has no pipeline split for this model")
    if sharding == "tensor" and not tensor:
        raise MTPError(f"{name}: mlx-lm has no tensor sharding for this model")
    n = group.size()
    if sharding == "tensor" or (sharding == "auto" and tensor and not pipeline):
        # (DeepSeek-V4.1's output projection splits by groups of heads; a
        # family's own split names the counts it divides, ``split_counts``)
        keys = ("num_attention_heads", "num_key_value_heads", "o_groups")
        heads = [config[k] for k in keys if isinstance(config.get(k), int)]
        if vlm:
            heads = list(family_for(config).split_counts(config))
        if any(h % n for h in heads):
            why = f"{name}: its attention heads {heads} do not split over {n} processes"
            if sharding == "tensor":
                raise MTPError(why)
            return "replicated", f"{why}; every process loads the whole model"
        return "tensor", None
    if pipeline:
        layers = len(model.model.layers)
        if layers < n:
            raise MTPError(f"{name}: {layers} layers cannot split over {n} processes")
        return "pipeline", None
    if read and hasattr(model, "model") and hasattr(model.model, "pipeline"):
        why = f"its MTP head reads trunk layer {read[0]}'s output, which a pipeline"
        return "replicated", (
            f"{name}: {why} split keeps on one process, and mlx-lm has no tensor "
            "sharding for it; every process loads the whole model"
        )
    return "replicated", (
        f"{name}: mlx-lm has no pipeline or tensor sharding for this model; "
        "every process loads the whole model"
    )


class _Sharder:
    """The loader's hook: shards the lazily loaded trunk and head before the
    weights are read, so each process reads only its own part."""

    def __init__(self, group, sharding: str):
        self.group, self.sharding = group, sharding
        self.mode, self.notice = None, None

    def __call__(self, model, head, config) -> None:
        self.mode, self.notice = _plan(
            model, config, self.group, self.sharding, head
        )
        if self.mode == "pipeline":
            # mlx-lm's split: rank 0 holds the last layers; the head, embedding,
            # final norm and lm_head stay on every rank (see the module notes).
            model.model.pipeline(self.group)
        elif self.mode == "tensor":
            layers = model.model.layers
            # The head's blocks are trunk layers (layers N.. of the checkpoint):
            # shard them with the trunk's own rules, as more layers.
            n = head.num_layers if head is not None else 0
            blocks = [getattr(head.layer(j), "block", None) for j in range(n)]
            blocks = [b for b in blocks if type(b) is type(layers[0])]
            layers.extend(blocks)
            split = _own_split(config) or type(model).shard
            try:
                split(model, self.group)
            finally:
                del layers[len(layers) - len(blocks) :]
            for b in blocks:  # loaded whole before: keep only this rank's slices
                mx.eval(b.parameters())


def gather_rows(row: mx.array, group) -> mx.array:
    """``all_gather`` of one row per rank, as ``[ranks, len(row)]``.

    A peer that died makes MLX's ring backend raise, or fail the pending
    transfer and hand back uninitialised memory: rows start with ``_MAGIC``
    so that a lost peer is told apart from its data.
    """
    try:
        rows = mx.distributed.all_gather(row, group=group, stream=mx.cpu)
        rows = np.array(rows).reshape(group.size(), -1)
    except RuntimeError as e:
        raise PeerLost(f"lost contact with another process ({e})") from None
    if (rows[:, : len(_MAGIC)] != _MAGIC).any():
        raise PeerLost("lost contact with another process")
    return rows[:, len(_MAGIC) :]


def gather(values: np.ndarray, group) -> np.ndarray:
    """``values`` (one row, the same length on every rank) from every rank, as
    ``[ranks, len(values)]``; ``PeerLost`` where a peer is gone."""
    head = _MAGIC.astype(values.dtype)
    return gather_rows(mx.array(np.concatenate([head, values])), group)


def unsplittable(path: Union[str, Path]) -> Optional[str]:
    """Why the model at ``path`` cannot be split over processes, from its
    config alone (before any weights load); None when it can be tried."""
    try:
        config = read_config(Path(path))
    except MTPError:
        return None  # loading says what is wrong with the path
    if vlm_text.serves(config) and _own_split(config) is None:
        # the family says why its layers do not split (``NO_SPLIT``)
        why = getattr(family_for(config), "NO_SPLIT", None) or (
            "its language model loads through mlx-vlm, whose model mlx-mtp "
            "does not split over processes"
        )
        return f"{config['model_type']}: {why}; run it in one process"
    return None


def _agree(group, error: Optional[str]) -> None:
    """All ranks learn whether every rank loaded; the first failure is raised
    on all of them, so none waits for a peer that will never come."""
    row = np.zeros(_MESSAGE_BYTES, np.uint8)
    if error is not None:
        text = error.encode()[: _MESSAGE_BYTES - 1]
        row[0] = 1
        row[1 : 1 + len(text)] = np.frombuffer(text, np.uint8)
    try:
        rows = gather(row, group)
    except MTPError as e:
        raise MTPError(f"a process stopped before all had loaded: {e}") from None
    for rank, r in enumerate(rows):
        if r[0]:
            text = bytes(r[1:]).rstrip(b"\0").decode(errors="replace")
            raise MTPError(f"rank {rank}: {text}" if len(rows) > 1 else text)


def load(
    path: Union[str, Path],
    mtp: Optional[Union[str, Path]] = None,
    hidden_tap: Optional[str] = None,
    sharding: str = DEFAULT_SHARDING,
    group=None,
    tokenizer_config: Optional[dict] = None,
) -> Tuple[MTPModel, Any]:
    """Load this process's shard of a model folder: ``(model, tokenizer)``.

    Every process of ``group`` (default: ``mlx.launch``'s) must call it with
    the same folder, which each process finds at ``path`` on its machine. It
    returns once all have loaded; when any failed, all raise the first
    failure as an ``MTPError`` ("rank R: ..."). ``sharding`` is "pipeline",
    "tensor" or "auto" (pipeline where mlx-lm has a split for the model,
    else tensor sharding; a model with neither is loaded whole on every
    process, with ``model.sharding.notice`` saying so; a language model
    only mlx-vlm loads is tensor-split by its family, or refused before any
    weights load where the family has no split). The returned model
    generates through ``stream_generate`` as usual: call it on every process.
    This is what a server should call to load under ``mlx.launch``.
    """
    group = group if group is not None else world()
    sharder = _Sharder(group, sharding)
    model, tokenizer, error = None, None, None
    try:
        why = unsplittable(path) if group.size() > 1 else None
        if why is not None:
            raise MTPError(why)
        model, tokenizer = load_local(
            path, tokenizer_config, mtp=mtp, hidden_tap=hidden_tap, shard=sharder
        )
    except MTPError as e:
        error = str(e)
    except Exception as e:  # anything else must still reach the handshake
        error = f"{type(e).__name__}: {first_line(e)}"
    _agree(group, error)
    model.sharding = Sharding(group, sharder.mode, sharder.notice)
    return model, tokenizer


class SyncedVerifier:
    """Makes rank 0's verify decision every rank's, with one collective a round.

    Wraps any verifier (``draft``/``verify``). Each rank verifies as usual,
    then one ``all_gather`` of ``[n, emitted (padded), drafts]`` per rank
    hands every rank rank 0's tokens. The drafts ride along: a rank whose
    drafts differ from rank 0's (so its trunk verified other tokens) stops
    the run on every rank. ``stats.syncs`` / ``stats.sync_time`` count the
    collectives and their time.
    """

    def __init__(self, inner, group, stats=None):
        self.inner, self.group, self.stats = inner, group, stats
        if isinstance(getattr(inner, "seed", None), int):
            # A seed drawn at random differs per process: use rank 0's.
            row = np.append(_MAGIC, inner.seed).astype(np.int64)
            inner.seed = int(gather_rows(mx.array(row), group)[0, 0])

    def draft(self, logits, history=(), previous=()):
        return self.inner.draft(logits, history, previous)

    def verify(self, logits, drafts, history) -> List[int]:
        emitted = self.inner.verify(logits, drafts, history)
        k = len(drafts)
        proposed = mx.concatenate([d.token for d in drafts]).tolist() if k else []
        row = [len(emitted)] + emitted + [-1] * (k + 1 - len(emitted)) + proposed
        tic = time.perf_counter()
        rows = gather(np.array(row, np.int32), self.group).tolist()
        if self.stats is not None:
            self.stats.syncs += 1
            self.stats.sync_time += time.perf_counter() - tic
        if any(r[k + 2 :] != rows[0][k + 2 :] for r in rows):
            raise MTPError(
                "the processes drafted different tokens (different MLX versions "
                "or hardware?); run the same setup everywhere or use --draft-max 0"
            )
        return rows[0][1 : 1 + rows[0][0]]


def sync_verifier(model: MTPModel, verifier, stats=None):
    """``verifier`` wrapped for a sharded ``model``; unchanged on one process."""
    sharding = getattr(model, "sharding", None)
    if sharding is None or sharding.size == 1:
        return verifier
    return SyncedVerifier(verifier, sharding.group, stats)
