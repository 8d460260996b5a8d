"""Text a head learns from without generating it: files, folders, a ready corpus.

EAGLE and its successors train a head on fixed text the target never wrote,
with the target's own distribution at each position as the label: the trunk
reads a window once, teacher-forced, and its top-8 there is the head's target.
Text needs no generation, so it is the cheap bulk of a head's data.

The ready corpus (``--corpus``) is on every machine with the project
installed, and holds only text whose licence lets a trained head be shared:

- the Python standard library's own source, docstrings and comments included
  (PSF License 2.0), without its test suite;
- the long descriptions (READMEs) of installed packages whose metadata names
  a permissive licence (MIT, BSD, Apache, PSF, ISC, Unlicense, zlib).

Man pages and documentation without a machine-readable licence are left out.
Paragraphs of 40 characters or more are kept once over everything read
(licence headers and boilerplate repeat), a paragraph that holds a sentence
of the held-out prompts is dropped, and corpus documents are drawn in a
seeded order ``DOC_TOKENS`` at a time (every document's first piece, then
every document's second, ...), so no single large file dominates.
"""

import hashlib
import random
import re
import sysconfig
from collections.abc import Callable, Iterator, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from ..errors import MTPError
from .prompts import EVAL_PROMPTS

Sequence_ = tuple[list[int], int]  # tokens, answer start (0: all of it is target)
DOC_TOKENS = 2048  # one piece of a corpus document
DEFAULT_CORPUS_TOKENS = 1_000_000
TEXT_SUFFIXES = frozenset(
    [
        ".txt",
        ".md",
        ".rst",
        ".py",
        ".pyi",
        ".c",
        ".h",
        ".cc",
        ".cpp",
        ".hpp",
        ".js",
        ".ts",
        ".java",
        ".go",
        ".rs",
        ".rb",
        ".sh",
        ".toml",
        ".cfg",
        ".ini",
        ".yaml",
        ".yml",
        ".json",
        ".html",
        ".css",
        ".tex",
        ".sql",
    ]
)
PERMISSIVE = re.compile(
    r"\b(MIT|BSD|Apache|PSF|Python Software Foundation|ISC|Unlicense|zlib)\b",
    re.IGNORECASE,
)
MIN_DEDUP_CHARS = 40  # shorter paragraphs ("pass", "}") repeat naturally


def text_files(paths: Sequence[Path]) -> list[Path]:
    """``--text`` arguments as files: a file as given; a folder's text files by
    suffix, sorted, hidden folders and ``__pycache__`` skipped."""
    files = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted(f for f in p.rglob("*") if _wanted(f, p))
            if not found:
                raise MTPError(f"{p}: a folder with no text files")
            files += found
        elif p.is_file():
            files.append(p)
        else:
            raise MTPError(f"{p}: no such file or folder")
    return files


def _wanted(f: Path, root: Path) -> bool:
    hidden = any(
        part.startswith(".") or part == "__pycache__"
        for part in f.relative_to(root).parts
    )
    return f.is_file() and f.suffix.lower() in TEXT_SUFFIXES and not hidden


def _read(path: Path) -> str | None:
    """A file's text, or None for an unreadable, binary or non-UTF-8 one."""
    try:
        raw = path.read_bytes()
        if b"\x00" in raw[:65536]:
            return None
        return raw.decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def stdlib_files() -> list[Path]:
    """The standard library's ``.py`` files; its tests and installed packages out."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "idle_test"}
    return sorted(
        f
        for f in root.rglob("*.py")
        if not skip.intersection(f.relative_to(root).parts)
    )


def package_readmes() -> Iterator[tuple[str, str]]:
    """(name, long description) of installed packages under permissive licences."""
    dists = sorted(metadata.distributions(), key=lambda d: d.metadata["Name"] or "")
    for dist in dists:
        meta = dist.metadata
        licences = [meta.get("License") or "", meta.get("License-Expression") or ""]
        licences += [c for c in meta.get_all("Classifier") or [] if "License" in c]
        if not PERMISSIVE.search(" ".join(licences)):
            continue
        body = meta.get_payload() or meta.get("Description") or ""
        if len(body) > 200:
            yield f"{meta['Name']} (README)", body


def corpus_documents() -> list[tuple[str, Callable[[], str | None]]]:
    """The ready corpus as (name, read) pairs, read when asked."""
    docs: list[tuple[str, Callable[[], str | None]]] = [
        (f"stdlib/{f.name}", lambda f=f: _read(f)) for f in stdlib_files()
    ]
    docs += [(name, lambda b=body: b) for name, body in package_readmes()]
    return docs


def _norm(text: str) -> str:
    return " ".join(text.lower().split())


class Cleaner:
    """Drops repeated paragraphs (over every document it sees) and any paragraph
    that holds a sentence of the held-out prompts."""

    def __init__(self):
        self.seen: set[bytes] = set()
        self.held_out = [
            _norm(s)
            for prompts in EVAL_PROMPTS.values()
            for p in prompts
            for s in re.split(r"(?<=[.?!])\s+", p)
            if len(s) > 15
        ]

    def __call__(self, text: str) -> str:
        kept = []
        for para in re.split(r"\n\s*\n", text):
            norm = _norm(para)
            if not norm or any(s in norm for s in self.held_out):
                continue
            if len(norm) >= MIN_DEDUP_CHARS:
                key = hashlib.sha1(norm.encode()).digest()
                if key in self.seen:
                    continue
                self.seen.add(key)
            kept.append(para.strip("\n"))
        return "\n\n".join(kept)


def read_text(
    paths: Sequence[Path],
    corpus: bool,
    tokenizer: Any,
    max_tokens: int = 0,
    seed: int = 0,
    warn: Callable[[str], Any] = lambda text: None,
    window: int = 0,
) -> list[Sequence_]:
    """Token sequences of ``paths`` (files or folders) and, with ``corpus``, the
    ready corpus, cleaned (see ``Cleaner``), ``max_tokens`` at most (0: all the
    given text; with the corpus, ``DEFAULT_CORPUS_TOKENS``).

    The user's files come first, in order, then the corpus in a seeded order.
    A file named directly that is shorter than ``window`` tokens is reported
    through ``warn``.
    """
    named = {Path(p) for p in paths if Path(p).is_file()}
    docs = [
        (str(f), lambda f=f: _read(f), "file" if f in named else "folder")
        for f in text_files(paths)
    ]
    if corpus:
        extra = corpus_documents()
        random.Random(seed).shuffle(extra)
        docs += [(name, read, "corpus") for name, read in extra]
        max_tokens = max_tokens or DEFAULT_CORPUS_TOKENS
    clean, out, rest = Cleaner(), [], []
    budget = max_tokens or float("inf")
    for name, read, kind in docs:
        text = read()
        if text is None:
            if kind == "file":
                raise MTPError(f"{name}: not UTF-8 text")
            continue
        tokens = list(tokenizer.encode(clean(text)))
        if kind == "file" and window and len(tokens) < window:
            warn(short_warning(name, len(tokens), window))
        if kind == "corpus" and len(tokens) > DOC_TOKENS:  # the rest waits
            tokens, more = tokens[:DOC_TOKENS], tokens[DOC_TOKENS:]
            rest.append(more)
        budget = _take(tokens, budget, out)
        if budget <= 0:
            return out
    while rest and budget > 0:  # every document's next piece, in the same order
        later = []
        for tokens in rest:
            budget = _take(tokens[:DOC_TOKENS], budget, out)
            if budget <= 0:
                break
            if len(tokens) > DOC_TOKENS:
                later.append(tokens[DOC_TOKENS:])
        rest = later
    return out


def _take(tokens: list[int], budget: float, out: list[Sequence_]) -> float:
    """Append up to ``budget`` of ``tokens`` to ``out``; return what is left."""
    tokens = tokens[: int(min(budget, len(tokens)))]
    if len(tokens) >= 8:
        out.append((tokens, 0))
        budget -= len(tokens)
    return budget


def short_warning(name: str, n: int, window: int) -> str:
    return (
        f"warning: {name}: {n} tokens, shorter than one {window}-token window "
        "(--seq-len); it gives little to train on"
    )
