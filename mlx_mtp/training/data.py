"""Training text for an MTP head: the user's files, and the trunk's own answers.

Sequences are ``(tokens, answer_start)``: only tokens from ``answer_start`` on
are targets (a head drafts answers, never prompts). Self-distilled answers come
from mlx-lm's continuous batching (``BatchGenerator``), many prompts per
forward, and are appended to a JSON-lines file as each one finishes, so an
interrupted run loses at most the answers still in flight.
"""

import json
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from ..errors import MTPError
from .prompts import Prompt, render_prompt

Sequence_ = tuple[list[int], int]  # tokens, answer start
DEFAULT_DISTILL_TOKENS = 256
DEFAULT_DISTILL_BATCH = 32


def check_data_file(path: Path) -> list[dict[str, Any]]:
    """Read and check a ``--data`` file before any model work.

    Returns its rows (``{"tokens": [...], "prompt_len": n}`` or ``{"text": s}``);
    raises ``MTPError`` with one line for a missing, empty, binary or
    non-UTF-8 file and for a bad JSON line.
    """
    path = Path(path)
    try:
        raw = path.read_bytes()
    except IsADirectoryError:
        raise MTPError(f"{path}: is a folder, not a text file") from None
    except FileNotFoundError:  # the OS says "directory": the CLI says folder
        raise MTPError(f"{path}: no such file or folder") from None
    except OSError as e:
        raise MTPError(f"{path}: cannot read ({e.strerror})") from None
    if not raw.strip():
        raise MTPError(f"{path}: empty file")
    if b"\x00" in raw[:65536]:
        raise MTPError(f"{path}: a binary file, not text")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise MTPError(f"{path}: not UTF-8 text (byte {e.start})") from None
    if path.suffix != ".jsonl":
        return [{"text": text}]
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            raise MTPError(f"{path}:{n}: not a JSON line") from None
        if not isinstance(row, dict) or not ("tokens" in row or "text" in row):
            raise MTPError(f'{path}:{n}: a line needs "tokens" or "text"')
        rows.append(row)
    if not rows:
        raise MTPError(f"{path}: no JSON lines")
    return rows


def encode_rows(rows: Iterable[dict[str, Any]], tokenizer: Any) -> list[Sequence_]:
    """Rows of ``check_data_file`` as ``(tokens, answer_start)``."""
    out = []
    for row in rows:
        if "tokens" in row:
            out.append(([int(t) for t in row["tokens"]], int(row.get("prompt_len", 0))))
        else:
            out.append((list(tokenizer.encode(row["text"])), 0))
    return out


def read_data_file(path: Path, tokenizer: Any) -> list[Sequence_]:
    return encode_rows(check_data_file(path), tokenizer)


def chunk_sequences(
    seqs: Iterable[Sequence_], length: int, min_len: int = 8
) -> list[Sequence_]:
    """Cut sequences into windows of at most ``length`` tokens.

    Each window keeps where its answer starts, relative to the window; a
    window with no target left is dropped.
    """
    out = []
    for seq, start in seqs:
        for i in range(0, len(seq), length):
            piece = seq[i : i + length]
            if len(piece) >= min_len and i + len(piece) > start + 1:
                out.append((piece, max(0, start - i)))
    return out


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """JSON lines written by ``self_distill``; a torn last line is dropped."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break  # an interrupted write: everything before it is whole
    return rows


def self_distill(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[Prompt],
    max_tokens: int,
    out_file: Path,
    batch_size: int = DEFAULT_DISTILL_BATCH,
    progress: Callable[[int], None] | None = None,
    should_stop: Callable[[], bool] = lambda: False,
) -> list[Sequence_]:
    """The trunk's greedy answers to ``prompts``, resumed from ``out_file``.

    ``model`` is mlx-lm's model. Answers are generated ``batch_size`` at a time
    by mlx-lm's ``BatchGenerator`` (continuous batching: a finished answer's
    slot takes the next prompt at once). Each answer is appended to
    ``out_file`` as ``{"i": prompt index, "tokens": prompt + answer,
    "prompt_len": n}`` when it ends (stop token kept: the head drafts it too).
    Returns every finished sequence in prompt order; stops early, keeping what
    is done, when ``should_stop()`` turns true. ``progress(n)`` hears answer
    tokens as they are written, and an answer's unused budget when it ends
    early: ``len(prompts) * max_tokens`` in all (answers resumed from
    ``out_file`` at once).
    """
    from mlx_lm.generate import BatchGenerator

    _repair(out_file)
    done = {r["i"]: r for r in read_jsonl(out_file) if r["i"] < len(prompts)}
    todo = [i for i in range(len(prompts)) if i not in done]
    progress = progress or (lambda n: None)
    if done:
        progress(len(done) * max_tokens)
    if todo and not should_stop():
        rendered = [render_prompt(tokenizer, prompts[i]) for i in todo]
        gen = BatchGenerator(
            model,
            max_tokens=max_tokens,
            stop_tokens=[[t] for t in tokenizer.eos_token_ids],
            completion_batch_size=batch_size,
            prefill_batch_size=min(batch_size, 8),
        )
        try:
            uids = gen.insert(rendered)
            index = {u: (i, p) for u, i, p in zip(uids, todo, rendered)}
            answers = {u: [] for u in uids}
            with open(out_file, "a") as f:
                while not should_stop() and (responses := gen.next_generated()):
                    written = len(responses)
                    for r in responses:
                        answers[r.uid].append(int(r.token))
                        if r.finish_reason is None:
                            continue
                        i, prompt = index[r.uid]
                        answer = answers.pop(r.uid)
                        written += max_tokens - len(answer)
                        row = {"i": i, "tokens": prompt + answer}
                        row["prompt_len"] = len(prompt)
                        f.write(json.dumps(row) + "\n")
                        f.flush()
                        done[i] = row
                    progress(written)
        finally:
            gen.close()
    return [(done[i]["tokens"], done[i]["prompt_len"]) for i in sorted(done)]


def _repair(path: Path) -> None:
    """Cut a torn last line (a write interrupted by a kill) off ``path``."""
    if not path.exists():
        return
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        path.write_bytes(data[: data.rfind(b"\n") + 1])
