"""Prompt caches kept across requests, bounded by entries and bytes (LRU):
the server's prefix cache.

An entry is an ``StreamCache`` with the tokens its trunk has read. A new prompt
takes the entry that saves it the most tokens:

- caches that can be cut anywhere (attention only): the one with the longest
  common prefix, cut back with ``StreamCache.truncate``;
- caches with recurrent state (gated delta net), which cannot be cut: only
  an entry whose tokens are a prefix of the prompt. So the engine keeps such
  a stream's state at the end of its prompt (a turn boundary: the next turn
  of a chat extends it) besides the one at the end of its answer, as the
  chat session does between turns.

Entries are keyed by ``Prompt.keys``: the tokens, with a media segment's
positions keyed by its digest, so a prompt with other images never takes an
entry past its first image, and a hit is never cut inside a segment.

Entries are never written to: a hit is a copy whose arrays are new array
objects (a write into an array shared by another copies it first).

With a ``disk_cache.DiskCache`` (``disk``) every entry kept is also written
to disk, off the caller's thread, and a lookup takes the disk's entry where
it holds more of the prompt than memory does: prefixes outlive the memory
bound and the process.
"""

from dataclasses import dataclass
from typing import List, Tuple

from .cache import StreamCache
from .cache import truncatable, truncate
from .prompt import as_prompt, common_prefix


@dataclass
class Entry:
    keys: List[int]  # the prompt's keys its trunk has read (``Prompt.keys``)
    cache: StreamCache
    nbytes: int


class PromptCache:
    """Up to ``max_entries`` caches holding at most ``max_bytes`` together."""

    def __init__(self, max_entries: int, max_bytes: int, disk=None):
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self.entries: List[Entry] = []  # least recently used first
        self.disk = disk

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def in_memory(self) -> bool:
        return self.max_entries > 0 and self.max_bytes > 0

    @property
    def enabled(self) -> bool:
        return self.in_memory or self.disk is not None

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    def fetch(self, model, prompt) -> Tuple[StreamCache, int]:
        """A cache for ``prompt`` (a ``Prompt``, or token ids) and how many of
        its positions it holds already.

        At least the last token is left to read (generation starts there),
        and no media segment is cut.
        """
        prompt = as_prompt(prompt)
        keys = prompt.keys()
        best, keep = None, 0
        for e in self.entries:
            n = prompt.cut(min(common_prefix(e.keys, keys), len(keys) - 1))
            if n < len(e.keys) and not truncatable(e.cache):
                continue
            if n > keep:
                best, keep = e, n
        if self.disk is not None:
            name, n = self.disk.best(keys)
            n = prompt.cut(n)
            if n > keep:
                found = self._from_disk(model, name, n)
                if found is not None:
                    return found
        if best is None:
            return model.make_cache(), 0
        self.entries.remove(best)
        self.entries.append(best)
        cache = best.cache.copy()
        if keep < len(best.keys):
            keep = truncate(model, cache, keep)
        return cache, keep

    def _from_disk(self, model, name: str, keep: int):
        """Disk entry ``name``'s cache cut to ``keep`` tokens, or None where it
        cannot be read or cut."""
        cached = self.disk.load(name)
        if cached is None:
            return None
        cache = cached.cache
        if keep < len(cached.keys):
            if not truncatable(cache):
                return None
            keep = truncate(model, cache, keep)
        return cache, keep

    def insert(self, prompt, cache: StreamCache) -> None:
        """Keep ``cache``, which has read ``prompt`` (a ``Prompt``, or token
        ids); older entries it covers go."""
        prompt = as_prompt(prompt)
        if self.disk is not None and len(prompt):
            self.disk.put(prompt, cache)
        if not self.in_memory or not len(prompt):
            return
        keys = prompt.keys()
        cut = truncatable(cache)
        self.entries = [
            e
            for e in self.entries
            if not (
                len(e.keys) <= len(keys)
                and (cut or len(e.keys) == len(keys))
                and keys[: len(e.keys)] == e.keys
            )
        ]
        self.entries.append(Entry(keys, cache, cache.nbytes))
        while self.entries and (
            len(self.entries) > self.max_entries or self.nbytes > self.max_bytes
        ):
            self.entries.pop(0)
