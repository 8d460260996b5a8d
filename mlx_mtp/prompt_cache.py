"""Prompt caches kept across requests, bounded by entries and bytes (LRU):
the server's prefix cache.

An entry is an ``MTPCache`` with the tokens its trunk has read. A new prompt
takes the entry that saves it the most tokens:

- caches that can be cut anywhere (attention only): the one with the longest
  common prefix, cut back with ``MTPCache.truncate``;
- caches with recurrent state (gated delta net), which cannot be cut: only
  an entry whose tokens are a prefix of the prompt. So the engine keeps such
  a stream's state at the end of its prompt (a turn boundary: the next turn
  of a chat extends it) besides the one at the end of its answer, as the
  chat session does between turns.

Entries are never written to: a hit is a copy whose arrays are new array
objects (a write into an array shared by another copies it first).

With a ``disk_cache.DiskCache`` (``disk``) every entry kept is also written
to disk, off the caller's thread, and a lookup takes the disk's entry where
it holds more of the prompt than memory does: prefixes outlive the memory
bound and the process.
"""

from dataclasses import dataclass
from typing import List, Tuple

from .cache import MTPCache
from .chat import common_prefix, truncatable, truncate


@dataclass
class Entry:
    tokens: List[int]
    cache: MTPCache
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

    def fetch(self, model, tokens: List[int]) -> Tuple[MTPCache, int]:
        """A cache for ``tokens`` and how many of them it holds already.

        At least the last token is left to read (generation starts there).
        """
        best, keep = None, 0
        for e in self.entries:
            n = min(common_prefix(e.tokens, tokens), len(tokens) - 1)
            if n < len(e.tokens) and not truncatable(e.cache):
                continue
            if n > keep:
                best, keep = e, n
        if self.disk is not None:
            name, n = self.disk.best(tokens)
            if n > keep:
                found = self._from_disk(model, name, n)
                if found is not None:
                    return found
        if best is None:
            return model.make_cache(), 0
        self.entries.remove(best)
        self.entries.append(best)
        cache = best.cache.copy()
        if keep < len(best.tokens):
            keep = truncate(model, cache, keep)
        return cache, keep

    def _from_disk(self, model, name: str, keep: int):
        """Disk entry ``name``'s cache cut to ``keep`` tokens, or None where it
        cannot be read or cut."""
        cached = self.disk.load(name)
        if cached is None:
            return None
        cache = cached.cache
        if keep < len(cached.tokens):
            if not truncatable(cache):
                return None
            keep = truncate(model, cache, keep)
        return cache, keep

    def insert(self, tokens: List[int], cache: MTPCache) -> None:
        """Keep ``cache``, which has read ``tokens``; older entries it covers go."""
        if self.disk is not None and tokens:
            self.disk.put(tokens, cache)
        if not self.in_memory or not tokens:
            return
        cut = truncatable(cache)
        self.entries = [
            e
            for e in self.entries
            if not (
                len(e.tokens) <= len(tokens)
                and (cut or len(e.tokens) == len(tokens))
                and tokens[: len(e.tokens)] == e.tokens
            )
        ]
        self.entries.append(Entry(list(tokens), cache, cache.nbytes))
        while self.entries and (
            len(self.entries) > self.max_entries or self.nbytes > self.max_bytes
        ):
            self.entries.pop(0)
