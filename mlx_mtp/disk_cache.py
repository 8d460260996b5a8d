"""The prompt cache's second tier: entries on disk, kept across restarts.

Each entry is one prompt-cache file (``prompt_file``: mlx-lm's format, the
tokens it has read and their media's digests in its metadata) named by a
digest of the model, the cache policy and the prompt's keys
(``Prompt.keys``), so the same prefix is always the same file. At
start the folder is read (headers only): an entry of another model or other
cache settings, or a damaged or truncated one, is skipped and named
(``skipped``); nothing is served from it. A hit is read whole and its
checksum checked (``prompt_file.verify``); a file that fails then is
skipped too, and the request reads its prompt. An entry of this model whose
bytes do not match its checksum, or that has none (an older version wrote
it), is this server's own and cannot be trusted: it is removed as well.
Writers' temporary files (``TEMP``) are no entries: they are passed over
without a word, and removed once surely abandoned.

Writes happen on a thread of their own (``put`` only evaluates the arrays
and queues them): a temporary file, then a rename, so a reader never sees a
part. The folder holds at most ``max_bytes`` of this model's entries: the
least recently used (by file time, which a hit renews) go first; an entry
larger than that is not written. An entry that extends an older one, on a
model whose caches can be cut, replaces it.

Two servers may share a folder: entries are named by content, so both
writing one prefix make one file (the later rename wins, with the same
bytes); each picks up the other's new entries when the folder changes, and
each evicts by the shared file times within its own cap, so the smaller cap
wins. Entries of other models or settings are never removed.
"""

import hashlib
import json
import os
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

from . import prompt_file
from .cache import truncatable
from .prompt import as_prompt, common_prefix
from .errors import MTPError, first_line
from .kv import KVSettings

SUFFIX = ".safetensors"
TEMP = ".tmp" + SUFFIX  # ``prompt_file.write_atomic``'s temporary files
# a temporary file older than this was left by a writer that died
STALE_SECONDS = 3600


@dataclass
class DiskEntry:
    keys: List[int]  # the prompt's keys its trunk has read (``Prompt.keys``)
    nbytes: int
    used: float  # the file's time: the last write or hit


class DiskCache:
    """Prompt caches of ``model`` (with the cache policy ``kv``) in ``folder``,
    at most ``max_bytes``; ``log`` hears each entry skipped or not written."""

    def __init__(
        self,
        folder,
        max_bytes: int,
        model,
        kv: Optional[KVSettings] = None,
        log: Callable[[str], None] = lambda line: None,
    ):
        self.folder = Path(folder)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise MTPError(f"--prompt-cache-dir {folder}: {first_line(e)}") from None
        if not os.access(self.folder, os.W_OK):
            raise MTPError(f"--prompt-cache-dir {folder}: not writable")
        self.max_bytes, self.model, self.log = max_bytes, model, log
        self.kv = kv or KVSettings()
        self.identity = json.loads(prompt_file.identity(model))
        fresh = model.make_cache()
        self.kv.apply(fresh)
        self.cuttable = truncatable(fresh)
        self.entries: Dict[str, DiskEntry] = {}
        self.skipped: Dict[str, str] = {}  # file name -> why
        self.seen = -1.0  # the folder's time at the last scan
        self.lock = threading.Lock()
        self.queue: "queue.Queue[Optional[tuple]]" = queue.Queue()
        self.written = self.failed = 0
        self.scan()
        self.thread = threading.Thread(target=self._writer, name="mlx-mtp disk cache")
        self.thread.daemon = True
        self.thread.start()

    # -- the index ------------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())

    def name(self, keys: List[int]) -> str:
        key = json.dumps([self.identity, self.kv.metadata(), keys], sort_keys=True)
        return hashlib.sha256(key.encode()).hexdigest()[:32] + SUFFIX

    def scan(self) -> None:
        """Read the entries added since the last scan (headers only)."""
        try:
            mtime = self.folder.stat().st_mtime
        except OSError:
            return
        if mtime == self.seen:
            return
        self.seen = mtime
        now = time.time()
        with self.lock:
            known = set(self.entries) | set(self.skipped)
            for path in sorted(self.folder.iterdir()):
                if path.name in known or not path.name.endswith(SUFFIX):
                    continue
                if path.name.endswith(TEMP):  # a write under way (ours or not)
                    self._stale(path, now)
                    continue
                why = self._why_not(path)
                if why is None:
                    continue
                self.skipped[path.name] = why
                self.log(f"prompt cache on disk: skipped {path.name} ({why})")

    def _stale(self, path: Path, now: float) -> None:
        """A writer's temporary file: removed once its writer surely died (no
        write takes an hour), passed over in silence until then."""
        try:
            age = now - path.stat().st_mtime
        except OSError:  # renamed or removed meanwhile: the write is done
            return
        if age > STALE_SECONDS:
            path.unlink(missing_ok=True)
            self.log(f"prompt cache on disk: removed {path.name} (an unfinished write)")

    def _why_not(self, path: Path) -> Optional[str]:
        """Index ``path`` if it is an entry of this model and policy; else why not."""
        try:
            header = prompt_file.peek(path)
            stat = path.stat()
        except (MTPError, OSError) as e:
            return f"damaged: {first_line(e).removeprefix(str(path) + ': ')}"
        if header.model != self.identity:
            return "another model"
        if header.kv != self.kv.metadata():
            return "other cache settings"
        if not header.sealed:
            path.unlink(missing_ok=True)
            return "written by an older version, with no checksum: removed"
        self.entries[path.name] = DiskEntry(header.keys, stat.st_size, stat.st_mtime)
        return None

    def describe(self) -> List[str]:
        """What the server says at start."""
        size = self.nbytes / 2**20
        lines = [
            f"prompt cache on disk: {self.folder}, {len(self.entries)} entries of "
            f"this model ({size:.1f} MiB of {self.max_bytes / 2**20:.0f})"
        ]
        if self.skipped:
            lines.append(
                f"prompt cache on disk: skipped {len(self.skipped)} files: "
                + ", ".join(f"{n} ({w})" for n, w in sorted(self.skipped.items()))
            )
        return lines

    # -- lookups ----------------------------------------------------------------------

    def best(self, keys: List[int]) -> Tuple[Optional[str], int]:
        """The entry that holds the most of a prompt's ``keys`` (``Prompt.keys``;
        leaving the last one to read), and how many; an entry that cannot be
        cut must be a prefix."""
        self.scan()
        best, keep = None, 0
        with self.lock:
            for name, e in self.entries.items():
                n = min(common_prefix(e.keys, keys), len(keys) - 1)
                if n < len(e.keys) and not self.cuttable:
                    continue
                if n > keep:
                    best, keep = name, n
        return best, keep

    def load(self, name: str) -> Optional[prompt_file.PromptFile]:
        """Entry ``name`` read whole and verified (its time renewed), or None
        where it fails (it is skipped from then on, and said; one whose
        bytes fail their checksum is removed)."""
        path = self.folder / name
        try:
            before = path.stat()
            cached = prompt_file.load(path, self.model)
            os.utime(path)
        except (MTPError, OSError) as e:
            why = first_line(e).removeprefix(str(path) + ": ")
            if isinstance(e, prompt_file.Damaged) and _same_file(path, before):
                path.unlink(missing_ok=True)  # not another server's new copy
                why += ": removed"
            with self.lock:
                self.entries.pop(name, None)
                self.skipped[name] = why
            self.log(f"prompt cache on disk: skipped {name} ({why})")
            return None
        with self.lock:
            if name in self.entries:
                self.entries[name].used = time.time()
        return cached

    # -- writes -----------------------------------------------------------------------

    def put(self, prompt, cache) -> None:
        """Keep ``cache`` (which has read ``prompt``: a ``Prompt``, or token
        ids) on disk: its arrays are evaluated here, the file is written by
        the writer thread."""
        prompt = as_prompt(prompt)
        keys = prompt.keys()
        name = self.name(keys)
        with self.lock:
            if name in self.entries:
                return
        entries, metadata = prompt_file.prepare(self.model, cache, prompt, kv=self.kv)
        self.queue.put((name, keys, entries, metadata))

    def flush(self, timeout: float = 60.0) -> None:
        """Wait until every queued entry is written (or ``timeout`` passes)."""
        deadline = time.monotonic() + timeout
        while self.queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)

    def close(self, timeout: float = 30.0) -> None:
        """Write what is queued, then stop the writer."""
        self.queue.put(None)
        self.thread.join(timeout)

    def _writer(self) -> None:
        while True:
            item = self.queue.get()
            try:
                if item is None:
                    return
                self._write(*item)
            except Exception as e:  # a write must not take the server down
                self.failed += 1
                self.log(f"prompt cache on disk: not written ({first_line(e)})")
            finally:
                self.queue.task_done()

    def _write(self, name: str, keys, entries, metadata) -> None:
        size = sum(x.nbytes for c in entries for x in _arrays(c.state))
        if size > self.max_bytes:
            self.log(
                f"prompt cache on disk: an entry of {size / 2**20:.1f} MiB is larger "
                "than --prompt-cache-disk-gb: not written"
            )
            return
        self._evict(size)
        path = self.folder / name
        try:
            prompt_file.write(path, entries, metadata)
        except MTPError as e:
            self.failed += 1
            self.log(f"prompt cache on disk: {name} not written ({first_line(e)})")
            return
        covered = []
        with self.lock:
            self.entries[name] = DiskEntry(keys, path.stat().st_size, time.time())
            if self.cuttable:  # older entries this one extends go
                covered = [
                    n
                    for n, e in self.entries.items()
                    if n != name and keys[: len(e.keys)] == e.keys
                ]
                for n in covered:
                    del self.entries[n]
        for n in covered:
            (self.folder / n).unlink(missing_ok=True)
        self.written += 1

    def _evict(self, room: int) -> None:
        """Remove the least recently used entries until ``room`` more bytes fit."""
        with self.lock:
            order = sorted(self.entries, key=lambda n: self._used(n))
            gone = []
            while order and self.nbytes + room > self.max_bytes:
                n = order.pop(0)
                gone.append(n)
                del self.entries[n]
        for n in gone:
            (self.folder / n).unlink(missing_ok=True)

    def _used(self, name: str) -> float:
        """When entry ``name`` was last used: its file's time (another server
        sharing the folder renews it too)."""
        try:
            return (self.folder / name).stat().st_mtime
        except OSError:
            return 0.0


def _arrays(state) -> List[Any]:
    out = []
    for x in state if isinstance(state, (list, tuple)) else [state]:
        if isinstance(x, (list, tuple)):
            out += _arrays(x)
        elif hasattr(x, "nbytes"):
            out.append(x)
    return out


def _same_file(path: Path, before: os.stat_result) -> bool:
    """Whether ``path`` is still the file ``before`` described."""
    try:
        now = path.stat()
    except OSError:
        return False
    return (now.st_ino, now.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
