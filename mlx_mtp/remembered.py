"""What a model's drafters' drafts were worth in earlier generations here,
kept across processes for the command line's ``generate`` and ``chat``.

A server keeps one ``adaptive.AcceptanceHistory`` for its life; each
``mlx-mtp generate`` is a process of its own, so without this every run
would meet its drafters anew: ramp from the default guess, pay its first
rejected rounds and read along, about 3% of a 128-token answer for a
drafter that never agrees (a DFlash block on a CPU). With it, a run starts
each drafter where the runs before left it and leaves out one that cannot
pay by them (but for one run in ``adaptive.HISTORY_RETRY``).

The histories live in ``$XDG_CACHE_HOME/mlx-mtp/acceptance.json``, keyed by
the model's files (as ``probe`` keys its costs) and each drafter's
``Drafter.key`` (another checkpoint of a kind starts anew); the machine does
not enter (acceptance is the model's and the text's). Writes are atomic;
a file that cannot be read or written is ignored (the run starts anew).
Over several processes (``mlx.launch``) none is kept: every rank must
draft alike. ``MLX_MTP_HISTORY=off`` turns it off (the test suite does).
"""

import os
from pathlib import Path
from typing import Any, Dict, List, Optional

from . import config
from .adaptive import AcceptanceHistory

HISTORY_FILE = "acceptance.json"
MAX_ENTRIES = 32  # models kept in the file; the oldest written go first


def history_file() -> Path:
    return config.cache_file(HISTORY_FILE)


def enabled(model) -> bool:
    if os.environ.get("MLX_MTP_HISTORY", "").lower() in ("off", "0", "no"):
        return False
    return bool(model.drafters) and not config.sharded(model)


def load(model) -> Optional[AcceptanceHistory]:
    """``model``'s history, as the runs before left it (one object per
    loaded model: generations in one process share it); None where none is
    kept."""
    if not enabled(model):
        return None
    found = getattr(model, "_remembered", None)
    if found is not None:
        return found
    history = AcceptanceHistory()
    entry = _entry(_read(), config.cached_identity(model))
    stored = (entry or {}).get("drafters") or {}
    for d in model.drafters:
        one = stored.get(d.key)
        try:
            tests = [float(x) for x in one["tests"]]
            kept = [float(x) for x in one["kept"]]
            left_out = int(one.get("left_out", 0))
        except (TypeError, KeyError, ValueError):
            continue  # none, or damaged: this drafter starts anew
        if len(tests) == len(kept) and all(0 <= k <= t for k, t in zip(kept, tests)):
            history.tests[d.name], history.kept[d.name] = tests, kept
            history.left_out[d.name] = left_out
    object.__setattr__(model, "_remembered", history)
    return history


def save(model, history: Optional[AcceptanceHistory]) -> None:
    """Write ``history`` as ``model``'s (its drafters' entries replaced)."""
    if history is None or not enabled(model):
        return
    identity = config.cached_identity(model)
    entries = _read()
    entry = _entry(entries, identity) or {"model": identity, "drafters": {}}
    drafters = dict(entry.get("drafters") or {})
    for d in model.drafters:
        if d.name in history.tests:
            drafters[d.key] = {
                "tests": [round(t, 4) for t in history.tests[d.name]],
                "kept": [round(k, 4) for k in history.kept[d.name]],
                "left_out": history.left_out.get(d.name, 0),
            }
    kept = [e for e in entries if e.get("model") != identity]
    data = (kept + [{"model": identity, "drafters": drafters}])[-MAX_ENTRIES:]
    config.write_entries(history_file(), data)


def _entry(entries: List[Dict[str, Any]], identity) -> Optional[Dict[str, Any]]:
    return next((e for e in entries if e.get("model") == identity), None)


def _read() -> List[Dict[str, Any]]:
    return config.read_entries(history_file())
