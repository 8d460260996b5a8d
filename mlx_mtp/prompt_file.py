"""Prompt caches on disk: an ``StreamCache`` and the tokens it has read, in
mlx-lm's prompt-cache file format.

The file is what mlx-lm's ``save_prompt_cache`` writes (one safetensors file:
each cache's state under ``"i.j"``, then mlx-lm's metadata: the user's
entries, each cache's class, its scalars), so ``mlx_lm.models.cache.
load_prompt_cache`` reads it: its first entries are the trunk's caches in
mlx-lm's classes (``KVCache``, ``QuantizedKVCache``, ``RotatingKVCache``,
``ArraysCache``, ``CacheList``); the rest are mlx-mtp's drafters: each
drafter's caches, then an ``ArraysCache`` of the features it has not read
yet. mlx-mtp's own entries (``mlx_mtp.*``) say which model wrote it, the
tokens, the prompt text, the cache policy (``kv.KVSettings``) and the
layout; a file for another model, another layout or a damaged one is a
one-line ``MTPError`` before anything is read into a cache.

Every file carries a SHA-256 of its bytes (``mlx_mtp.checksum``: the header
with that value zeroed, then the arrays), written once the file is (the
value has a fixed length, so it is filled in place) and checked whenever
the file is read whole (``load``): a file damaged in place, its size and
header intact, is ``Damaged`` before any of it reaches a cache, and so is a
file an older version wrote without one (it cannot be told from a damaged
one). A state read back is therefore always one that was verified, and only
such a state is ever written again.

Writes are atomic: a temporary file beside the target, flushed, then renamed
over it; a failed write leaves the target as it was. A file that is not a
prompt cache is never overwritten.
"""

import hashlib
import json
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

import mlx.core as mx
from mlx.utils import tree_unflatten
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    save_prompt_cache,
)

from .cache import StreamCache, Pending, truncatable
from .config import cached_identity
from .defaults import DEFAULT_PREFILL_STEP
from .errors import MTPError, first_line
from .kv import KVSettings, QuantizingKVCache, RollingKVCache
from .prompt import Prompt, Segment, as_prompt, common_prefix
from .prompts import encode, has_chat_template, user_prompt
from .speculative import prefill
from .vision import as_picture, image_blocks, image_list, with_images
from .weights import check_safetensors

FORMAT = "mlx-mtp prompt cache 1"
_KEY = "mlx_mtp."
CHECKSUM = _KEY + "checksum"
_ALGORITHM = "sha256"
_UNSEALED = "0" * 64  # the value written first, filled in once the file is whole
# the checksum's value in the header as mlx writes it (compact JSON; the
# user's entries sit under "0."): a quote inside a string is escaped, so
# this matches the key itself, never a prompt's text
_SEAL = re.compile(
    rb'"0\.' + re.escape(CHECKSUM.encode()) + rb'":"' + _ALGORITHM.encode()
    + rb':([0-9a-f]{64})"'
)  # fmt: skip
_CHUNK = 1 << 22  # bytes hashed at a time


class Damaged(MTPError):
    """A prompt-cache file whose bytes are not those that were written (its
    checksum does not match), or that carries no checksum (an older
    version wrote it): nothing of it may be used."""


@dataclass
class PromptFile:
    """What a prompt-cache file holds: the cache, the tokens its trunk has
    read, and how they were made (``prompt``: the text, ``system``, whether
    the chat template opened a user message with it, the cache policy)."""

    cache: StreamCache
    tokens: List[int]
    prompt: str = ""
    system: Optional[str] = None
    chat_template: bool = False
    kv: KVSettings = field(default_factory=KVSettings)
    segments: Tuple[Segment, ...] = ()  # the media read in the tokens' places

    @property
    def keys(self) -> List[int]:
        """What prompt caches compare (``Prompt.keys``)."""
        return Prompt(tuple(self.tokens), self.segments).keys()


def _segments(meta: Dict[str, str]) -> Tuple[Segment, ...]:
    """The media segments a file's metadata names (start, length, digest,
    kind); their content is not kept, only what it is."""
    found = json.loads(meta.get(_KEY + "segments", "[]"))
    return tuple(Segment(int(a), int(n), str(d), str(k)) for a, n, d, k in found)


SAMPLE = 1 << 16  # bytes read at each of three places of a weight file


def _weights_sample(model) -> str:
    """A digest of three slices of each weight file (start, middle, end):
    models of one architecture differ there, and reading them is cheap."""
    digest = hashlib.sha256()
    for folder in sorted({model.path, model.head_dir or model.path} - {None}):
        for f in sorted(Path(folder).glob("*.safetensors")):
            size = f.stat().st_size
            with open(f, "rb") as fh:
                for at in (0, size // 2, max(size - SAMPLE, 0)):
                    fh.seek(at)
                    digest.update(fh.read(SAMPLE))
    return digest.hexdigest()[:16]


def identity(model) -> str:
    """Which model a cache belongs to: its config and weight files (names,
    sizes, a sample of their bytes), its hidden-state tap and its drafters;
    computed once per loaded model."""
    known = getattr(model, "_prompt_cache_identity", None)
    if known is None:
        known = json.dumps(
            {
                **cached_identity(model),
                "sample": _weights_sample(model),
                "hidden_tap": model.target.hidden_tap,
                "drafters": [d.name for d in model.drafters],
            },
            sort_keys=True,
        )
        object.__setattr__(model, "_prompt_cache_identity", known)
    return known


# -- writing -----------------------------------------------------------------------


def _as_mlx_lm(c: Any) -> Any:
    """``c`` as the mlx-lm cache of the same content (what the file holds).
    A cache that turns quantized at its next write is written quantized (the
    same values that write would make)."""
    if isinstance(c, QuantizingKVCache) and not c.quantized and c.width_limit() is None:
        c = c.copy()
        c.quantize()
    if isinstance(c, QuantizingKVCache) and c.quantized:
        out = QuantizedKVCache(c.group_size, c.kv_bits)
        if c.keys is not None:
            out.keys, out.values = c.keys_and_values()
        out.offset = c.offset
        return out
    if isinstance(c, RollingKVCache):
        out = RotatingKVCache(c.max_size, c.keep)
        if c.keys is not None:
            out.keys, out.values = c.keys_and_values()
        out.offset, out._idx = c.offset, c.offset - c.dropped
        return out
    if isinstance(c, KVCache):
        out = KVCache()
        if c.keys is not None:
            out.keys, out.values = c.keys_and_values()
        out.offset = c.offset
        return out
    if isinstance(c, ArraysCache):
        out = ArraysCache(len(c.cache))
        out.cache = list(c.cache)
        return out
    if hasattr(c, "caches"):  # a CacheList
        return CacheList(*(_as_mlx_lm(x) for x in c.caches))
    if hasattr(c, "link"):  # a cache that reads the target's (its count alone)
        return ArraysCache(0)
    raise MTPError(f"cannot save a cache of kind {type(c).__name__}")


def _entries(model, cache: StreamCache) -> Tuple[List[Any], Dict[str, Any]]:
    """The file's caches (mlx-lm's classes) and the layout that reads them back."""
    entries = [_as_mlx_lm(c) for c in cache.trunk]
    drafters = []
    for d in model.drafters:
        state = cache.drafts[d.name]
        entries += [_as_mlx_lm(c) for c in state.caches]
        pending = ArraysCache(len(state.pending))
        pending.cache = [q.hidden for q in state.pending]
        entries.append(pending)
        drafters.append(
            {
                "name": d.name,
                "caches": len(state.caches),
                "start": list(state.start),
                "tokens": [list(q.tokens) for q in state.pending],
                "offsets": [getattr(c, "offset", 0) for c in state.caches],
            }
        )
    return entries, {"trunk": len(cache.trunk), "drafters": drafters}


def _is_prompt_cache(path: Path) -> bool:
    """Whether ``path`` holds a prompt cache (mlx-mtp's or mlx-lm's)."""
    try:
        _, meta = _header(path)
    except MTPError:
        return False
    return any(k.startswith("1.") for k in meta)  # mlx-lm's cache classes


def prepare(
    model,
    cache: StreamCache,
    tokens,
    *,
    prompt: str = "",
    system: Optional[str] = None,
    chat_template: bool = False,
    kv: Optional[KVSettings] = None,
) -> Tuple[List[Any], Dict[str, str]]:
    """What ``save`` writes of ``cache`` (which has read ``tokens``: token
    ids, or a ``Prompt`` with media, whose digests are kept): the file's
    caches, their arrays evaluated (another thread may write them:
    ``write``), and its metadata."""
    read = as_prompt(tokens)
    entries, layout = _entries(model, cache)
    mx.eval([c.state for c in entries])
    metadata = {
        # mlx-lm's own entries (its generate reads them with such a file)
        "model": str(model.path or ""),
        "tokenizer_config": "{}",
        _KEY + "format": FORMAT,
        _KEY + "model": identity(model),
        _KEY + "tokens": json.dumps(list(read.tokens)),
        _KEY + "segments": json.dumps(
            [[g.start, g.length, g.digest, g.kind] for g in read.segments]
        ),
        _KEY + "prompt": prompt,
        _KEY + "system": json.dumps(system),
        _KEY + "chat_template": json.dumps(chat_template),
        _KEY + "kv": json.dumps((kv or KVSettings()).metadata()),
        _KEY + "layout": json.dumps(layout),
        CHECKSUM: f"{_ALGORITHM}:{_UNSEALED}",  # ``_seal`` fills it in
    }
    return entries, metadata


def write(path: Union[str, Path], entries: List[Any], metadata: Dict[str, str]):
    """Write ``prepare``'s caches and metadata to ``path``, atomically. A file
    there that is not a prompt cache is an error (it is not replaced)."""
    path = Path(path)
    if path.exists() and (not path.is_file() or not _is_prompt_cache(path)):
        raise MTPError(f"{path} exists and is not a prompt cache: not overwritten")

    def whole(tmp):
        save_prompt_cache(tmp, entries, metadata)
        _seal(Path(tmp))

    write_atomic(path, whole)


def save(path: Union[str, Path], model, cache: StreamCache, tokens: List[int], **info):
    """Write ``cache`` (which has read ``tokens``) to ``path``, atomically;
    ``info``: ``prepare``'s ``prompt``, ``system``, ``chat_template``, ``kv``."""
    write(path, *prepare(model, cache, tokens, **info))


def write_atomic(path: Path, write) -> None:
    """``write(temporary file name)``, then the file renamed to ``path``: a
    reader sees the old file or the whole new one, never a part. The
    temporary file is removed if the write fails."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(
        prefix=f".{path.name}.", suffix=".tmp.safetensors", dir=path.parent
    )
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(e, OSError):
            raise MTPError(f"cannot write {path}: {first_line(e)}") from None
        raise


# -- the checksum --------------------------------------------------------------------


def _digest(f, header: bytes, at: int) -> str:
    """The checksum of the open file ``f``, whose header ``header`` holds
    the checksum's value at ``at``: the header with that value zeroed, then
    the rest of the file, read in chunks into one buffer (no copies)."""
    digest = hashlib.new(_ALGORITHM)
    digest.update(len(header).to_bytes(8, "little"))
    digest.update(header[:at])
    digest.update(_UNSEALED.encode())
    digest.update(header[at + len(_UNSEALED) :])
    f.seek(8 + len(header))
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    while n := f.readinto(buffer):
        digest.update(view[:n])
    return digest.hexdigest()


def _sealed(f, path: Path) -> Tuple[bytes, "re.Match"]:
    """The header of the open file ``f`` and where its checksum is."""
    f.seek(0)
    n = int.from_bytes(f.read(8), "little")
    header = f.read(n)
    found = list(_SEAL.finditer(header))
    if not found and f'"0.{CHECKSUM}"'.encode() in header:
        raise Damaged(f"{path}: damaged prompt cache (its checksum)")
    if not found:
        raise Damaged(
            f"{path}: written by an older version of mlx-mtp (it carries no "
            "checksum): make it again"
        )
    if len(found) > 1:
        raise Damaged(f"{path}: damaged prompt cache (its checksum)")
    return header, found[0]


def _seal(path: Path) -> None:
    """Fill in the checksum of the file just written at ``path``."""
    with open(path, "rb+") as f:
        header, found = _sealed(f, path)
        digest = _digest(f, header, found.start(1))
        f.seek(8 + found.start(1))
        f.write(digest.encode())


def verify(f, path: Path) -> None:
    """``Damaged`` unless the bytes of the open file ``f`` (``path``) are
    those its checksum was made of."""
    header, found = _sealed(f, path)
    if _digest(f, header, found.start(1)) != found.group(1).decode():
        raise Damaged(
            f"{path}: damaged prompt cache (its checksum does not match its data)"
        )


# -- reading -------------------------------------------------------------------------


def _header(path: Path) -> Tuple[int, Dict[str, str]]:
    """The header's size and the metadata of the safetensors file ``path``,
    read without its arrays; a damaged file is one line."""
    check_safetensors(path)
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    meta = header.get("__metadata__") or {}
    if not isinstance(meta, dict):
        raise MTPError(f"{path}: not a prompt cache (no metadata)")
    return n, meta


def check(path: Union[str, Path]) -> Dict[str, str]:
    """The metadata of the prompt cache at ``path``, checked as far as it can
    be without the model and its arrays: a missing, damaged or foreign file,
    or one without a checksum, is one line."""
    meta = _metadata(Path(path))
    if CHECKSUM not in meta:
        raise Damaged(
            f"{path}: written by an older version of mlx-mtp (it carries no "
            "checksum): make it again"
        )
    return meta


def _metadata(path: Path) -> Dict[str, str]:
    """``check`` but for the checksum."""
    if not path.is_file():
        raise MTPError(f"{path}: no such prompt cache file")
    _, meta = _header(path)
    mine = {k[len("0.") :]: v for k, v in meta.items() if k.startswith("0.")}
    if mine.get(_KEY + "format") != FORMAT:
        if any(k.startswith("1.") for k in meta):
            raise MTPError(
                f"{path}: a prompt cache mlx-lm wrote (it holds no tokens or "
                "drafters): write it with mlx-mtp cache-prompt"
            )
        raise MTPError(f"{path}: not a prompt cache")
    for key in ("tokens", "layout", "kv", "model"):
        try:
            json.loads(mine[_KEY + key])
        except (KeyError, ValueError):
            raise MTPError(f"{path}: damaged prompt cache (its {key})") from None
    return mine


@dataclass
class Header:
    """What a prompt-cache file says of itself, read without its arrays."""

    model: Dict[str, Any]  # ``identity``'s fields
    kv: Dict[str, str]  # ``KVSettings.metadata``
    tokens: List[int]
    sealed: bool  # whether it carries a checksum (an older version's does not)
    segments: Tuple[Segment, ...] = ()

    @property
    def keys(self) -> List[int]:
        """What prompt caches compare (``Prompt.keys``)."""
        return Prompt(tuple(self.tokens), self.segments).keys()


def peek(path: Union[str, Path]) -> Header:
    """The header of the prompt cache at ``path`` (``check``'s errors, but
    for a missing checksum: ``sealed``)."""
    meta = _metadata(Path(path))
    return Header(
        json.loads(meta[_KEY + "model"]),
        json.loads(meta[_KEY + "kv"]),
        json.loads(meta[_KEY + "tokens"]),
        CHECKSUM in meta,
        _segments(meta),
    )


def _read(f, path: Path) -> List[Any]:
    """Each cache's state, as mlx-lm's ``load_prompt_cache`` rebuilds them,
    from the open file ``f``: verified first, then read from the same file
    (a rename over ``path`` meanwhile changes neither)."""
    verify(f, path)
    f.seek(0)
    try:
        arrays, meta = mx.load(f, format="safetensors", return_metadata=True)
    except Exception as e:  # mx.load raises bare RuntimeError/ValueError
        raise MTPError(f"{path}: cannot read it ({first_line(e)})") from None
    _, classes, scalars = tree_unflatten(list(meta.items()))
    for pos, kind in scalars[1:]:
        a = arrays[pos]
        if kind == "scalar":
            arrays[pos] = a.item()
        elif kind == "string":
            arrays[pos] = "".join(chr(i) for i in a.tolist())
        else:
            arrays[pos] = None
    states = tree_unflatten(list(arrays.items())) if arrays else []
    states = [s if s != {} else [] for s in states]  # (a cache with no arrays)
    states += [[]] * (len(classes) - len(states))
    return list(zip(classes, states))


def _arrays(state: Any) -> List[Any]:
    """An ``ArraysCache``'s arrays from its state (``cache, left_padding,
    lengths``)."""
    return list(state[0]) if state else []


def _put(c: Any, kind: str, state: Any, where: str) -> None:
    """Read one file entry into the fresh cache ``c`` (its kind must fit)."""
    if isinstance(c, KVCache):
        fits = {
            QuantizingKVCache: ("KVCache", "QuantizedKVCache"),
            RollingKVCache: ("KVCache", "RotatingKVCache"),
        }.get(type(c), ("KVCache",))
        if kind not in fits:
            raise MTPError(f"{where}: holds a {kind} where this model has another")
        keys, values, offset = state[0], state[1], state[2]
        if kind == "QuantizedKVCache":
            keys, values = tuple(keys), tuple(values)
            c.bits = c.kv_bits
        c.keys, c.values, c.offset = keys, values, int(offset)
        if kind == "RotatingKVCache":
            c.dropped = int(offset) - int(state[5])
        return
    if isinstance(c, ArraysCache):
        state = _arrays(state)
        if kind != "ArraysCache" or len(state) != len(c.cache):
            raise MTPError(f"{where}: holds a {kind} where this model has another")
        c.cache = list(state)
        return
    if hasattr(c, "caches"):
        if kind != "CacheList":
            raise MTPError(f"{where}: holds a {kind} where this model has another")
        for sub, s in zip(c.caches, state):
            _put(sub, type(_as_mlx_lm(sub)).__name__, s, where)
        return
    if hasattr(c, "link"):
        return  # its count comes from the layout
    raise MTPError(f"{where}: cannot read into a cache of kind {type(c).__name__}")


def load(path: Union[str, Path], model) -> PromptFile:
    """The prompt cache at ``path`` for ``model``; one line where it is for
    another model, has another layout or is damaged (``Damaged``: its
    checksum does not match its bytes, or it has none). The file is never
    removed here."""
    path = Path(path)
    meta = check(path)
    if json.loads(meta[_KEY + "model"]) != json.loads(identity(model)):
        raise MTPError(
            f"{path}: a prompt cache of another model (or of other weights, "
            "drafters or hidden tap)"
        )
    kv_meta = json.loads(meta[_KEY + "kv"])
    kv = KVSettings(
        int(kv_meta["kv_bits"]) or None,
        int(kv_meta["kv_group_size"]),
        int(kv_meta["quantized_kv_start"]),
        int(kv_meta["max_kv_size"]) or None,
    )
    layout = json.loads(meta[_KEY + "layout"])
    cache = model.make_cache()
    kv.apply(cache)
    names = [d["name"] for d in layout["drafters"]]
    if layout["trunk"] != len(cache.trunk) or names != [d.name for d in model.drafters]:
        raise MTPError(f"{path}: its layout is not this model's")
    try:
        with open(path, "rb") as f:
            entries = _read(f, path)
    except OSError as e:
        raise MTPError(f"{path}: cannot read it ({first_line(e)})") from None
    expected = len(cache.trunk) + sum(d["caches"] + 1 for d in layout["drafters"])
    if len(entries) != expected:
        raise MTPError(f"{path}: damaged prompt cache ({len(entries)} entries, "
                       f"its layout says {expected})")  # fmt: skip
    where = str(path)
    for c, (kind, state) in zip(cache.trunk, entries):
        _put(c, kind, state, where)
    at = len(cache.trunk)
    for d in layout["drafters"]:
        state = cache.drafts[d["name"]]
        if d["caches"] != len(state.caches):
            raise MTPError(f"{path}: its layout is not this model's")
        for c, (kind, s), offset in zip(state.caches, entries[at:], d["offsets"]):
            _put(c, kind, s, where)
            if hasattr(c, "link"):
                c.offset = offset
        at += d["caches"]
        hidden = _arrays(entries[at][1])
        state.pending = [
            Pending(h, list(t)) if h is not None else Pending()
            for h, t in zip(hidden, d["tokens"])
        ]
        state.start = list(d["start"])
        at += 1
    cache.link()
    return PromptFile(
        cache=cache,
        tokens=json.loads(meta[_KEY + "tokens"]),
        prompt=meta.get(_KEY + "prompt", ""),
        system=json.loads(meta.get(_KEY + "system", "null")),
        chat_template=json.loads(meta.get(_KEY + "chat_template", "false")),
        kv=kv,
        segments=_segments(meta),
    )


# -- a prompt read once, continued later ---------------------------------------------


def prompt_text(tokenizer, prompt: str, system: Optional[str], template: bool) -> str:
    """The text a cached prompt stands for: with the chat template, a user
    message (after ``system``) left open, so that a later message that
    starts with ``prompt`` starts with these tokens (as mlx-lm's
    ``cache_prompt``)."""
    if not template:
        return prompt
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": prompt})
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=False,
        continue_final_message=True,
    )  # fmt: skip


def cache_prompt(
    model,
    tokenizer,
    prompt: str,
    path: Union[str, Path],
    *,
    system: Optional[str] = None,
    chat_template: bool = True,
    kv: Optional[KVSettings] = None,
    step: int = DEFAULT_PREFILL_STEP,
    progress=None,
    image=None,
) -> int:
    """Read ``prompt`` (trunk, head and drafters) and write its cache to
    ``path``; returns how many tokens it holds. ``progress(done, total)``
    hears the reading. ``image`` (a path or paths): the images a vision
    model reads with it (an image block each in front, where the text names
    none); the file keeps their digests, and a continuation must show the
    same images (``continue_from``)."""
    template = chat_template and has_chat_template(tokenizer)
    prompt = image_blocks(model, tokenizer, prompt, image)
    text = prompt_text(tokenizer, prompt, system, template)
    read = as_prompt(with_images(model, tokenizer, text, image) if image
                     else encode(tokenizer, text))  # fmt: skip
    kv = kv or KVSettings()
    kv.validate()
    kv.check_model(model)
    cache = model.make_cache()
    kv.apply(cache)
    # the trunk reads every token (the placeholder after them is where a
    # continuation starts: ``prefill`` leaves a prompt's last token unread)
    prefill(model, cache, Prompt(read.tokens + (0,), read.segments), step,
            progress=progress)  # fmt: skip
    save(path, model, cache, read, prompt=prompt, system=system,
         chat_template=template, kv=kv)  # fmt: skip
    return len(read)


def _same_images(cached: "PromptFile", image) -> list:
    """The images ``image`` names, which must be those ``cached`` read (by
    digest, in order); a one-line error where they are not."""
    pictures = [as_picture(i) for i in image_list(image)]
    want = [s.digest for s in cached.segments if s.kind == "image"]
    if [p.digest for p in pictures] != want:
        if not want:
            raise MTPError("the prompt cache holds no images: continue it "
                           "without --image")  # fmt: skip
        names = ", ".join(d[:12] for d in want)
        given = f"{len(pictures)} other" if pictures else "none"
        raise MTPError(
            f"the prompt cache was read with {len(want)} image(s) (sha256 "
            f"{names}) and {given} given: pass the same with --image"
        )
    return pictures


def continue_from(
    cached: PromptFile,
    model,
    tokenizer,
    text: str,
    system: Optional[str] = None,
    image=None,
):
    """The prompt of ``cached.prompt`` followed by ``text`` (one user message
    through the chat template when the file was made with it), as
    ``(what is still to read, what the cache holds, the cache)``: token ids,
    or, for a file read with images, ``Prompt`` s; the cache is cut back to
    what the prompt shares with it, so the output is that of reading the
    whole prompt. ``image``: the images the file was read with (the same
    ones, by digest; else a one-line ``MTPError``)."""
    pictures = _same_images(cached, image) if cached.segments or image else []
    whole = cached.prompt + text
    if cached.chat_template:
        full = user_prompt(tokenizer, whole, system if system else cached.system)
    else:
        full = whole
    read = as_prompt(
        with_images(model, tokenizer, full, pictures) if pictures
        else encode(tokenizer, full)
    )  # fmt: skip
    keep = read.cut(min(common_prefix(cached.keys, read.keys()), len(read) - 1))
    cache = cached.cache
    if keep < len(cached.tokens):
        if truncatable(cache):
            keep = cache.truncate(keep, model.drafters)
        if not truncatable(cache) or read.cut(keep) != keep:
            cache, keep = model.make_cache(), 0
            cached.kv.apply(cache)
    if not pictures:
        return list(read.tokens[keep:]), list(read.tokens[:keep]), cache
    return read.after(keep), read.prefix(keep), cache
