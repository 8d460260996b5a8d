"""The frozen trunk's view of the training windows, streamed to disk in shards.

A shard holds ``SHARD_WINDOWS`` windows as plain ``.npy`` files, one per
field, read back through ``np.memmap``: training gathers a batch's rows from
disk, so memory stays bounded however many positions there are. A shard is
complete when its ``.json`` marker exists (written last, after the arrays were
renamed into place); the marker carries a key of the windows it was made from,
so a rerun reuses every shard that still matches and rebuilds the rest.
"""

import hashlib
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import mlx.core as mx
import numpy as np

SHARD_WINDOWS = 64
SOFT_TOP = 8  # trunk probabilities kept per position for distillation
FIELDS = {
    "tokens": np.int32,  # [S, L] the window's tokens t_i (padded with 0)
    "hidden": np.float16,  # [S, L, D] the trunk's hidden state h_i
    "greedy": np.int32,  # [S, L] the trunk's argmax at i (its guess for t_{i+1})
    "soft_ids": np.int32,  # [S, L, K] the trunk's top-K tokens at i
    "soft_probs": np.float16,  # [S, L, K] their probabilities, summing to 1
    "meta": np.int32,  # [S, 2] window length, answer start
}


def trunk_view(trunk, windows: Sequence[tuple[list[int], int]], seq_len: int):
    """The trunk's hidden states, greedy tokens and top-K over padded windows.

    The top-K probabilities are normalised over the K (the loss renormalises
    them anyway): no softmax or argmax over the whole vocabulary, only one
    partition of it per position.
    """
    tokens = mx.array([w + [0] * (seq_len - len(w)) for w, _ in windows])
    logits, hidden = trunk(tokens, trunk.make_cache())
    ids = mx.argpartition(-logits, SOFT_TOP - 1, axis=-1)[..., :SOFT_TOP]
    top = mx.take_along_axis(logits, ids, axis=-1).astype(mx.float32)
    best = mx.argmax(top, axis=-1, keepdims=True)
    greedy = mx.take_along_axis(ids, best, axis=-1)[..., 0].astype(mx.int32)
    meta = mx.array([[len(w), s] for w, s in windows], dtype=mx.int32)
    out = {
        "tokens": tokens.astype(mx.int32),
        "hidden": hidden.astype(mx.float16),
        "greedy": greedy,
        "soft_ids": ids.astype(mx.int32),
        "soft_probs": mx.softmax(top, axis=-1).astype(mx.float16),
        "meta": meta,
    }
    mx.eval(out)
    return {k: np.array(v, dtype=FIELDS[k]) for k, v in out.items()}


def _key(windows, seq_len: int) -> str:
    blob = json.dumps([seq_len, SOFT_TOP, windows]).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def shard_count(n_windows: int) -> int:
    return (n_windows + SHARD_WINDOWS - 1) // SHARD_WINDOWS


def write_shards(
    trunk,
    windows: Sequence[tuple[list[int], int]],
    seq_len: int,
    folder: Path,
    batch: int = 8,
    progress: Callable[[int], None] | None = None,
    should_stop: Callable[[], bool] = lambda: False,
) -> bool:
    """Write (or reuse) the shards of ``windows`` in ``folder``.

    ``batch`` windows go through the trunk per forward. Returns False when
    ``should_stop()`` ended the work early (finished shards stay).
    """
    folder.mkdir(parents=True, exist_ok=True)
    for s in range(shard_count(len(windows))):
        part = windows[s * SHARD_WINDOWS : (s + 1) * SHARD_WINDOWS]
        marker = folder / f"{s:05d}.json"
        key = _key(part, seq_len)
        if marker.exists() and json.loads(marker.read_text()).get("key") == key:
            if progress is not None:
                progress(sum(len(w) for w, _ in part))
            continue
        if should_stop():
            return False
        marker.unlink(missing_ok=True)
        pieces = []
        for b in range(0, len(part), batch):
            pieces.append(trunk_view(trunk, part[b : b + batch], seq_len))
            if progress is not None:
                progress(sum(len(w) for w, _ in part[b : b + batch]))
        for name in FIELDS:
            tmp = folder / f".{s:05d}.{name}.tmp.npy"
            np.save(tmp, np.concatenate([p[name] for p in pieces]))
            os.replace(tmp, folder / f"{s:05d}.{name}.npy")
        marker.write_text(json.dumps({"key": key, "windows": len(part)}))
    return True


class ShardSet:
    """Memory-mapped shards: ``rows`` windows, gathered by index."""

    def __init__(self, folder: Path, count: int | None = None):
        folder = Path(folder)
        if count is None:
            count = len(list(folder.glob("[0-9]*.json")))
        self.shards: list[dict[str, np.ndarray]] = []
        for s in range(count):
            self.shards.append(
                {n: np.load(folder / f"{s:05d}.{n}.npy", mmap_mode="r") for n in FIELDS}
            )
        self._index()

    def _index(self) -> None:
        sizes = [len(sh["meta"]) for sh in self.shards]
        self.offsets = np.cumsum([0] + sizes)
        self.rows = int(self.offsets[-1])
        self.parts = [self.rows]  # rows per source, in order (see ``join``)

    @classmethod
    def join(cls, sets: Sequence["ShardSet"]) -> "ShardSet":
        """One set over several: rows of ``sets[0]`` first, ``parts`` their sizes."""
        joined = cls.__new__(cls)
        joined.shards = [sh for s in sets for sh in s.shards]
        joined._index()
        joined.parts = [s.rows for s in sets]
        return joined

    def first(self, rows: int) -> "ShardSet":
        """The first ``rows`` windows as a set of their own (views, no copy)."""
        part = self.__class__.__new__(self.__class__)
        part.shards, left = [], rows
        for sh in self.shards:
            if left <= 0:
                break
            n = min(left, len(sh["meta"]))
            part.shards.append({k: v[:n] for k, v in sh.items()})
            left -= n
        part._index()
        return part

    @property
    def seq_len(self) -> int:
        return self.shards[0]["tokens"].shape[1]

    def batch(self, idx: Sequence[int]) -> dict[str, np.ndarray]:
        """The fields of windows ``idx`` (in that order), copied into memory."""
        idx = np.asarray(idx)
        shard = np.searchsorted(self.offsets, idx, side="right") - 1
        row = idx - self.offsets[shard]
        return {
            n: np.stack([self.shards[s][n][r] for s, r in zip(shard, row)])
            for n in FIELDS
        }

    def tokens(self) -> int:
        """Target positions (answer tokens) over all windows."""
        return int(
            sum(target_mask(sh["meta"], self.seq_len).sum() for sh in self.shards)
        )

    def target_counts(self, vocab_size: int) -> np.ndarray:
        """How often each token is the trunk's greedy target, over all shards."""
        counts = np.zeros(vocab_size, np.int64)
        for sh in self.shards:
            m = target_mask(sh["meta"], self.seq_len)
            counts += np.bincount(sh["greedy"][:, 1:][m], minlength=vocab_size)
        return counts


def target_mask(meta: np.ndarray, seq_len: int) -> np.ndarray:
    """[N, L-1]: row ``i`` pairs ``(h_i, t_{i+1})`` with target ``t_{i+2}``.

    A target exists inside the window (``i + 1 < length``) and lies in the
    answer (``i + 2 >= answer start``).
    """
    pos = np.arange(seq_len - 1)[None]
    length, start = meta[:, :1], meta[:, 1:2]
    return (pos < length - 1) & (pos + 2 >= start)
