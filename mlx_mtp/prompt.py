"""A prompt is a value: its tokens plus the media segments read in their place.

A media segment (an image's patches, say) is a stretch of the prompt's
positions that the target reads as input embeddings rather than as token
embeddings: the tokens there are the processor's placeholders, and the
segment's ``digest`` names its content. A text prompt is the special case
with no segments.

Every prompt cache (in memory, in a file, on the server's disk) is keyed by
``Prompt.keys``: the tokens, with each position of a segment replaced by a
key derived from the segment's digest and the position within it (negative,
so never a token id). Two prompts with equal tokens and different images
therefore share no entry past the first image, and the same image at the
same place is reused like any other prefix.

The prompt is built once where the request is made (the command line, the
Python API, an HTTP API) and read by the loop's prefill, whose chunks never
split a segment.
"""

import hashlib
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, List, Sequence, Tuple, Union

from .errors import MTPError


def digest_of(data: bytes) -> str:
    """The content digest a segment goes by (sha256, hex)."""
    return hashlib.sha256(data).hexdigest()


def segment_key(digest: str, i: int) -> int:
    """The cache key of position ``i`` of a segment whose content is ``digest``:
    63 bits of a hash, negative, so that no token id equals it."""
    h = hashlib.blake2b(f"{digest}:{i}".encode(), digest_size=8).digest()
    return -1 - (int.from_bytes(h, "little") >> 1)


@dataclass(frozen=True)
class Segment:
    """Positions ``start .. start + length - 1`` of a prompt, read as input
    embeddings the target makes of ``data`` (``Target.embed_segment``).
    ``kind`` names the medium ("image", "embeddings", ...); ``digest`` its
    content, which is all that prompt caches compare."""

    start: int
    length: int
    digest: str
    kind: str = "embeddings"
    data: Any = field(default=None, compare=False, repr=False)

    @property
    def end(self) -> int:
        return self.start + self.length

    def shifted(self, by: int) -> "Segment":
        return Segment(self.start + by, self.length, self.digest, self.kind, self.data)


@dataclass(frozen=True)
class Piece:
    """The part ``lo .. hi - 1`` (within the segment) of ``segment`` that a
    chunk reads, at the chunk's position ``at``."""

    segment: Segment
    at: int
    lo: int
    hi: int


@dataclass(frozen=True)
class Prompt:
    """Tokens plus media segments (sorted, apart, each inside the tokens)."""

    tokens: Tuple[int, ...]
    segments: Tuple[Segment, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "tokens", tuple(int(t) for t in self.tokens))
        object.__setattr__(self, "segments", tuple(self.segments))
        end = 0
        for s in self.segments:
            if s.length < 1 or s.start < end:
                raise MTPError(
                    f"media segment at {s.start} (length {s.length}): segments "
                    "must be non-empty, sorted and apart"
                )
            end = s.end
        if end > len(self.tokens):
            raise MTPError(
                f"a media segment ends at {end}, past the prompt's "
                f"{len(self.tokens)} tokens"
            )

    def check_ends_in_text(self) -> "Prompt":
        """A prompt generated from ends with a token after its media (the
        first round reads it as a token)."""
        if self.segments and self.segments[-1].end >= len(self.tokens):
            raise MTPError(
                f"the prompt's last media segment ends at its last position "
                f"({len(self.tokens)}): a prompt must end with a token after "
                "its media"
            )
        return self

    def __len__(self) -> int:
        return len(self.tokens)

    @cached_property
    def _keys(self) -> Tuple[int, ...]:
        keys = list(self.tokens)
        for s in self.segments:
            keys[s.start : s.end] = [segment_key(s.digest, i) for i in range(s.length)]
        return tuple(keys)

    def keys(self) -> List[int]:
        """What prompt caches compare, position by position."""
        return list(self._keys)

    def prefix(self, n: int) -> "Prompt":
        """Its first ``n`` positions (which split no segment)."""
        if self.cut(n) != n:
            raise MTPError(f"a prefix of {n} positions would split a media segment")
        return Prompt(self.tokens[:n], tuple(s for s in self.segments if s.end <= n))

    def after(self, n: int) -> "Prompt":
        """Its positions from ``n`` on (``n`` splits no segment), as a prompt
        of their own: what is left to read once a cache holds ``prefix(n)``."""
        if self.cut(n) != n:
            raise MTPError(f"a suffix from {n} would split a media segment")
        return Prompt(
            self.tokens[n:], tuple(s.shifted(-n) for s in self.segments if s.start >= n)
        )

    def cut(self, n: int) -> int:
        """The longest prefix of at most ``n`` positions that splits no segment."""
        for s in self.segments:
            if s.start < n < s.end:
                return s.start
        return n

    def pieces(self, start: int, stop: int) -> List[Piece]:
        """The segments' parts that positions ``start .. stop - 1`` hold."""
        return [
            Piece(s, max(s.start, start) - start, max(start - s.start, 0),
                  min(stop, s.end) - s.start)
            for s in self.segments
            if s.start < stop and s.end > start
        ]  # fmt: skip

    def take(self, start: int, want: int) -> int:
        """How many positions a chunk from ``start`` reads, about ``want``
        (at least one): it ends before a segment it would split, or, where
        one starts at ``start``, after it."""
        stop = start + want
        for s in self.segments:
            if s.start < stop < s.end:
                return s.end - start if s.start <= start else s.start - start
        return want


def as_prompt(prompt: Union[Prompt, Sequence[int]]) -> Prompt:
    """``prompt`` as a ``Prompt`` (token ids: a text prompt)."""
    return prompt if isinstance(prompt, Prompt) else Prompt(tuple(prompt))


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading positions ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
